"""GPU-ready images, proven without a GPU: DeepSpeed's prebuilt CUDA ops load under the
`cuda` accelerator and compile nothing, torch.compile works, and the devel flavor
compiles CUDA code just in time. Each image is built by build.py, which runs the
smoke suite and the structure checks (pytorch_cuda_build/checks, test_devel.py among them) before
it tags anything; these tests then check the promises from the outside, as a user would.
"""
from __future__ import annotations

import json
import os

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import lock

from helpers import ROOT, run_build_py, run_image, shown

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEVEL = MATRIX.select("2.7", "12.1", "devel")
CUDA13 = MATRIX.select("2.11", "13.0")

LOAD = (
    "import json, os; from deepspeed.accelerator import get_accelerator; "
    "from deepspeed.ops.op_builder.all_ops import ALL_OPS; "
    "[get_accelerator().create_op_builder(type(ALL_OPS[o]).__name__).load(verbose=False) for o in os.environ['OPS'].split(',')]; "
    "print(json.dumps({'accelerator': get_accelerator()._name, "
    "'built': [f for _, _, fs in os.walk(os.environ['TORCH_EXTENSIONS_DIR']) for f in fs]}))"
)


def build(image: matrix.Image) -> None:
    proc = run_build_py(ROOT, "--torch", image.torch, "--cuda", image.cuda, "--flavor", image.flavor, "--quiet", timeout=5400)
    assert proc.returncode == 0, shown(proc)


def prebuilt_ops_load(ref: str, image: matrix.Image) -> None:
    """The issue's own command: `docker run --rm -e DS_ACCELERATOR=cuda IMAGE python -c ...`."""
    proc = run_image(ref, ["python", "-c", LOAD], ("-e", "DS_ACCELERATOR=cuda", "-e", "PYTORCH_CUDA_NO_BANNER=1",
                                                  "-e", "TORCH_EXTENSIONS_DIR=/tmp/ext", "-e", f"OPS={','.join(image.prebuilt_ops)}"))
    assert proc.returncode == 0, shown(proc)
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts == {"accelerator": "cuda", "built": []}, facts
    report = run_image(ref, ["ds_report"], ("-e", "DS_ACCELERATOR=cuda", "-e", "PYTORCH_CUDA_NO_BANNER=1"))
    for op in image.prebuilt_ops:
        line = next((ln for ln in report.stdout.splitlines() if ln.startswith(op + " ")), "")
        assert "[YES]" in line, (op, line, shown(report))


def test_default_row_loads_every_prebuilt_cuda_op_without_compiling():
    build(MATRIX.select("2.7", "12.1"))
    prebuilt_ops_load("pytorch-cuda:v2.7", MATRIX.select("2.7", "12.1"))


@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_DEVEL") != "1",
                    reason="a second image of the default row (5 to 7 min on 2 cores): on request, PYTORCH_CUDA_TEST_DEVEL=1")
def test_devel_flavor_builds_passes_its_tests_and_carries_the_ops_toolkit():
    build(DEVEL)
    ref = "pytorch-cuda:v2.7-devel"
    proc = run_image(ref, ["nvcc", "--version"], ("-e", "PYTORCH_CUDA_NO_BANNER=1"))
    assert proc.returncode == 0 and f"V{lock.read(ROOT, DEVEL)['cuda_toolkit']}" in proc.stdout, shown(proc)
    prebuilt_ops_load(ref, DEVEL)


@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_CUDA13") != "1",
                    reason="a second full row (about 25 min cold on 2 cores): on request, PYTORCH_CUDA_TEST_CUDA13=1")
def test_a_cuda13_row_builds_with_nvcc_at_torchs_cuda_and_loads_its_ops():
    build(CUDA13)
    ref = CUDA13.refs()[0]
    facts = run_image(ref, ["cat", "/opt/pytorch-cuda/ops-facts.json"], ("-e", "PYTORCH_CUDA_NO_BANNER=1"))
    toolkit = json.loads(facts.stdout)["cuda_toolkit"]
    assert ".".join(toolkit.split(".")[:2]) == CUDA13.wheel_cuda, toolkit  # nvcc at exactly torch's CUDA
    prebuilt_ops_load(ref, CUDA13)


@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_NO_CACHE") != "1",
                    reason="a --no-cache rebuild of the default row (about 10 min here, every download again): "
                           "on request, PYTORCH_CUDA_TEST_NO_CACHE=1")
def test_a_no_cache_rebuild_takes_the_ops_from_the_host_and_compiles_nothing():
    """BuildKit empties every cache mount under --no-cache; the host's ops seed, exported by
    the build before, must spare nvcc (opsseed)."""
    image = MATRIX.select("2.7", "12.1")
    build(image)  # a normal build exports the ops seed
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--no-cache", "--no-test", "--quiet", timeout=5400)
    assert proc.returncode == 0, shown(proc)
    log = (ROOT / "build-results" / image.name / "build.log").read_text()
    assert "wheel taken from the host's ops seed" in log and "nothing compiled" in log, log[-3000:]
    assert "Building wheel for deepspeed" not in log, log[-3000:]
