"""gpucheck's logic without torch, a GPU or a compiler: which arch the ops are compiled for, the
bundle's proof, the steps that stop the run, and a report that claims nothing that did not run."""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pytest

from pytorch_cuda_runtime import gpucheck, gpureport
from pytorch_cuda_runtime.smoke.results import FAIL, PASS, SKIP

FLAGS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]


def fake_nvcc(tmp_path: Path, archs: str) -> str:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\nfor a in {archs}; do echo sm_$a; done\n")
    nvcc.chmod(0o755)
    return str(home)


def test_a_visible_gpu_is_what_the_ops_are_compiled_for(tmp_path):
    facts = {"devices": [{"name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}], "arch_flags": FLAGS}
    assert gpucheck.choose_arch(facts, fake_nvcc(tmp_path, "80"), None) == ("9.0", "GPU 0's compute capability (NVIDIA H100 80GB HBM3)")


def test_without_a_gpu_one_arch_the_newest_of_torchs_that_nvcc_compiles(tmp_path):
    arch, why = gpucheck.choose_arch({"devices": [], "arch_flags": FLAGS}, fake_nvcc(tmp_path, "50 52 60 70 75 80 86 89"), None)
    assert arch == "8.6" and "no GPU visible" in why and gpucheck.ARCH_ENV in why


def test_an_arch_given_wins(tmp_path, monkeypatch):
    facts = {"devices": [{"name": "GPU", "capability": "9.0"}], "arch_flags": FLAGS}
    monkeypatch.setenv(gpucheck.ARCH_ENV, "8.0")
    assert gpucheck.choose_arch(facts, fake_nvcc(tmp_path, "80"), "8.0") == ("8.0", f"given ({gpucheck.ARCH_ENV})")
    assert gpucheck.choose_arch(facts, fake_nvcc(tmp_path / "b", "80"), "7.5")[1] == "given (--arch)"


def test_no_common_arch_stops(tmp_path):
    with pytest.raises(gpucheck.Stop, match="compiles none of torch's archs"):
        gpucheck.choose_arch({"devices": [], "arch_flags": ["sm_100"]}, fake_nvcc(tmp_path, "80 90"), None)


def bundle(tmp_path: Path, python: str | None = None) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    files = {"manifest.json": {"sha256": hashlib.sha256(b"{}").hexdigest(), "size": 2}}
    desc = {"image": "2.7.1-cuda12.1-runtime", "torch": "2.7.1", "torch_cuda": "12.6", "deepspeed": "0.17.6",
            "python": python or ".".join(platform.python_version_tuple()[:2]), "cuda_toolkit": "12.4.131", "files": files}
    (root / "bundle.json").write_text(json.dumps(desc))
    return root


def check(tmp_path: Path, root: Path) -> gpucheck.Check:
    desc = json.loads((root / "bundle.json").read_text())
    return gpucheck.Check(str(root), desc, str(tmp_path / "report"), str(tmp_path), 60)


def test_a_changed_file_fails_the_bundle_and_stops(tmp_path):
    root = bundle(tmp_path)
    (root / "manifest.json").write_text('{"torch": "9"}')
    c = check(tmp_path, root)
    with pytest.raises(gpucheck.Stop):
        gpucheck.verify_files(c)
    assert c.records[-1]["status"] == FAIL and "manifest.json" in c.records[-1]["actual"]


def test_another_python_stops_with_what_to_do(tmp_path):
    c = check(tmp_path, bundle(tmp_path, python="3.99"))
    gpucheck.verify_files(c)
    with pytest.raises(gpucheck.Stop):
        gpucheck.check_python(c)
    r = c.records[-1]
    assert r["status"] == FAIL and r["expected"] == "3.99" and "--python" in r["detail"]


def test_a_stopped_run_reports_what_did_not_run_and_exits_1(tmp_path, monkeypatch):
    root = bundle(tmp_path, python="3.99")
    monkeypatch.setattr(gpucheck.banner, "query_gpus", lambda: None)
    assert gpucheck.main(["--bundle", str(root), "--report", str(tmp_path / "r")]) == 1
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    statuses = {r["check"]: r["status"] for r in report["checks"]}
    assert statuses == {"bundle.files": PASS, "machine.python": FAIL, "not_run": SKIP}  # no torch, no smoke claimed
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| GPU | none visible" in md and "| machine.python | - | - | FAIL |" in md and "not imported" in md


def test_a_bundle_without_bundle_json_is_exit_2(tmp_path, capsys):
    assert gpucheck.main(["--bundle", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpucheck: error:") and "bundle.json" in err[0]


def test_a_bad_arch_is_exit_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        gpucheck.main(["--bundle", str(tmp_path), "--arch", "sm_90"])
    assert e.value.code == 2


def test_the_header_names_the_gpu_and_driver_as_measured():
    desc = {"image": "x", "torch": "2.11.0", "torch_cuda": "13.0", "deepspeed": "0.19.8", "python": "3.12"}
    facts = {"nvidia_smi": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "capability": "9.0"}],
             "torch": "2.11.0+cu130", "torch_cuda": "13.0", "gpus": 1, "nvcc": "13.0.88", "cuda_home": "/usr/local/cuda",
             "ops_arch": "9.0", "python": "3.12.3", "platform": "Linux"}
    rows = dict(gpureport.header(desc, facts))
    assert rows["GPU"] == "NVIDIA H100 80GB HBM3 (compute 9.0)" and rows["Driver"] == "580.159.04"
    assert rows["CUDA compiler"] == "nvcc 13.0.88 in /usr/local/cuda" and rows["Ops compiled for"] == "9.0"

