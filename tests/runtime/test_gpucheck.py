"""gpucheck's logic without torch or a GPU: the plan and its estimates, the bundle's proof, the
steps that stop the run, the budget, and a report written before and after every step that claims
nothing that did not run and names the step a kill cut."""
from __future__ import annotations

import hashlib
import json
import platform
import re
from pathlib import Path

import pytest

from pytorch_cuda_runtime import gpucheck, gpureport, gpurunner, gpusteps
from pytorch_cuda_runtime.interrupt import Interrupted
from pytorch_cuda_runtime.smoke import cli as smoke
from pytorch_cuda_runtime.smoke import measure
from pytorch_cuda_runtime.smoke.results import FAIL, INFO, PASS, SKIP

ROOT = Path(__file__).resolve().parents[2]
ESTIMATES = json.loads(Path(gpurunner.ESTIMATES).read_text())
OPS_WHEEL = {"file": "ops/deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl", "ops": ["cpu_adam", "fused_adam"],
             "arch_list": "9.0", "torch": "2.7.1", "source": "built here"}


def bundle(tmp_path: Path, python: str | None = None) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    files = {"manifest.json": {"sha256": hashlib.sha256(b"{}").hexdigest(), "size": 2}}
    desc = {"schema": 2, "image": "2.7.1-cuda12.1-runtime", "torch": "2.7.1", "torch_cuda": "12.6", "deepspeed": "0.17.6",
            "python": python or ".".join(platform.python_version_tuple()[:2]), "ops_wheel": OPS_WHEEL, "files": files,
            "wheels": {}}
    (root / "bundle.json").write_text(json.dumps(desc))
    return root


def check(tmp_path: Path, root: Path, budget: float = 540, rehearse: bool = False) -> gpurunner.Check:
    desc = json.loads((root / "bundle.json").read_text())
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return gpurunner.Check(str(root), desc, str(tmp_path / "report"), str(work), budget, rehearse)


# ---- the plan

def test_the_plan_for_one_gpu_holds_every_gpu_step_in_order_and_no_cpu_rank():
    names = [s.name for s in gpusteps.plan(1)]
    assert names[:8] == ["bundle.files", "machine.python", "machine.torch", "install.dependencies", "install.deepspeed",
                         "smoke.versions", "smoke.gpu", "smoke.ops"]
    for family in ("collectives", "ddp", "zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_offload",
                   "zero3_launcher", "fsdp2", "bf16", "compile", "extras", "measure"):
        assert f"smoke.{family}" in names, family
    assert names[-1] == "smoke.nocompile" and len(names) == len(set(names))
    assert not [s for s in gpusteps.plan(1) if s.family and "cpu" in s.family]


def test_every_step_has_its_own_estimate_and_one_h100_totals_at_most_6_minutes():
    steps = gpusteps.plan(1)
    total, est = gpurunner.estimate(steps)
    assert {s.name for s in steps} == set(est["steps"])  # no step falls back to a default, no stale entry
    assert total <= 360, total
    assert all(s.bound == max(3 * s.estimate, est["min_bound_s"]) for s in steps)


def test_the_measured_estimates_are_the_last_records_step_times():
    """gpu_estimates.json's 'measured' entries equal the times in the record it names."""
    log = (ROOT / ESTIMATES["source"]).read_text()
    times = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(\w+): rc=\d+ ([\d.]+)s", log, re.M)}
    measured = {k: v for k, v in ESTIMATES["steps"].items() if v["basis"].startswith("measured: ")}
    assert len(measured) >= 5
    for name, v in measured.items():
        step = v["basis"].removeprefix("measured: ")
        assert times[step] == v["seconds"], (name, step)


def test_the_plan_is_printed_first_with_its_total(tmp_path, capsys):
    c = check(tmp_path, bundle(tmp_path))
    c.steps = gpusteps.plan(1)
    total, est = gpurunner.estimate(c.steps)
    gpurunner.print_plan(c, total, est)
    err = capsys.readouterr().err
    assert f"about {total:g} s" in err and "smoke.zero3_launcher" in err and "budget 540 s" in err


# ---- the steps

def test_a_changed_file_fails_the_bundle_and_stops(tmp_path):
    root = bundle(tmp_path)
    (root / "manifest.json").write_text('{"torch": "9"}')
    c = check(tmp_path, root)
    with pytest.raises(gpurunner.Stop):
        gpusteps.verify_files(c, None)
    assert c.records[-1]["status"] == FAIL and "manifest.json" in c.records[-1]["actual"]


def test_another_python_stops_with_what_to_do(tmp_path):
    c = check(tmp_path, bundle(tmp_path, python="3.99"))
    gpusteps.verify_files(c, None)
    with pytest.raises(gpurunner.Stop):
        gpusteps.check_python(c, None)
    r = c.records[-1]
    assert r["status"] == FAIL and r["expected"] == "3.99" and "--python" in r["detail"]


def fake_torch(monkeypatch, c, facts):
    def run(name, cmd, timeout):
        log = Path(c.logs) / f"{name}.log"
        log.write_text(json.dumps(facts) + "\n")
        return 0, str(log)
    monkeypatch.setattr(c, "run", run)


@pytest.mark.parametrize(("facts", "rehearse", "status", "text"), [
    ({"torch": "2.7.1+cu126", "torch_cuda": "12.6", "gpus": 1, "devices": []}, False, PASS, "1 GPU(s) visible"),
    ({"torch": "2.13.0+cpu", "torch_cuda": None, "gpus": 0, "devices": []}, True, FAIL, "the one the ops were built against"),
    ({"torch": "2.7.1+cpu", "torch_cuda": None, "gpus": 0, "devices": []}, False, FAIL, "a CUDA build of torch"),
    ({"torch": "2.7.1+cpu", "torch_cuda": None, "gpus": 0, "devices": []}, True, PASS, "a CPU build"),
])
def test_the_machines_torch_must_be_the_wheels(tmp_path, monkeypatch, facts, rehearse, status, text):
    c = check(tmp_path, bundle(tmp_path), rehearse=rehearse)
    fake_torch(monkeypatch, c, facts)
    step = gpurunner.Step("machine.torch", gpusteps.probe_torch)
    if status == FAIL:
        with pytest.raises(gpurunner.Stop):
            gpusteps.probe_torch(c, step)
    else:
        gpusteps.probe_torch(c, step)
    r = c.records[0]
    assert r["status"] == status and text in str(r["expected"]) + str(r["actual"]) + r["detail"], r


@pytest.mark.parametrize(("recorded", "have", "ok"), [("2.7", "2.7.1+cu126", True), ("2.7.1", "2.7.1+cu126", True),
                                                     ("2.7", "2.71.0", False), ("2.7.1", "2.7.2", False)])
def test_a_wheel_given_records_major_minor_and_matches_its_patch_releases(tmp_path, monkeypatch, recorded, have, ok):
    root = bundle(tmp_path)
    desc = json.loads((root / "bundle.json").read_text())
    desc["ops_wheel"]["torch"] = recorded
    (root / "bundle.json").write_text(json.dumps(desc))
    c = check(tmp_path, root)
    fake_torch(monkeypatch, c, {"torch": have, "torch_cuda": "12.6", "gpus": 1, "devices": []})
    try:
        gpusteps.probe_torch(c, gpurunner.Step("machine.torch", gpusteps.probe_torch))
    except gpurunner.Stop:
        pass
    assert (c.records[0]["status"] == PASS) == ok


def test_a_gpu_run_without_a_gpu_fails_and_points_at_the_rehearsal(tmp_path, monkeypatch):
    c = check(tmp_path, bundle(tmp_path))
    fake_torch(monkeypatch, c, {"torch": "2.7.1+cu126", "torch_cuda": "12.6", "gpus": 0, "devices": []})
    gpusteps.probe_torch(c, gpurunner.Step("machine.torch", gpusteps.probe_torch))
    assert c.records[-1]["check"] == "machine.gpu" and c.records[-1]["status"] == FAIL and "--rehearse" in c.records[-1]["detail"]
    assert gpurunner.skip_reason(c, gpurunner.Step("smoke.ddp", None, needs_gpu=True)) == "no CUDA device visible to torch"


def test_a_rehearsal_skips_what_needs_a_gpu_and_nothing_else(tmp_path):
    c = check(tmp_path, bundle(tmp_path), rehearse=True)
    skipped = [s.name for s in gpusteps.plan(0) if gpurunner.skip_reason(c, s)]
    assert "smoke.ops" not in skipped and "install.deepspeed" not in skipped and "smoke.extras" not in skipped
    assert {"smoke.gpu", "smoke.zero3", "smoke.measure", "smoke.compile"} <= set(skipped)


def test_one_gpu_is_reported_as_a_world_of_one_and_a_rehearsal_claims_none(tmp_path, monkeypatch):
    for rehearse, gpus, said in ((False, 1, True), (False, 2, False), (True, 0, False)):
        folder = tmp_path / str(gpus)
        folder.mkdir()
        c = check(folder, bundle(folder), rehearse=rehearse)
        c.steps, c.gpus, c.manifest = gpusteps.plan(gpus), gpus, {}
        c.suite = type("Suite", (), {"probe": lambda self, device: {}})()
        recs = gpusteps.smoke_versions(c, None)
        assert any(r["check"] == "world.one_gpu" for r in recs) == said, (rehearse, gpus)


def test_the_manifest_read_there_has_the_wheels_ops_and_the_machines_arch_list(tmp_path):
    root = bundle(tmp_path)
    (root / "ops").mkdir()
    (root / "ops" / "ops-facts.json").write_text(json.dumps({"ops_arch_list": "9.0", "prebuilt_ops": ["stale"]}))
    c = check(tmp_path, root)
    c.facts["arch_flags"] = ["sm_90", "sm_100"]
    manifest, path = gpusteps.effective_manifest(c)
    assert manifest["prebuilt_ops"] == OPS_WHEEL["ops"] and manifest["ops_accelerator"] == "cuda"
    assert manifest["cuda_arch_list"] == ["sm_90", "sm_100"] and manifest["ops_arch_list"] == "9.0"
    assert manifest["python"] == c.desc["python"] and Path(path).parent != root


def test_ops_need_a_cuda_torch_even_in_a_rehearsal(tmp_path):
    c = check(tmp_path, bundle(tmp_path), rehearse=True)
    c.facts["torch_cuda"] = None
    [r] = gpusteps.smoke_ops(c, None)
    assert r["status"] == SKIP and "CPU build" in r["detail"]


# ---- the run, its report and the budget

def scripted(tmp_path, monkeypatch, steps, budget=540.0):
    """A Check whose plan is these (name, function) steps; main's loop runs them."""
    c = check(tmp_path, bundle(tmp_path), budget=budget)
    c.steps = [gpurunner.Step(n, f) for n, f in steps]
    for s in c.steps:
        s.estimate, s.bound = 1.0, 10.0
    return c


def test_the_report_names_the_running_step_before_it_ends(tmp_path, monkeypatch):
    seen = {}

    def first(c, step):
        c.add("first", PASS)

    def second(c, step):  # what a SIGKILL here would leave on disk
        seen.update(json.loads((Path(c.report_dir) / "report.json").read_text()))

    c = scripted(tmp_path, monkeypatch, [("first", first), ("second", second)])
    gpurunner.run_steps(c)
    assert seen["running"] == "second" and [r["check"] for r in seen["checks"]] == ["first"]
    assert [s["state"] for s in seen["steps"]] == ["done", "running"]
    final = json.loads((tmp_path / "report" / "report.json").read_text())
    assert final["running"] is None and [s["state"] for s in final["steps"]] == ["done", "done"]
    assert "Running when this report was written: `second`" in gpureport.markdown(
        c.desc, c.facts, [], 1, seen["steps"], seen["running"])


def test_a_step_that_does_not_fit_the_budget_is_not_started(tmp_path, monkeypatch):
    ran = []
    c = scripted(tmp_path, monkeypatch, [("a", lambda c, s: ran.append("a")), ("b", lambda c, s: ran.append("b"))], budget=5)
    c.steps[1].estimate = 100
    gpurunner.run_steps(c)
    assert ran == ["a"] and c.steps[1].state == "not run"
    assert c.records[-1]["check"] == "b" and c.records[-1]["status"] == SKIP and "budget" in c.records[-1]["detail"]
    assert c.steps[0].bound <= 5  # a step's bound never reaches past the budget


def test_a_stop_marks_the_rest_not_run(tmp_path, monkeypatch):
    def bad(c, step):
        raise gpurunner.Stop("no torch")

    c = scripted(tmp_path, monkeypatch, [("a", bad), ("b", lambda c, s: None)])
    gpurunner.run_steps(c)
    assert [s.state for s in c.steps] == ["done", "not run"] and "after a did not run: no torch" in c.records[-1]["detail"]


def test_an_error_in_a_step_is_recorded_and_stops_the_rest(tmp_path, monkeypatch):
    def broken(c, step):
        raise OSError(28, "No space left on device")

    c = scripted(tmp_path, monkeypatch, [("a", broken), ("b", lambda c, s: None)])
    gpurunner.run_steps(c)
    assert c.records[0]["check"] == "a.error" and c.records[0]["status"] == FAIL and "No space left" in c.records[0]["actual"]
    assert [s.state for s in c.steps] == ["done", "not run"] and "a ended in an error" in c.records[-1]["detail"]


def test_a_stopped_run_reports_what_did_not_run_and_exits_1(tmp_path, monkeypatch):
    root = bundle(tmp_path, python="3.99")
    monkeypatch.setattr(gpucheck.banner, "query_gpus", lambda: None)
    assert gpucheck.main(["--bundle", str(root), "--report", str(tmp_path / "r")]) == 1
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    statuses = {r["check"]: r["status"] for r in report["checks"]}
    assert statuses == {"bundle.files": PASS, "machine.python": FAIL, "not_run": SKIP}  # no torch, no smoke claimed
    assert {s["state"] for s in report["steps"][2:]} == {"not run"} and report["running"] is None
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| GPU | none visible" in md and "| machine.python | - | - | FAIL |" in md and "not imported" in md


def test_an_interrupted_run_names_the_cut_step_and_exits_128_plus_the_signal(tmp_path, monkeypatch):
    root = bundle(tmp_path)
    monkeypatch.setattr(gpucheck.banner, "query_gpus", lambda: None)

    def cut(c, step):
        raise Interrupted(15)

    monkeypatch.setattr(gpusteps, "probe_torch", cut)
    assert gpucheck.main(["--bundle", str(root), "--report", str(tmp_path / "r")]) == 143
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["running"] == "machine.torch"
    states = {s["step"]: s["state"] for s in report["steps"]}
    assert states["bundle.files"] == "done" and states["machine.torch"] == "cut" and states["install.deepspeed"] == "not run"
    assert report["checks"][-1]["check"] == "interrupted" and "SIGTERM during machine.torch" in report["checks"][-1]["actual"]
    assert "**Cut: `machine.torch`**" in (tmp_path / "r" / "report.md").read_text()


def test_a_bundle_without_bundle_json_is_exit_2(tmp_path, capsys):
    assert gpucheck.main(["--bundle", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpucheck: error:") and "bundle.json" in err[0]


def test_a_bundle_of_the_old_kind_is_exit_2(tmp_path, capsys):
    root = bundle(tmp_path)
    desc = json.loads((root / "bundle.json").read_text())
    desc.update(schema=1)
    desc.pop("ops_wheel")
    (root / "bundle.json").write_text(json.dumps(desc))
    assert gpucheck.main(["--bundle", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "schema 1" in err[0] and "build.py gpu-bundle" in err[0]


def test_a_bad_budget_is_exit_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        gpucheck.main(["--bundle", str(tmp_path), "--budget", "0"])
    assert e.value.code == 2


def test_the_header_names_the_gpu_driver_and_the_prebuilt_ops():
    desc = {"image": "x", "torch": "2.11.0", "torch_cuda": "13.0", "deepspeed": "0.19.8", "python": "3.12",
            "ops_wheel": dict(OPS_WHEEL, torch="2.11.0")}
    facts = {"nvidia_smi": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "capability": "9.0"}],
             "torch": "2.11.0+cu130", "torch_cuda": "13.0", "gpus": 1, "python": "3.12.3", "platform": "Linux"}
    rows = dict(gpureport.header(desc, facts))
    assert rows["GPU"] == "NVIDIA H100 80GB HBM3 (compute 9.0)" and rows["Driver"] == "580.159.04"
    assert rows["Ops"].startswith("prebuilt by `build.py gpu-bundle` for 9.0") and "nothing compiled here" in rows["Ops"]


# ---- the smoke suite's GPU-only mode and the measure

def test_gpu_only_keeps_the_gpu_runs_alone():
    assert smoke.plan(["zero3", "bf16", "measure"], 1, 2) == [("zero3", "cuda", 1), ("zero3", "cpu", 2), ("bf16", "cuda", 1),
                                                               ("bf16", "cpu", 1), ("measure", "cuda", 1)]
    assert smoke.plan(["zero3", "bf16", "measure"], 1, 2, gpu_only=True) == [("zero3", "cuda", 1), ("bf16", "cuda", 1),
                                                                             ("measure", "cuda", 1)]
    assert smoke.plan(["measure"], 0, 2) == []
    assert "measure" not in smoke.DEFAULT and "measure" in smoke.parse_args(["--gpu-only"]).only


def test_the_measure_is_one_process_on_gpu_0_whatever_the_gpus():
    assert smoke.launcher_cmd("measure", "cuda", 1)[1:] == ["-m", "pytorch_cuda_runtime.smoke.worker", "measure"]
    assert smoke.plan(["measure"], 8, 2, gpu_only=True) == [("measure", "cuda", 1)]


def test_one_gpu_says_world_of_one():
    [r] = smoke.world_of_one(1, [("zero3", "cuda", 1), ("bf16", "cuda", 1)])
    assert r["status"] == INFO and r["actual"] == "world of one" and "zero3" in r["detail"] and "bf16" not in r["detail"]
    assert smoke.world_of_one(2, [("zero3", "cuda", 2)]) == [] and smoke.world_of_one(1, [("bf16", "cuda", 1)]) == []


def test_gpu_only_and_cpu_exclude_each_other():
    with pytest.raises(SystemExit):
        smoke.parse_args(["--gpu-only", "--cpu"])
    assert smoke.parse_args(["--gpu-only"]).require_gpu


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H200", 989.4),
                                            ("NVIDIA H100 PCIe", 756.5), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("NVIDIA L4", None)])
def test_the_measure_knows_the_published_dense_bf16_peaks(name, peak):
    assert measure.peak(name)[0] == peak
