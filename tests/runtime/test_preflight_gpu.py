"""pytorch-cuda-preflight's GPU part without a GPU: each fault class through a stand-in (the fake
NVML of preflight/fakenvml.py, and stand-in GPUs whose speed or result is wrong), run through the
whole command on one node so that each line is the one a site would read, naming the node and
the GPU by index and serial; the policy that turns a check into a warning; nvidia-smi's fallback
and the kernel log's Xids; the peaks table; and the options and variables refused before
anything runs (one line, exit 2). The measurement itself (torch, cuBLAS, NVML on a real GPU) runs
only on a GPU: the GPU bundle's preflight steps."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pytorch_cuda_runtime import gpupeaks, gpurunner, gpusteps
from pytorch_cuda_runtime.preflight import cli, compute, fakenvml, gpupart, health, node, standin

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = {"cuda_platform": "12.1", "torch_cuda": "12.6", "driver_min": "525.60.13", "cuda_arch_list": ["sm_80", "sm_90"]}
H100 = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "capability": "9.0"}
ME = node.hostname()


def setup(tmp_path: Path, nvml: list[dict[str, Any]] | None, gpus: list[dict[str, Any]]) -> dict[str, str]:
    """The environment of a one-node preflight: the manifest, stand-in GPUs, the fake NVML, the report."""
    (tmp_path / "m.json").write_text(json.dumps(MANIFEST))
    (tmp_path / "standin.json").write_text(json.dumps({"*": gpus}))
    env = {"PYTORCH_CUDA_MANIFEST": str(tmp_path / "m.json"), standin.VARIABLE: str(tmp_path / "standin.json"),
           "PYTORCH_CUDA_PREFLIGHT_REPORT": str(tmp_path / "report.json"), "PYTHONPATH": str(ROOT),
           "PATH": os.environ["PATH"]}
    if nvml is not None:
        (tmp_path / "nvml.json").write_text(json.dumps({"*": nvml}))
        env[fakenvml.VARIABLE] = str(tmp_path / "nvml.json")
    return env


@pytest.fixture(autouse=True)
def manifest(tmp_path: Path, monkeypatch: Any) -> None:
    """The manifest is read from the process's environment (manifest.py), as in the image."""
    (tmp_path / "m.json").write_text(json.dumps(MANIFEST))
    monkeypatch.setenv("PYTORCH_CUDA_MANIFEST", str(tmp_path / "m.json"))


def preflight(tmp_path: Path, capsys: Any, nvml: list[dict[str, Any]] | None, gpus: list[dict[str, Any]],
              *args: str) -> tuple[int, list[str], list[str], str]:
    """One node's preflight, stopped before the fabric (which needs torch): (exit, FAILED lines, warnings, stdout)."""
    env = setup(tmp_path, nvml, gpus)
    rc = cli.main(["--gpus-per-node", str(len(gpus)), "--shm-size", "1Mi", *args], env)
    out, err = capsys.readouterr()
    failed = [ln.removeprefix("pytorch-cuda-preflight: FAILED: ") for ln in err.splitlines() if "FAILED: " in ln]
    warned = [ln.removeprefix("pytorch-cuda-preflight: warning: ") for ln in err.splitlines() if ": warning: " in ln]
    return rc, failed, warned, out


GOOD = [{**H100, "tflops": 700.0}] * 3


CASES = [
    ("xid", [{}, {"xid": [79]}, {}], GOOD, "xid", "Xid 79 (NVML event)"),
    ("ecc", [{"ecc_uncorrected": 3}, {}, {}], GOOD, "ecc", "3 uncorrected ECC error(s) since the driver loaded (volatile)"),
    ("row-remap pending", [{}, {}, {"remapped_rows": [2, 1, 1, 0]}], GOOD, "row-remap", "a row remapping is pending"),
    ("row-remap failed", [{"remapped_rows": [0, 512, 0, 1]}, {}, {}], GOOD, "row-remap", "row remapping failed (512 uncorrectable"),
    ("retired pages", [{}, {"retired_pages_pending": 1}, {}], GOOD, "retired-pages", "pages are pending retirement"),
    ("pcie", [{}, {}, {"pcie": [4, 5, 8, 16]}], GOOD, "pcie", "PCIe link gen 4 x8 under load, below its maximum gen 5 x16"),
    ("nvlink", [{"nvlink": [1] * 17 + [0]}, {}, {}], GOOD, "nvlink", "NVLink link(s) 17 inactive (17 of 18 active)"),
    ("throttle", [{}, {"reasons": 0x1 | 0x80}, {}], GOOD, "throttle", "clocks held down: HwPowerBrakeSlowdown (clock event reasons 0x81)"),
    ("app clocks", [{}, {"app_clock": 1410}, {}], GOOD, "throttle", "applications clocks set to 1410 MHz (SM), below the default 1980 MHz"),
    ("temperature", [{"temperature": 88}, {}, {}], GOOD, "temperature", "88 C, at or over its slowdown threshold 87 C"),
    ("slow", [{}, {}, {}], [*GOOD[:2], {**H100, "tflops": 450.0}], "compute-slow",
     "slow: 450.0 TFLOP/s bf16, under 0.8 x the job's median 700.0 of 3 NVIDIA H100 80GB HBM3 GPU(s)"),
    ("under peak", [{}, {}, {}], [{**H100, "tflops": 350.0}] * 3, "compute-peak",
     "350.0 TFLOP/s bf16, 0.35 x the H100 SXM5's dense bf16 peak 989.4, under 0.4 x"),
    ("wrong result", [{}, {}, {}], [GOOD[0], {**H100, "tflops": 700.0, "corrupt": True}, GOOD[0]], "compute-checksum",
     "the bf16 matmul's result differs: checksum"),
]


@pytest.mark.parametrize("case, nvml, gpus, check, text", CASES, ids=[c[0] for c in CASES])
def test_each_fault_is_one_line_naming_the_node_the_gpu_and_its_serial(tmp_path, capsys, case, nvml, gpus, check, text):
    rc, failed, warned, out = preflight(tmp_path, capsys, nvml, gpus)
    assert rc == 1 and failed[-1] == "training not started" and not warned, failed
    bad = next(i for i, g in enumerate(nvml) if g) if any(nvml) else next(i for i, g in enumerate(gpus) if g != GOOD[0])
    serial = 1650922000000 + bad  # the fake NVML's serials
    line, *others = failed[:-1]
    assert len(others) == (2 if case == "under peak" else 0), failed  # there, all three GPUs are under it
    assert line.startswith(f"node {ME}: GPU {bad} (serial {serial}): {text}") and line.endswith(f"[{check}]"), line
    if case == "wrong result":
        assert "the majority's (2 of 3 NVIDIA H100 80GB HBM3 GPUs) is" in line
    row = next(ln for ln in out.splitlines() if ln.split()[:3] == [ME, str(bad), str(serial)])
    assert row.endswith(check), row  # the table marks the GPU with the check it failed
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["passed"] and report["lines"] == failed[:-1]
    assert [r["failed"] for r in report["gpus"]["rows"] if r["gpu"] == bad] == [[check]]
    assert report["gpus"]["rows"][bad]["serial"] == str(serial) and report["gpus"]["nodes"][ME]["findings"] is not None


def test_a_check_named_in_warn_only_warns_and_the_preflight_goes_on(tmp_path, capsys, monkeypatch):
    went_on = []
    monkeypatch.setattr(cli, "fabric_phase", lambda *a: went_on.append(1) or {"passed": True, "lines": []})
    nvml = [{"ecc_uncorrected": 1}, {}]
    rc, failed, warned, _ = preflight(tmp_path, capsys, nvml, GOOD[:2], "--warn", "ecc,temperature")
    assert rc == 0 and failed == [] and went_on == [1]
    assert warned == [f"node {ME}: GPU 0 (serial 1650922000000): 1 uncorrected ECC error(s) since the driver loaded "
                      "(volatile): the GPU's memory returned data it could not correct [ecc]"]
    env = setup(tmp_path, nvml, GOOD[:2])
    assert cli.main(["--gpus-per-node", "2", "--shm-size", "1Mi"], {**env, "PYTORCH_CUDA_PREFLIGHT_WARN": "ecc"}) == 0
    assert ": warning: " in capsys.readouterr().err


def test_an_unknown_product_gets_no_ratio_and_the_table_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "fabric_phase", lambda *a: {"passed": True, "lines": []})
    l4 = {"name": "NVIDIA L4", "driver": "550.54.15", "capability": "8.9", "tflops": 100.0}
    rc, failed, _, out = preflight(tmp_path, capsys, [{"name": "NVIDIA L4"}] * 2, [l4, l4])
    assert rc == 0 and failed == []
    assert "# NVIDIA L4: no dense bf16 peak recorded (gpupeaks.py): no ratio" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] == [ME]]
    assert [r[5:8] for r in rows] == [["100.0", "-", "1.00"]] * 2, out


def test_two_gpus_whose_results_differ_are_both_named_since_no_majority_can_tell(tmp_path, capsys):
    rc, failed, _, _ = preflight(tmp_path, capsys, [{}, {}], [GOOD[0], {**GOOD[0], "corrupt": True}])
    assert rc == 1 and len(failed) == 3
    assert all("no checksum is held by a majority of the 2 NVIDIA H100 80GB HBM3 GPUs" in ln for ln in failed[:2])


def test_a_compute_check_past_its_bound_is_stopped_and_named(tmp_path, capsys):
    rc, failed, _, _ = preflight(tmp_path, capsys, [{}], GOOD[:1], "--gpu-timeout", "0.05")
    assert rc == 1 and failed[0] == (f"node {ME}: GPUs: the compute check did not end within the GPU part's bound "
                                     "(0.05 s, --gpu-timeout) and was stopped [compute]")


def test_application_xids_unsupported_queries_and_unlinked_gpus_are_recorded_not_failed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "fabric_phase", lambda *a: {"passed": True, "lines": []})
    nvml = [{"xid": [13, 43], "nvlink": [0] * 12, "unsupported": ["nvmlDeviceGetRemappedRows", "nvmlDeviceGetSerial"]}]
    rc, failed, _, out = preflight(tmp_path, capsys, nvml, GOOD[:1])
    assert rc == 0 and failed == []
    assert f"# node {ME}: GPU 0: Xid 13 (NVML event): graphics engine exception, caused by an application; not counted" in out
    assert "no NVLink link active of 12 (no bridge or NVSwitch fabric): not counted" in out
    env = setup(tmp_path, nvml, GOOD[:1])
    (g,) = health.read(env, ME)[0] or []
    assert g["unread"] == {"serial": "Not Supported", "remapped_rows": "Not Supported"} and "remapped_rows" not in g


def test_the_shipped_images_cpu_preflight_and_plain_stand_ins_skip_the_gpu_part():
    """No GPU asked (the image's own CPU test) or stand-ins without a fake NVML or a figure (the
    Slurm and Kubernetes tests): nothing read, nothing measured, no line."""
    opts = gpupart.Options()
    assert gpupart.run({}, "n1", False, 0, opts) == {"skipped": "the job requested no GPUs", "findings": []}
    env = {standin.VARIABLE: "/nonexistent"}
    with pytest.raises(FileNotFoundError):  # a stand-in file that is not there is the test's own mistake
        gpupart.run(env, "n1", True, 2, opts)


def test_stand_ins_without_a_fake_nvml_or_figures_pass_with_the_reasons(tmp_path):
    env = setup(tmp_path, None, [H100, H100])
    part = gpupart.run(env, ME, True, 2, gpupart.Options())
    assert part["findings"] == [] and "stand-in GPUs have no driver to ask" in part["health"]["skipped"]
    assert part["compute"]["skipped"] == 'stand-in GPUs without a compute figure ("tflops")'
    assert gpupart.node_lines(part, frozenset()) == ([], [])


def test_xids_in_the_kernel_log_are_matched_to_their_gpu_by_bus(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("6,1,2,-;NVRM: loading\n4,2,3,-;NVRM: Xid (PCI:0000:19:00): 48, pid=123, DBE (0x1)\n"
                   "4,3,4,-;NVRM: Xid (PCI:0000:18:00): 31, pid=9, name=python\n")
    xids, why = health.kernel_xids(str(log))
    assert why is None and xids == {"0000:19:00": [48], "0000:18:00": [31]}
    nv = fakenvml.FakeNvml(str(setup_nvml(tmp_path, [{}, {}])), "h")
    gpus = health.read_nvml(nv, kmsg=str(log), window_ms=10)
    assert [g["xid"] for g in gpus] == [[{"xid": 31, "source": "kernel log"}], [{"xid": 48, "source": "kernel log"}]]
    assert [f.check for g in gpus for f in health.findings(g)] == ["xid"]  # 31 is the application's
    assert health.kernel_xids(str(tmp_path / "none"))[1].startswith("the kernel log")


def setup_nvml(tmp_path: Path, devices: list[dict[str, Any]]) -> Path:
    path = tmp_path / "nvml-only.json"
    path.write_text(json.dumps({"*": devices}))
    return path


def test_without_nvml_nvidia_smi_s_query_mode_answers_field_by_field(monkeypatch):
    answers = {"index,serial,name,uuid,pci.bus_id": "0, 1650922000777, NVIDIA A100-SXM4-80GB, GPU-a, 00000000:07:00.0",
               "ecc.errors.uncorrected.volatile.total": "2", "retired_pages.pending": "No",
               "clocks_throttle_reasons.active": "0x0000000000000008", "temperature.gpu": "45"}  # an older nvidia-smi

    def run(argv, **kw):
        field = argv[1].removeprefix("--query-gpu=")
        known = field in answers
        return subprocess.CompletedProcess(argv, 0 if known else 2, answers.get(field, "") + "\n", "")

    monkeypatch.setattr(health.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    (g,), source = health.read_smi(run)
    assert "nvidia-smi's query mode" in source and g["serial"] == "1650922000777" and g["reasons"] == 8
    assert [f.line() for f in health.findings(g)] == [
        "GPU 0 (serial 1650922000777): 2 uncorrected ECC error(s) since the driver loaded (volatile): the GPU's memory "
        "returned data it could not correct",
        "GPU 0 (serial 1650922000777): clocks held down: HwSlowdown (clock event reasons 0x8)"]
    assert g["unread"]["nvlink"] == "not in nvidia-smi's query mode"


def test_the_checksum_is_the_same_for_the_same_product_and_changes_with_one_bit():
    p = compute.standin_product(0, 16)
    flat = [v for row in p for v in row]
    assert compute.int_checksum(flat) == compute.int_checksum(list(flat))
    flat[5] ^= 1
    assert compute.int_checksum(flat) != compute.int_checksum([v for row in p for v in row])


@pytest.mark.parametrize("name, tflops, product", [
    ("NVIDIA H100 80GB HBM3", 989.4, "H100 SXM5"), ("NVIDIA H100 PCIe", 756.5, "H100 PCIe"), ("NVIDIA H200", 989.4, "H200 SXM"),
    ("NVIDIA A100-SXM4-40GB", 312.0, "A100 (SXM4 and PCIe, 40 and 80 GB)"), ("NVIDIA A100 80GB PCIe", 312.0, None),
    ("NVIDIA B200", 2250.0, "B200 (HGX, 1000 W)"), ("NVIDIA H200 NVL", None, None), ("NVIDIA H100 NVL", None, None),
])
def test_the_peaks_table_matches_whole_names_and_every_row_cites_its_source(name, tflops, product):
    got, matched = gpupeaks.peak(name)
    assert got == tflops and (product is None or matched == product)
    assert all("NVIDIA" in p.source and ("dense" in p.source or "with sparsity" in p.source) for p in gpupeaks.PEAKS)


# ---- inputs checked first

@pytest.mark.parametrize("argv, env, says", [
    (["--timeout", "nan"], {}, "argument --timeout: 'nan' is not a finite number"),
    (["--join-timeout", "inf"], {}, "argument --join-timeout: 'inf' is not a finite number"),
    (["--gpu-timeout", "0"], {}, "argument --gpu-timeout: '0' is not a positive number of seconds"),
    (["--gpu-slow-ratio", "abc"], {}, "argument --gpu-slow-ratio: 'abc' is not a number"),
    (["--peak-ratio", "1.5"], {}, "'1.5' is not a ratio between 0 and 1"),
    (["--matmul-size", "0"], {}, "'0' is not a positive whole number of rows"),
    (["--matmul-size", "100000"], {}, "100000 is over 32768 rows"),
    (["--shm-size", "0Gi"], {}, "'0Gi' is not a size like 16Gi or 512Mi"),
    (["--warn", "ecc,frobnicate"], {}, "unknown check(s) frobnicate; the checks: xid, ecc,"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT": "nan"}, "$PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT (for --join-timeout): 'nan' is not a finite number"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_TIMEOUT": "soon"}, "$PYTORCH_CUDA_PREFLIGHT_TIMEOUT (for --timeout): 'soon' is not a number"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_SLOW_RATIO": "inf"}, "$PYTORCH_CUDA_PREFLIGHT_SLOW_RATIO (for --slow-ratio): 'inf' is not a finite"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_GPU_TIMEOUT": "-1"}, "(for --gpu-timeout): '-1' is not a positive number of seconds"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_MATMUL_SIZE": "0"}, "(for --matmul-size): '0' is not a positive whole number"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_SHM_SIZE": "0Mi"}, "(for --shm-size): '0Mi' is not a size"),
    ([], {"PYTORCH_CUDA_PREFLIGHT_WARN": "ecc,bogus"}, "(for --warn): unknown check(s) bogus"),
])
def test_a_bad_bound_ratio_size_or_check_from_an_option_or_a_variable_is_one_line_exit_2_nothing_run(
        argv, env, says, capsys, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(node, "gather", lambda *a, **k: ran.append("gather"))
    monkeypatch.setattr(gpupart, "run", lambda *a, **k: ran.append("gpu"))
    monkeypatch.setenv("PYTORCH_CUDA_MANIFEST", str(tmp_path / "none.json"))
    assert cli.main(argv, env) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pytorch-cuda-preflight: error: ") and says in err, err
    assert ran == []


def test_an_option_given_wins_over_its_variable_and_a_blank_variable_is_the_default():
    args = cli.parse(["--timeout", "30"], {"PYTORCH_CUDA_PREFLIGHT_TIMEOUT": "nan", "PYTORCH_CUDA_PREFLIGHT_GPU_TIMEOUT": " "})
    assert args.timeout == 30 and args.gpu_timeout == compute.GPU_TIMEOUT_S


@pytest.mark.parametrize("where, says", [("a directory", "is a directory"), ("under a file", "is not a directory")])
def test_a_report_path_that_cannot_be_written_is_refused_before_any_check(where, says, tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(node, "gather", lambda *a, **k: ran.append("gather"))
    (tmp_path / "file").write_text("")
    path = tmp_path if where == "a directory" else tmp_path / "file" / "r.json"
    for argv, env in ((["--report", str(path)], {}), ([], {"PYTORCH_CUDA_PREFLIGHT_REPORT": str(path)})):
        assert cli.main(argv, env) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"the report {path} cannot be written: " in err and says in err, err
    assert ran == []


def test_the_default_report_name_in_a_read_only_working_directory_only_warns(tmp_path):
    """A job whose working directory is a read-only code mount, and that named no report: the
    checks still run (the fabric's rank 0 would say it cannot write it); a name given is refused."""
    (tmp_path / "file").write_text("")
    env = {"PYTORCH_CUDA_WORKDIR": str(tmp_path / "file")}  # a working directory no report can go under
    args = cli.parse([], env)
    assert args.report_warning.startswith(f"the report {cli.DEFAULT_REPORT} will not be written: ")
    with pytest.raises(cli.PreflightError, match="cannot be written"):
        cli.parse(["--report", cli.DEFAULT_REPORT], env)
    assert cli.parse([], {}).report_warning is None


def test_a_report_path_relative_to_the_launch_contracts_working_directory_is_checked_there(tmp_path):
    (tmp_path / "jobs").mkdir()
    assert cli.parse(["--report", "jobs/r.json"], {"PYTORCH_CUDA_WORKDIR": str(tmp_path)}).report == "jobs/r.json"
    assert cli.unwritable(str(tmp_path / "new" / "deeper" / "r.json")) is None  # made when written


# ---- the GPU bundle

def test_the_bundle_plans_the_preflight_checks_and_a_rehearsal_skips_them_with_the_reason(tmp_path):
    from test_gpucheck import bundle, check

    c = check(tmp_path, bundle(tmp_path), rehearse=True)
    steps = {s.name: s for s in gpusteps.plan(1)}
    for name in ("preflight.health", "preflight.compute"):
        assert gpurunner.skip_reason(c, steps[name]) == "rehearsal: this step needs a GPU"


def test_the_bundle_s_compute_step_records_each_gpu_and_fails_a_wrong_one(tmp_path, monkeypatch):
    from test_gpucheck import bundle, check

    c = check(tmp_path, bundle(tmp_path))
    figures = {"size": 8192, "seed": 0, "repeats": 20, "gpus": [
        {"gpu": i, "serial": f"S{i}", "name": "NVIDIA H100 80GB HBM3", "tflops": 700.0, "checksum": "ab" if i else "cd",
         "pcie": [5, 5, 16, 16]} for i in range(3)]}

    def run(name, cmd, timeout):
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(figures))
        return 0, str(tmp_path / "log")

    monkeypatch.setattr(c, "run", run)
    gpusteps.preflight_compute(c, gpurunner.Step("preflight.compute", gpusteps.preflight_compute, needs_gpu=True))
    recs = {r["check"]: r for r in c.records}
    assert recs["preflight.compute.gpu0"]["actual"] == "700.0 TFLOP/s" and "0.71 x the dense bf16 peak 989.4" in \
        recs["preflight.compute.gpu0"]["detail"]
    assert recs["preflight.compute-checksum"]["status"] == "FAIL"
    assert recs["preflight.compute-checksum"]["actual"].startswith("GPU 0 (serial S0): the bf16 matmul's result differs")
