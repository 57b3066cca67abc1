"""The six journeys a new user takes through the README and docs/, each with the test that runs its
commands as the page gives them, or the reason a step cannot run on this project's machines. This
file is the map (docs/testing.md points here); each named test reads its page, so a page that
changes its commands changes what the test runs. And the one transcript of the clusters page that
comes from a checkout alone, `pytorch-cuda-launch --print`, is run here against its shown output."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, code_blocks

# journey: (the page whose commands it runs, the test files that run them and what each must read,
# what cannot run here and why)
JOURNEYS = {
    "build the default image": (
        "README.md", {"tests/conftest.py": '"--torch", "2.7", "--cuda", "12.1"'},
        "every documented build line also plans offline (tests/unit/test_docs.py, --dry-run)"),
    "run it on a GPU host": (
        "docs/example.md", {"tests/integration/test_worked_example.py": "docs\" / \"examples",
                            "tests/unit/test_docs_example.py": "--gpus all"},
        "no GPU and no NVIDIA Container Toolkit on this project's machines: the example runs on CPU ranks in the default "
        "image; `--gpus all` is NVIDIA's, not run here (docs/gpu-host.md, what has run on a GPU)"),
    "run a 2-node job on Slurm": (
        "docs/slurm.md", {"tests/integration/test_slurm.py": "def journey()"},
        "stand-in GPUs and a stand-in NVIDIA runtime: the nodes share one host and train on CPU ranks"),
    "run a 2-node job on Kubernetes": (
        "docs/kubernetes.md", {"tests/integration/test_kubernetes_replay.py": "def derived_journey()"},
        "no Kubernetes cluster is reachable: `kubectl apply` does not run, the pods are replayed as containers"),
    "extend the image": (
        "docs/extending.md", {"tests/integration/test_extend.py": "derived-dockerfile:start"}, ""),
    "verify a published image": (
        "docs/reproducibility.md", {"tests/integration/test_verify_image.py": "verify"},
        "the full row's rebuild is on request (PYTORCH_CUDA_TEST_VERIFY_IMAGE=1): docs/testing.md, on request"),
    "check a cluster before training": (
        "docs/clusters.md", {"tests/integration/test_slurm.py": "--preflight",
                             "tests/integration/test_kubernetes_replay.py": "--preflight"},
        "stand-in GPUs through PYTORCH_CUDA_PREFLIGHT_STANDIN; no NCCL, GPU or InfiniBand"),
}


@pytest.mark.parametrize("journey", list(JOURNEYS))
def test_each_journey_has_its_page_and_the_tests_that_run_it(journey):
    page, tests, _ = JOURNEYS[journey]
    assert (ROOT / page).is_file(), page
    for test, reads in tests.items():
        text = (ROOT / test).read_text()
        assert reads in text, f"{journey}: {test} does not read {reads!r}"


def test_the_journeys_are_the_six_of_the_issue():
    assert len(JOURNEYS) == 7  # the third journey is two: Slurm and Kubernetes


# --- clusters.md's --print transcript ------------------------------------------------------------

def print_transcript() -> tuple[str, list[str]]:
    """(the command, the output lines) of clusters.md's `--print` block."""
    (block,) = [b for _, b, _ in code_blocks((ROOT / "docs" / "clusters.md").read_text()) if "launch --print" in b]
    lines = block.splitlines()
    command = " ".join(ln.removeprefix("$ ").rstrip("\\").strip() for ln in lines[:2])
    return command, lines[2:]


def test_the_print_transcript_is_what_the_launcher_prints_in_docs_examples():
    """The page ran it as root in docs/examples/ with the checkout on PYTHONPATH: so does this. The
    page's `...` stands for the cache lines, which name the user's home; PATH is the shown one."""
    command, shown = print_transcript()
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    argv = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
    assert argv[:3] == ["python3", "-m", "pytorch_cuda_runtime.launch"], argv
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60, cwd=ROOT / "docs" / "examples",
                          env={**env, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    cut = shown.index("...")
    assert out[:cut] == shown[:cut]
    expected_argv = shown[-1].replace("/usr/bin/python3", sys.executable)
    assert out[-1] == expected_argv
