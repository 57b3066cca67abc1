"""The train flavor, built, tested and tagged by build.py, then used as a user would.

On request (PYTORCH_CUDA_TEST_TRAIN=1): the default row's train image adds two layers to the
default image this project's CI builds anyway, but its gate runs the smoke suite again (about 10
min on 2 cores); the 2.11 row's adds a 20-minute Transformer Engine compile to a 25-minute cold
build (docs/train.md). PYTORCH_CUDA_TRAIN_ROWS picks the rows (default `2.7,2.11`).
"""
from __future__ import annotations

import json
import os

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_runtime.smoke import extras

from helpers import ROOT, run_build_py, run_image, shown

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.network,
              pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_TRAIN") != "1",
                                 reason="10 to 50 min on 2 cores: on request, PYTORCH_CUDA_TEST_TRAIN=1")]

MATRIX = matrix.load(ROOT / "matrix.yaml")
ROWS = [MATRIX.select(t.strip(), None, "train") for t in os.environ.get("PYTORCH_CUDA_TRAIN_ROWS", "2.7,2.11").split(",")]


@pytest.fixture(scope="module", params=ROWS, ids=lambda i: i.name)
def train(request, docker_client):
    image = request.param
    proc = run_build_py(ROOT, "--torch", image.torch, "--cuda", image.cuda, "--flavor", "train", "--quiet", timeout=7200)
    assert proc.returncode == 0, shown(proc)  # the gate ran the smoke suite and the structure checks
    return image


def test_the_gate_proved_every_extra_on_the_cpu_with_nothing_compiled(train):
    report = json.loads((ROOT / "build-results" / train.name / "smoke-report.json").read_text())
    results = {r["check"]: r for r in report["results"] if r["check"].startswith("extras.")}
    for name in train.extras_pins:
        assert results[f"extras.import.{name}"]["status"] == "PASS", results
        assert results[f"extras.versions.{name}"]["status"] == "PASS", results
    assert results["extras.nocompile"]["status"] == "PASS", results
    if train.extras_built:
        assert results["extras.te.libraries"]["status"] == "PASS", results["extras.te.libraries"]
        assert results["extras.te.prebuilt"]["status"] == "PASS", results["extras.te.prebuilt"]
    assert results["extras.torchao.ops"]["status"] == "PASS", results["extras.torchao.ops"]  # linux/amd64: C++ ops
    assert not [r for r in results.values() if r["status"] == "FAIL"]


def test_labels_name_the_extras_and_the_runtime_pins_did_not_move(train, docker_client):
    ref = train.refs()[0]
    labels = docker_client.images.get(ref).labels
    assert labels["io.pytorch-cuda.extras"] == ",".join(f"{n}=={v}" for n, v in train.extras_pins.items())
    runtime = MATRIX.select(train.torch, train.cuda)
    out = run_image(ref, ["python", "-c", "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"])
    assert out.returncode == 0, shown(out)
    assert out.stdout.split()[-2:] == [f"{runtime.torch}+cu{runtime.wheel_cuda.replace('.', '')}", runtime.deepspeed]


def test_an_arbitrary_uid_imports_the_extras_and_the_sbom_lists_them(train):
    # The smoke suite's modules: Liger's kernels need a GPU driver to import on Triton 3.3 (torch 2.7).
    code = "; ".join(f"import {extras.IMPORTS[n]}" for n in train.extras_pins) + "; print('ok')"
    out = run_image(train.refs()[0], ["python", "-c", code], ("--user", "1000700000:0"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), shown(out)
    sbom = run_image(train.refs()[0], ["cat", "/opt/pytorch-cuda/sbom.cdx.json"])
    components = {c["name"].lower().replace("_", "-"): c["version"] for c in json.loads(sbom.stdout)["components"]}
    for name, version in train.extras_pins.items():
        assert components.get(name) == version, name
