"""torchfacts: torch-facts.json as the image's build writes it, from a stand-in torch.

The image runs the module as one bind-mounted file, so the script test runs it by path, away
from the package, with a fake `torch` on its path."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pytorch_cuda_runtime import torchfacts  # noqa: E402

SCRIPT = ROOT / "pytorch_cuda_runtime" / "torchfacts.py"


def fake_torch(flags: str) -> SimpleNamespace:
    return SimpleNamespace(_C=SimpleNamespace(_cuda_getArchFlags=lambda: flags))


def test_the_arch_list_in_torchs_order():
    assert torchfacts.facts(fake_torch("sm_50 sm_90 sm_80 compute_90")) == {"cuda_arch_list": ["sm_50", "sm_90", "sm_80", "compute_90"]}


def test_a_torch_without_cuda_archs_is_refused():
    with pytest.raises(torchfacts.NoArchList, match="torch reports no CUDA arch list"):
        torchfacts.facts(fake_torch(""))


def run_script(tmp_path: Path, flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        f"class _C:\n    @staticmethod\n    def _cuda_getArchFlags():\n        return {flags!r}\n")
    lone = tmp_path / "bin" / "torchfacts.py"  # as the Dockerfile binds it: one file, no package beside it
    lone.parent.mkdir()
    lone.write_bytes(SCRIPT.read_bytes())
    return subprocess.run([sys.executable, str(lone)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path)}, timeout=60)


def test_the_script_alone_prints_the_bytes_the_one_liner_printed(tmp_path):
    proc = run_script(tmp_path, "sm_80 sm_90")
    assert proc.returncode == 0, proc.stderr
    # What `print(json.dumps({'cuda_arch_list': a}))` wrote before this module: the same bytes.
    assert proc.stdout == json.dumps({"cuda_arch_list": ["sm_80", "sm_90"]}) + "\n"


def test_the_script_fails_the_build_step_without_archs(tmp_path):
    proc = run_script(tmp_path, "")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "torch reports no CUDA arch list\n")
