"""The GitHub Actions workflow: valid for actionlint, and consistent with build.py."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from pytorch_cuda_build import cli, matrix
from pytorch_cuda_build.commands import fanout

from helpers import ROOT, venv_tool

WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"


def test_actionlint_accepts_the_workflow():
    proc = subprocess.run([venv_tool("actionlint"), "-no-color", str(WORKFLOW)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The check above can fail: a typo'd expression and an unknown runner key are caught."""
    broken = WORKFLOW.read_text().replace("needs.matrix.outputs.rows", "needs.matrx.outputs.rows")
    broken = broken.replace("timeout-minutes: 20", "timeout-minuts: 20")
    (tmp_path / "broken.yml").write_text(broken)
    proc = subprocess.run([venv_tool("actionlint"), "-no-color", str(tmp_path / "broken.yml")], capture_output=True, text=True)
    assert proc.returncode == 1 and "matrx" in proc.stdout and "timeout-minuts" in proc.stdout, proc.stdout


def zizmor(workflows: Path) -> list[dict]:
    """zizmor's findings at medium severity and above, offline (no GitHub API): what a security
    team's audit of the workflow reports."""
    proc = subprocess.run([venv_tool("zizmor"), "--offline", "--min-severity", "medium", "--format", "json", str(workflows)],
                          capture_output=True, text=True)
    findings = json.loads(proc.stdout or "null")
    assert isinstance(findings, list) and (proc.returncode == 0) == (not findings), proc.stderr[-2000:]
    return findings


def test_zizmor_finds_nothing_in_the_workflow():
    findings = zizmor(WORKFLOW.parent)
    assert not findings, [(f["ident"], f["locations"][0]["symbolic"]["annotation"]) for f in findings]


def test_zizmor_catches_an_unpinned_action_and_persisted_credentials(tmp_path):
    """The audit above can fail: a tag instead of a commit, and a checkout that keeps its token."""
    text = WORKFLOW.read_text()
    text = re.sub(r"actions/setup-python@[0-9a-f]{40} # v[\d.]+", "actions/setup-python@v6", text, count=1)
    text = text.replace("        with:\n          persist-credentials: false\n", "", 1)
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    (workflows / "images.yml").write_text(text)
    assert {f["ident"] for f in zizmor(workflows)} == {"unpinned-uses", "artipacked"}


def test_each_action_is_pinned_to_one_commit_with_its_version():
    """A full commit SHA and its release in a comment, the same pin wherever the action is used
    (the SHAs were read from each action's repository at that tag, docs/security.md)."""
    uses = re.findall(r"uses: (\S+)(.*)", WORKFLOW.read_text())
    pins: dict[str, set[str]] = {}
    for ref, comment in uses:
        action, _, sha = ref.partition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", sha) and re.fullmatch(r" # v\d+\.\d+\.\d+", comment), ref + comment
        pins.setdefault(action, set()).add(sha + comment)
    assert uses and all(len(p) == 1 for p in pins.values()), pins


def _jobs() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def test_every_build_py_call_is_a_real_command():
    runs = " ".join(s.get("run", "") for j in _jobs().values() for s in j["steps"])
    called = set(re.findall(r"build\.py (\w+)", runs))
    assert called and called <= set(cli.NAMES), called - set(cli.NAMES)


def test_fan_out_uses_matrix_json_keys_that_exist():
    """The jobs that fan out over `matrix --json` (build) and `matrix --indexes` (merge) read only its keys."""
    text = json.dumps([_jobs()["build"], _jobs()["merge"]])
    used = set(re.findall(r"\$\{\{\s*matrix\.(\w+)", text))
    row = fanout.as_json(matrix.load(ROOT / "matrix.yaml"))["include"][0]
    assert used and used <= set(row), used - set(row)
    assert "build.py matrix --json" in _jobs()["matrix"]["steps"][-1]["run"]


def test_publish_only_after_a_tested_build_and_never_on_pull_requests():
    jobs = _jobs()
    build = jobs["build"]
    steps = [s.get("name", "") for s in build["steps"]]
    assert steps.index("Build, smoke-test and tag") < steps.index("Publish the tested image (dated immutable tag, then the moving tags)")
    assert "pull_request" not in jobs["matrix"]["if"]
    assert not any("publish" in s.get("run", "") for s in jobs["pr-build"]["steps"])


# The on-request tiers that replay a workflow job: the replay runs them (test_workflow_replay.py).
REPLAYS = {"PYTORCH_CUDA_TEST_BUILD_JOB", "PYTORCH_CUDA_TEST_PR_BUILD", "PYTORCH_CUDA_TEST_SECURITY_REFRESH"}


def on_request_variables() -> set[str]:
    """The variables of docs/testing.md's on-request table."""
    text = (ROOT / "docs" / "testing.md").read_text().split("## On request", 1)[1]
    return set(re.findall(r"^\| `(PYTORCH_CUDA_TEST_\w+)` \|", text, re.M))


def test_the_schedule_runs_every_on_request_tier_that_is_no_replay():
    """Tests that never run rot: each tier of docs/testing.md's on-request table that is no replay of a
    workflow job has a job of the weekly schedule, which sets its variable and runs its tests."""
    job = _jobs()["on-request"]
    assert "schedule" in job["if"]
    tiers = job["strategy"]["matrix"]["include"]
    assert {e["variable"] for e in tiers} == on_request_variables() - REPLAYS and len(tiers) == len(on_request_variables() - REPLAYS)
    for entry in tiers:
        path, _, name = entry["tests"].partition("::")
        source = (ROOT / path).read_text()
        assert entry["variable"] in source, entry  # the test reads the variable the job sets
        assert not name or re.search(rf"^def {name}\(", source, re.M), entry
    run = next(s["run"] for s in job["steps"] if s.get("name") == "The tier's tests, as root")
    assert '"$TIER_VARIABLE=1"' in run and '"$TIER_TESTS"' in run and "CI=true" in run
    assert job["env"] == {"TIER_VARIABLE": "${{ matrix.variable }}", "TIER_TESTS": "${{ matrix.tests }}"}


def test_each_platform_a_row_can_have_has_its_runners_in_the_workflow():
    """The build job picks each platform's runner itself (the runner names live in the workflow, beside
    what uses them): a hosted one, and self-hosted GPU runners whose labels name the architecture."""
    runs_on = _jobs()["build"]["runs-on"]
    gpu, hosted = (json.loads(text) for text in re.findall(r"'(\{.*?\})'", runs_on))
    assert "matrix.platform" in runs_on and "vars.GPU_RUNNER == 'true'" in runs_on
    assert set(hosted) == set(gpu) == set(matrix.OS_PLATFORMS)
    assert hosted["linux/arm64"] == "ubuntu-24.04-arm" and all(isinstance(name, str) for name in hosted.values())
    assert all(labels[:2] == ["self-hosted", "linux"] and "gpu" in labels for labels in gpu.values())
    assert {"x64", "arm64"} == {labels[2] for labels in gpu.values()}
