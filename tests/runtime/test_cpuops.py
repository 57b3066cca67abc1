"""cpuops: the CPU accelerator's ops are loaded (so compiled) in the order given, and an
unknown builder name stops the image's build with one line that names it."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pytorch_cuda_runtime import cpuops  # noqa: E402


class FakeBuilder:
    def __init__(self, name: str, loaded: list):
        self.name, self.loaded = name, loaded

    def load(self, verbose: bool = True):
        assert verbose is False  # a build log of every compile line helps no one
        self.loaded.append(self.name)


class FakeCPUAccelerator:
    def __init__(self, known: set):
        self.known, self.loaded = known, []

    def device_name(self, device_index=None):
        return "cpu"

    def create_op_builder(self, name: str):
        return FakeBuilder(name, self.loaded) if name in self.known else None  # as DeepSpeed's does


def test_every_builder_is_loaded_in_order():
    acc = FakeCPUAccelerator({"CPUAdamBuilder", "ShareMemCommBuilder", "FusedAdamBuilder"})
    cpuops.load_all(acc, ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"])
    assert acc.loaded == ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"]


def test_an_unknown_builder_is_named():
    acc = FakeCPUAccelerator({"CPUAdamBuilder"})
    with pytest.raises(cpuops.UnknownBuilder, match="DeepSpeed's cpu accelerator has no op builder FusedLambBuilder"):
        cpuops.load_all(acc, ["CPUAdamBuilder", "FusedLambBuilder"])
    assert acc.loaded == ["CPUAdamBuilder"]


def test_the_script_alone_runs_with_a_stand_in_deepspeed(tmp_path):
    pkg = tmp_path / "deepspeed" / "accelerator"
    pkg.mkdir(parents=True)
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(
        "class _B:\n    def __init__(self, n): self.n = n\n"
        "    def load(self, verbose=True): print('loaded', self.n)\n"
        "class _A:\n    def device_name(self, device_index=None): return 'cpu'\n"
        "    def create_op_builder(self, n): return _B(n) if n != 'Nope' else None\n"
        "def get_accelerator(): return _A()\n")
    lone = tmp_path / "bin" / "cpuops.py"  # as the Dockerfile binds it: one file, no package beside it
    lone.parent.mkdir()
    lone.write_bytes((ROOT / "pytorch_cuda_runtime" / "cpuops.py").read_bytes())

    def run(*args):
        return subprocess.run([sys.executable, str(lone), *args], capture_output=True, text=True, cwd=tmp_path,
                              env={"PYTHONPATH": str(tmp_path)}, timeout=60)

    ok = run("CPUAdamBuilder", "FusedAdamBuilder")
    assert (ok.returncode, ok.stdout) == (0, "loaded CPUAdamBuilder\nloaded FusedAdamBuilder\n"), ok.stderr
    bad = run("CPUAdamBuilder", "Nope")
    assert bad.returncode == 1 and bad.stderr == "cpuops: error: DeepSpeed's cpu accelerator has no op builder Nope\n"
    assert run().returncode == 2
