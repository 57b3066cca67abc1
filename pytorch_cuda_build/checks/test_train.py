"""The train flavor: the runtime plus the extras of matrix.yaml `train:` (docs/train.md).

The smoke suite's `extras` step proves they import and load with nothing compiled; these
checks read what the image holds: the extras locks it was built from, the pinned versions,
the compiled Transformer Engine extension's facts, and the caches any uid can write.
"""
from __future__ import annotations

import json
from pathlib import Path

import docker
import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.checks.support import Host
from pytorch_cuda_build.engine import containers
from pytorch_cuda_build.stages import lock

pytestmark = pytest.mark.docker

ARBITRARY = "1000700000:0"  # OpenShift's kind of uid: no passwd entry, group 0


@pytest.fixture(autouse=True)
def _train_only(row: matrix.Image) -> None:
    if row.flavor != "train":
        pytest.skip(f"{row.name} is a {row.flavor} image; the extras are in train only")


def test_the_image_holds_the_committed_extras_locks(host: Host, row: matrix.Image, project_root: Path) -> None:
    for name in lock.EXTRAS_FILES:
        committed = (lock.build_dir(project_root, row) / name).read_text()
        assert host.file(f"/opt/pytorch-cuda/{name}").content_string == committed, name


def test_every_extras_pin_is_installed_at_its_version(host: Host, row: matrix.Image, lock_meta: dict) -> None:
    pins = {**lock_meta["extras"][row.platform]["pins"], **lock_meta["extras"][row.platform]["built"]}
    code = ("import importlib.metadata as m, json; "
            f"print(json.dumps({{n: m.version(n) for n in {json.dumps(sorted(pins))}}}))")
    found = json.loads(host.check_output(f"python -c '{code}'"))
    assert found == pins


def test_the_te_extension_was_compiled_here_and_names_no_driver(host: Host, row: matrix.Image) -> None:
    if not row.extras_built:
        pytest.skip(f"{row.name} has no Transformer Engine ({dict(row.extras_left_out).get('transformer-engine')})")
    facts = json.loads(host.file("/opt/pytorch-cuda/te-facts.json").content_string)
    assert facts["transformer_engine_torch"] == row.extras_pins["transformer-engine"]
    assert facts["module"].startswith("transformer_engine/") and facts["module"].endswith(".so")
    assert not [lib for lib in facts["needed"] if lib.startswith("libcuda.so")], facts["needed"]
    assert facts["compile_seconds"] > 0


def test_an_arbitrary_uid_gets_writable_kernel_caches(docker_client: docker.DockerClient, image_ref: str, row: matrix.Image) -> None:
    """FA4's CuTe DSL cache and Triton's (Liger) go under a HOME the entrypoint makes writable."""
    script = ('for v in TRITON_CACHE_DIR FLASH_ATTENTION_CUTE_DSL_CACHE_DIR; do d=$(printenv $v); '
              'mkdir -p "$d" && touch "$d/probe" && echo "$v ok"; done; echo "enabled=$FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"')
    out = docker_client.containers.run(image_ref, ["bash", "-c", script], user=ARBITRARY, remove=True,
                                       environment={"PYTORCH_CUDA_NO_BANNER": "1"}, labels=containers.labels("structure")).decode()
    assert "TRITON_CACHE_DIR ok" in out and "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR ok" in out, out
    assert ("enabled=1" in out) == ("flash-attn-4" in row.extras_pins), out
