"""The worked example (docs/example.md) runs as it is: docs/examples/train.py with
docs/examples/ds_config.json, the files the page shows (tests/unit/test_docs_example.py holds the
page to them), mounted read-only into the built default image and started the way the page
starts them on CPU ranks: two gloo ranks under torchrun, DS_ACCELERATOR=cpu. The loss falls to
less than half, and DeepSpeed's prebuilt CPU ops are loaded, not compiled: their directory is
unchanged afterwards. The container is removed afterwards."""
from __future__ import annotations

import pytest

from helpers import ROOT, default_image, run_once, shown

pytestmark = [pytest.mark.docker, pytest.mark.second_lane]

EXAMPLE = ROOT / "docs" / "examples"
# The page's CPU command, inside a shell that snapshots the prebuilt ops around it.
SCRIPT = r"""
set -eu
snapshot() { cd "$PYTORCH_CUDA_CPU_OPS" && find . -type f ! -name lock -printf '%p %s %T@\n' | sort; }
before=$(snapshot)
cd /workspace/example
torchrun --nproc-per-node 2 train.py --deepspeed_config ds_config.json
[ "$(snapshot)" = "$before" ] && echo "ops UNCHANGED"
"""


@pytest.fixture(scope="module")
def image(docker_client, default_build) -> str:
    # default_build first: the session's one tested build, which default_image() then finds done
    return default_image()


def test_the_worked_example_trains_on_cpu_ranks_in_the_default_image(image):
    from pytorch_cuda_build.stages import gate

    opts = ("--label", f"{gate.RUN_LABEL}={gate.RUN_ID}", "--label", "pytorch-cuda.test=worked-example",
            "--shm-size", "1g", "-e", "DS_ACCELERATOR=cpu", "-e", "OMP_NUM_THREADS=1", "-e", "PYTORCH_CUDA_NO_BANNER=1",
            "-v", f"{EXAMPLE}:/workspace/example:ro")
    proc = run_once(image, ["bash", "-c", SCRIPT], opts, timeout=600)
    assert proc.returncode == 0, shown(proc)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 30, shown(proc)
    last = next(line for line in lines if line.startswith("first "))
    first_loss, last_loss = float(last.split()[1]), float(last.split()[3])
    assert last_loss < first_loss / 2, shown(proc)
    assert lines[-1] == "ops UNCHANGED", shown(proc)
