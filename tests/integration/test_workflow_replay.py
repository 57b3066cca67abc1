"""The CI workflow, run here the way a hosted runner runs it, not only linted.

The run steps of .github/workflows/images.yml, read from the YAML, job by job under the event
that runs it (EVENTS; a test checks it against the jobs' `if:` and `needs:`): a push to main
(`checks`, `matrix`, `build` for the default row through `publish` to a registry on 127.0.0.1
that asks for a password, `merge`), a pull request (`checks`, `pr-build`) and the weekly
schedule (`propose`, `security-refresh`; its `on-request` job, a job per test tier on request, is named
here and not replayed: its tiers are those tests). As on a hosted runner:

- a user that is not root, with password-less sudo, in the docker group;
- an engine that is already up: Docker 26 with buildx (`build.py engine`), reached through
  DOCKER_HOST and a `docker` on PATH, with buildx in ~/.docker/cli-plugins; with the image store
  each job's step asks for (the containerd store for `build`, the classic one for `pr-build`), so
  that step finds it and restarts nothing;
- a fresh checkout, `python` 3.11 on PATH, and the files named by GITHUB_OUTPUT and
  GITHUB_STEP_SUMMARY;
- each step run as `bash --noprofile --norc -eo pipefail FILE`, with the env of the workflow,
  the job and the step.

`uses:` steps do what those actions do: checkout is the clone, setup-python is the host's
python3 (its version is checked), and upload-artifact checks that its path exists. Each
expression is looked up in a table of what it evaluates to on this run, so a workflow edit that
adds an expression fails here until the table says what it means.

The runner gets three things here that a hosted one would not need:
- the current engine's network settings (PYTORCH_CUDA_BUILD_NETWORK, PYTORCH_CUDA_CONTAINER_DNS;
  that engine has no NAT);
- the TLS proxy's CA variables;
- the base rootfs in the engine's store. build.py builds it with mmdebstrap: as root, through
  sudo on a hosted runner, or in a user namespace where there is no sudo.

In this project's CI: `checks`, `matrix`, `merge` and `propose`; `pr-build` up to its test step,
that step collecting only (every lane collects the suite but the `root` tier, which it leaves out
by name), with two probes of how the runner's user has root (a `root` test refused, a tmpfs mount
through sudo); `security-refresh` up to its check, with the refresh step's condition checked.
More than CI's budget leaves, on request:
- PYTORCH_CUDA_TEST_BUILD_JOB=1: the `build` job through publish, the full pipeline on the current
  engine with the containerd store (build, smoke, structure, tag, publish, a pull back by digest):
  about 12 min with the row's layers in that engine's build cache, 23 to 40 min cold on 2 cores.
  The engine's store is left as the test found it (its images removed, its build cache pruned
  back), so a run after it is cold unless that cache held the row before.
  With PYTORCH_CUDA_TEST_VERIFY_IMAGE=1 too, `verify --image` of what it published, from a fresh
  clone (the row rebuilt without cache, ops compiled).
- PYTORCH_CUDA_TEST_PR_BUILD=1: `pr-build` whole (the build, then the suite), alone.
- PYTORCH_CUDA_TEST_SECURITY_REFRESH=1: `security-refresh` whole (re-lock, re-render, the branch
  pushed to a local bare repository).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import fanout
from pytorch_cuda_build.stages import build, publish
from pytorch_cuda_build.tooling.selftest import LEAVE_OUT_ENV

from helpers import ROOT, base_in_current_engine, current_engine, needs_root, store_restored
from registry import BINARY, LocalRegistry

pytestmark = [pytest.mark.docker, pytest.mark.engine26]

WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"
# A hosted Ubuntu runner's PATH has the sbin folders (engine.sh looks for dockerd, slurmd and munged there).
RUNNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
USER = "pcb-runner"
HOME = Path("/home") / USER
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
REGISTRY_USER, REGISTRY_PASSWORD = "ci", "ci-password-not-printed"
# What the runner's machine lends every step: its CA bundle (the TLS proxy) and pip's settings.
PASSED_THROUGH = re.compile(r"^(PIP_\w+|SSL_CERT_\w+|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|GIT_SSL_CAINFO|\w*_proxy|\w*_PROXY)$")


# What each replayed event runs, by the jobs' `if:` and `needs:` (test_each_event_runs_the_jobs_
# the_replay_replays checks it against the workflow). workflow_dispatch runs the push's jobs and
# the schedule's, each replayed under its own event.
EVENTS = {"push": ("checks", "matrix", "build", "merge"), "pull_request": ("checks", "pr-build"),
          "schedule": ("propose", "security-refresh", "on-request")}
# The schedule's on-request job, one job per test tier that runs on request and is no replay of a
# workflow job (docs/testing.md, "On request"): its matrix, by tier. These run on GitHub's schedule
# only; the replay checks that each is a job of its own (test_the_schedule_runs_each_on_request_tier)
# and the unit tier that each names its tests and its variable (tests/unit/test_workflow.py).
ON_REQUEST = ("cuda13", "devel", "no-cache", "arm64", "derived-26", "podman", "train", "verify-image", "reproducible", "faults", "hermetic")
EVENT_ENV = {"push": {"GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main"},
             "pull_request": {"GITHUB_EVENT_NAME": "pull_request", "GITHUB_REF": "refs/pull/50/merge"},
             "schedule": {"GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": "refs/heads/main"}}
REPOSITORY = "example/pytorch-cuda"  # GITHUB_REPOSITORY: security-refresh pushes its branch there
TOKEN = "ghs_replay-token-not-real"  # github.token: only the push URL holds it, rewritten to a local remote


def expressions(event: str = "push", registry: str | None = None, row: dict | None = None) -> dict[str, object]:
    """What each expression the replayed jobs use evaluates to on this run: `event` on a hosted
    runner without a GPU, with vars.REGISTRY set where `registry` is given. The registry and the
    row are the build job's; a job before it that used them would fail here."""
    table: dict[str, object] = {f"matrix.{k}": v for k, v in (row or {}).items()}
    general = {
        "github.event_name != 'schedule'": event != "schedule",
        "github.event_name == 'pull_request'": event == "pull_request",
        "github.event_name == 'push' || github.event_name == 'workflow_dispatch'": event == "push",
        "github.event_name == 'schedule' || github.event_name == 'workflow_dispatch'": event == "schedule",
        "vars.GPU_RUNNER != 'true'": True,
        "always()": True,
        "vars.GPU_RUNNER == 'true' && '--require-gpu' || ''": "",
        "vars.REGISTRY != ''": registry is not None,
        "github.token": TOKEN,
    }
    if registry is None:
        return table | general
    return table | general | {
        "vars.REGISTRY": registry,
        "secrets.REGISTRY_USER": REGISTRY_USER,
        "secrets.REGISTRY_PASSWORD": REGISTRY_PASSWORD,
        "vars.REGISTRY != '' && vars.GPU_RUNNER != 'true' && "
        "format('type=registry,ref={0}/pytorch-cuda-cache:{{image}}', vars.REGISTRY) || ''":
            f"type=registry,ref={registry}/pytorch-cuda-cache:{{image}}",
    }


STEP_OUTPUT_TEST = re.compile(r"^steps\.(\w+)\.outputs\.(\w+) == '([^']*)'$")


def evaluate(expr: str, table: dict[str, object]) -> object:
    key = " ".join(expr.strip().removeprefix("${{").removesuffix("}}").split())
    if key not in table and (m := STEP_OUTPUT_TEST.match(key)) and f"steps.{m[1]}.outputs.{m[2]}" in table:
        return table[f"steps.{m[1]}.outputs.{m[2]}"] == m[3]  # an earlier step's output, as it was written
    if key not in table:
        pytest.fail(f"the replay does not know what {key!r} evaluates to; add it to expressions()")
    return table[key]


def substitute(text: str, table: dict[str, object]) -> str:
    """Each ${{ ... }} in text replaced by its value. The end is the first }} outside a quoted
    string: format('...{{image}}', ...) holds braces of its own."""
    out, i = [], 0
    while (start := text.find("${{", i)) >= 0:
        j, quoted = start + 3, False
        while not (not quoted and text.startswith("}}", j)):
            if j >= len(text):
                pytest.fail(f"unterminated expression in {text!r}")
            quoted ^= text[j] == "'"  # '' inside a string toggles twice: still quoted
            j += 1
        out += [text[i:start], str(evaluate(text[start + 3:j], table))]
        i = j + 2
    return "".join(out) + text[i:]


def condition(step_or_job: dict, table: dict[str, object]) -> bool:
    return "if" not in step_or_job or bool(evaluate(str(step_or_job["if"]), table))


def as_runner(argv: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> int:
    """argv as the runner user, with exactly env (nothing of ours leaks in), output to log."""
    with open(log, "ab") as out:
        return subprocess.run(["runuser", "-u", USER, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv],
                              cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=timeout).returncode


@pytest.fixture(scope="module")
def current():
    with current_engine() as env:
        yield env


@pytest.fixture(scope="module")
def classic(current):
    """The runner's engine for pr-build, which keeps (or switches to) Docker's classic image store:
    Docker 26 with that store, as `build.py engine --store classic` starts it."""
    with current_engine("classic") as env:
        yield env


def on_engine(runner_env: dict[str, str], engine: dict[str, str]) -> dict[str, str]:
    return {**runner_env, "DOCKER_HOST": engine["DOCKER_HOST"]}


@pytest.fixture(scope="module")
def runner(current):
    """A hosted runner's user on this machine: sudo, the docker group, the current engine as
    `docker`, a fresh checkout of HEAD. Removed afterwards, home and all."""
    needs_root("a runner user of its own (useradd, /etc/sudoers.d)")
    for tool in ("sudo", "runuser", "jq", "git"):
        if not shutil.which(tool):
            pytest.fail(f"{tool} missing: engine.sh --with-registry (build.py selftest) installs it")
    _remove_user()  # one a killed run left behind
    subprocess.run(["useradd", "--create-home", "--home-dir", str(HOME), "--shell", "/bin/bash",
                    "--groups", "docker", USER], check=True)
    sudoers = Path("/etc/sudoers.d") / USER
    sudoers.write_text(f"{USER} ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)
    try:
        bin_dir = HOME / "bin"
        plugins = HOME / ".docker" / "cli-plugins"
        for d in (bin_dir, plugins, HOME / "runner-temp"):
            d.mkdir(parents=True)
        (bin_dir / "docker").symlink_to(current["PYTORCH_CUDA_DOCKER"])
        (bin_dir / "python").symlink_to("/usr/bin/python3")
        (plugins / "docker-buildx").symlink_to((Path(current["DOCKER_CONFIG"]) / "cli-plugins" / "docker-buildx").resolve())
        workspace = HOME / "work" / "pytorch-cuda"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(workspace)], check=True)
        subprocess.run(["chown", "-R", f"{USER}:{USER}", str(HOME)], check=True)
        env = {"HOME": str(HOME), "USER": USER, "LANG": "C.UTF-8", "PATH": f"{bin_dir}:{RUNNER_PATH}",
               "CI": "true", "GITHUB_ACTIONS": "true", **EVENT_ENV["push"], "GITHUB_REPOSITORY": REPOSITORY,
               "GITHUB_WORKSPACE": str(workspace), "RUNNER_TEMP": str(HOME / "runner-temp"),
               "DOCKER_HOST": current["DOCKER_HOST"],
               "PYTORCH_CUDA_BUILD_NETWORK": current["PYTORCH_CUDA_BUILD_NETWORK"],
               "PYTORCH_CUDA_CONTAINER_DNS": current["PYTORCH_CUDA_CONTAINER_DNS"]}
        env.update({k: v for k, v in os.environ.items() if PASSED_THROUGH.match(k)})
        yield workspace, env
    finally:
        sudoers.unlink(missing_ok=True)
        _remove_user()


def _remove_user() -> None:
    """The runner user, its home and anything it left running (a user with a process is not removed)."""
    subprocess.run(["pkill", "-KILL", "-u", USER], capture_output=True)
    # what it left in /tmp (pytest's base temp among them): a new user of that name would be refused it
    subprocess.run(["find", "/tmp", "-maxdepth", "1", "-user", USER, "-exec", "rm", "-rf", "{}", "+"], capture_output=True)
    subprocess.run(["userdel", "--remove", USER], capture_output=True)
    if subprocess.run(["id", USER], capture_output=True).returncode == 0:
        print(f"warning: could not remove user {USER}; remove it with `userdel --remove {USER}`")


def run_job(workflow: dict, name: str, table: dict[str, object], workspace: Path, runner_env: dict[str, str],
            logs: Path, event: str = "push", until: str | None = None, left: dict[str, str] | None = None,
            step_env: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """One job's steps, in order, as the runner would run them under `event`; the job's outputs.
    `until` (a step's name) ends the job after that step; `left` names the steps not run here,
    each with the reason; `step_env` adds to a named step's env (the replay's instruments)."""
    job = workflow["jobs"][name]
    assert condition(job, table), f"job {name} would not run on {event}"
    left, step_env = left or {}, step_env or {}
    names = [s.get("name") for s in job["steps"]]
    assert set(left) | set(step_env) | {until} - {None} <= set(names), f"{name} has no step named so: {names}"
    deadline = time.monotonic() + 60 * job.get("timeout-minutes", 360)
    job_env = {**workflow.get("env", {}), **{k: substitute(str(v), table) for k, v in job.get("env", {}).items()}}
    table = dict(table)  # and each step's outputs, as they are written (steps.<id>.outputs.<key>)
    runner_env = {**runner_env, **EVENT_ENV[event]}
    for i, step in enumerate(job["steps"]):
        if step.get("name") in left or not condition(step, table):
            continue
        label = f"{name}[{i}] {step.get('name') or step.get('uses') or step.get('id')}"
        if "uses" in step:
            _action(step, workspace, runner_env, logs / f"{name}-{i}.log")
            continue
        temp = Path(runner_env["RUNNER_TEMP"])  # the runner's own: it reads the script, writes the outputs
        script = temp / f"{name}-{i}.sh"
        script.write_text(substitute(step["run"], table))
        script.chmod(0o644)
        output = temp / f"{name}-{i}.output"
        summary = temp / f"{name}-{i}.summary"
        for f in (output, summary):
            f.write_text("")
            shutil.chown(f, USER)
        env = {**runner_env, **job_env, **{k: substitute(str(v), table) for k, v in step.get("env", {}).items()},
               **step_env.get(step.get("name"), {}), "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(summary)}
        log = logs / f"{name}-{i}.log"
        code = as_runner(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], env, workspace, log,
                         timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            pytest.fail(f"step {label} exited {code} as {USER}; last lines of {log}:\n{tail}")
        if "id" in step:
            table.update({f"steps.{step['id']}.outputs.{k}": v for k, v in
                          (ln.split("=", 1) for ln in output.read_text().splitlines() if "=" in ln)})
        if until is not None and step.get("name") == until:
            break
    return {k: substitute(v, table) for k, v in job.get("outputs", {}).items()}


def step_index(workflow: dict, job: str, says: str) -> int:
    """The one step of `job` whose run: holds `says`."""
    found = [i for i, s in enumerate(workflow["jobs"][job]["steps"]) if says in s.get("run", "")]
    assert len(found) == 1, f"{job} has {len(found)} steps that run {says!r}"
    return found[0]


def checkout(name: str, runner_env: dict[str, str], seeded: Path) -> Path:
    """A fresh checkout of HEAD for one job, as each hosted job gets its own; its .venv is the
    `seeded` checkout's (build.py made it there in the checks job), linked, not made again."""
    workspace = HOME / "work" / name
    as_runner(["git", "clone", "--quiet", str(seeded), str(workspace)], runner_env, HOME, HOME / "clone.log", timeout=300)
    as_runner(["ln", "-s", str(seeded / ".venv"), str(workspace / ".venv")], runner_env, HOME, HOME / "clone.log", timeout=60)
    assert (workspace / ".venv" / "bin" / "python").exists(), (HOME / "clone.log").read_text()
    return workspace


@pytest.fixture(scope="module")
def checked(runner, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The jobs a push to main runs before the build fan-out: checks, then matrix. Each job's outputs."""
    workspace, runner_env = runner
    logs = tmp_path_factory.mktemp("logs")  # ours: the runner's output is written here by this process
    workflow = yaml.safe_load(WORKFLOW.read_text())
    return {name: run_job(workflow, name, expressions("push"), workspace, runner_env, logs) for name in ("checks", "matrix")}


def test_the_checks_and_matrix_jobs_run_as_a_runner_user(checked):
    # what fromJSON(needs.matrix.outputs.rows) fans out: every row of the checkout's matrix.yaml
    assert json.loads(checked["matrix"]["rows"]) == fanout.as_json(matrix.load(ROOT / "matrix.yaml"))


def _action(step: dict, workspace: Path, runner_env: dict[str, str], log: Path) -> None:
    action = step["uses"].split("@")[0]
    if action == "actions/checkout":
        assert (workspace / ".git").is_dir()
    elif action == "actions/setup-python":
        want = str(step["with"]["python-version"])
        code = as_runner(["python", "-c", f"import sys; sys.exit(sys.version.startswith('{want}.') is False)"],
                         runner_env, workspace, log, timeout=60)
        assert code == 0, f"`python` on the runner's PATH is not Python {want}"
    elif action == "actions/upload-artifact":
        assert (workspace / step["with"]["path"]).exists(), step["with"]["path"]
    else:
        pytest.fail(f"the replay does not know what {step['uses']} does")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_BUILD_JOB") != "1",
                    reason="the full pipeline again on Docker 26 (about 12 min with its cache warm, 23 to 40 min "
                           "cold on 2 cores): on request, PYTORCH_CUDA_TEST_BUILD_JOB=1")
def test_the_build_job_runs_as_a_runner_user_through_publish_and_the_pushed_digest_pulls_back(
        runner, checked, current, docker_client, tmp_path):
    if BINARY is None:
        pytest.fail("no docker-registry binary: engine.sh --with-registry (build.py selftest) installs it")
    workspace, runner_env = runner
    logs = tmp_path / "logs"  # ours: the runner's output is written here by this process
    logs.mkdir()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    # fromJSON(needs.matrix.outputs.rows): the fan-out, of which this runner gets the default row
    assert workflow["jobs"]["build"]["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.rows) }}"
    row = next(r for r in json.loads(checked["matrix"]["rows"])["include"] if r["image"] == ROW.name)
    with store_restored(current):
        base_in_current_engine(current, docker_client, ROW, tmp_path / "base")
        _build_job(workflow, row, workspace, runner_env, current, docker_client, logs, tmp_path)


def _build_job(workflow: dict, row: dict, workspace: Path, runner_env: dict[str, str], current: dict[str, str], docker_client,
               logs: Path, tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path / "registry").start(users={REGISTRY_USER: REGISTRY_PASSWORD})
    try:
        run_job(workflow, "build", expressions("push", reg.address("ml"), row), workspace, runner_env, logs)
        assert row["build_args"] == "--torch 2.7.1 --cuda 12.1 --flavor runtime"
        results = workspace / "build-results" / ROW.name
        summary = json.loads((results / "summary.json").read_text())
        published = json.loads((results / "published.json").read_text())
        # the containerd store's image ID is the manifest digest, and that is what the registry holds
        assert published["digest"] == published["image_id"] == summary["image_id"], published
        # and the base it names is in the registry under that same digest, for a rebuild elsewhere
        labels = json.loads(_current(current, "image", "inspect", "--format", "{{json .Config.Labels}}", summary["image_id"]).stdout)
        assert published["base"]["digest"] == published["base"]["image_id"] == labels[publish.BASE_LABEL], published
        smoke = json.loads((results / "smoke-report.json").read_text())
        assert smoke["summary"]["PASS"] > 0 and smoke["summary"]["FAIL"] == 0, smoke["summary"]
        ids = {_current(current, "image", "inspect", "--format", "{{.Id}}", ref).stdout.strip() for ref in ROW.refs()}
        assert ids == {summary["image_id"]}, ids
        _saved_as_an_oci_layout(current, summary["image_id"])
        # the build cache went to the registry beside the images, for the next cold runner
        assert {"ml/pytorch-cuda", "ml/pytorch-cuda-cache", "ml/pytorch-cuda-rootfs"} <= set(_catalog(reg)), _catalog(reg)
        # the other engine, the other store: it pulls by that digest, with the password, and runs it
        ref = f"{published['repository']}@{published['digest']}"
        pulled = docker_client.images.pull(ref, auth_config={"username": REGISTRY_USER, "password": REGISTRY_PASSWORD})
        try:
            out = docker_client.containers.run(ref, ["python", "-c", "import torch, deepspeed; print('ok')"],
                                               environment={"PYTORCH_CUDA_NO_BANNER": "1"}, remove=True)
            assert out.strip().splitlines()[-1] == b"ok", out  # DeepSpeed logs its accelerator choice first
        finally:
            docker_client.images.remove(pulled.id, force=True)
        if os.environ.get("PYTORCH_CUDA_TEST_VERIFY_IMAGE") == "1":
            _verified_from_a_fresh_clone(workspace, runner_env, ref, logs)
            # the same image: its rebuild (10 GB) is not left behind
            rebuilt = f"{ROW.repository}-verify:{ROW.local_name}-published"
            assert _current(current, "image", "inspect", rebuilt).returncode == 1, f"{rebuilt} left in the store"
    finally:
        reg.stop()
        shutil.rmtree(reg.storage, ignore_errors=True)  # gigabytes of image and cache: CI's disk is shared


def _verified_from_a_fresh_clone(seeded: Path, runner_env: dict[str, str], ref: str, logs: Path) -> None:
    """What a user of the published image does, once: `verify --image` by digest from a fresh
    clone at the image's commit, with the registry's password, on the same engine. It rebuilds
    the row without cache and with the ops compiled (1292 s on 2 cores, once), and must find
    the same image (exit 0, THE SAME IMAGE)."""
    workspace = checkout("verify", runner_env, seeded)
    log = logs / "verify.log"
    env = {**runner_env, "PYTORCH_CUDA_REGISTRY_USER": REGISTRY_USER, "PYTORCH_CUDA_REGISTRY_PASSWORD": REGISTRY_PASSWORD}
    started = time.monotonic()
    code = as_runner(["python", "build.py", "verify", "--image", ref], env, workspace, log, timeout=3 * 3600)
    said = log.read_text(errors="replace")
    print(f"verify --image {ref}: exit {code} in {time.monotonic() - started:.0f} s")
    assert code == 0 and "THE SAME IMAGE" in said, said[-5000:]


def _current(current: dict, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([current["PYTORCH_CUDA_DOCKER"], *args], env={**os.environ, **current}, capture_output=True,
                          text=True, timeout=600, **kw)


def _saved_as_an_oci_layout(current: dict, image_id: str) -> None:
    saved = subprocess.Popen([current["PYTORCH_CUDA_DOCKER"], "save", ROW.refs()[0]], stdout=subprocess.PIPE,
                             env={**os.environ, **current})
    with tarfile.open(fileobj=saved.stdout, mode="r|") as tar:
        names = [m.name for m in tar]
    assert saved.wait() == 0 and "index.json" in names and f"blobs/sha256/{image_id.split(':')[1]}" in names


def _catalog(reg: LocalRegistry) -> list[str]:
    import base64
    import urllib.request
    token = base64.b64encode(f"{REGISTRY_USER}:{REGISTRY_PASSWORD}".encode()).decode()
    req = urllib.request.Request(f"http://{reg.host}/v2/_catalog", headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["repositories"]


def _base_as_runner(workspace: Path, runner_env: dict[str, str], ref: str) -> subprocess.CompletedProcess:
    """The row's base rootfs built under a throwaway name as the runner user, the way build.py
    chooses (mmdebstrap through sudo, or in a user namespace without it), from its locked files in
    the user's store, in the checks job's .venv. The last line of its stdout is the image ID."""
    script = ("import docker; from pathlib import Path; from pytorch_cuda_build import matrix\n"
              "from pytorch_cuda_build.stages import base, fetch, lock\n"
              "row = matrix.load(Path('matrix.yaml')).select('2.7', '12.1')\n"
              "ins = lock.build_inputs(Path('.'), row).base  # into the user's own store, as build.py fetches them\n"
              "fetch.fetch(list(ins), None, print, 'the base')\n"
              f"print(base._rootfs(docker.from_env(), row, {ref!r}, Path.home(), print, 'docker', ins))\n")
    return subprocess.run(["runuser", "-u", USER, "--", "env", "-i", *[f"{k}={v}" for k, v in runner_env.items()],
                           ".venv/bin/python", "-c", script], cwd=workspace, capture_output=True, text=True, timeout=1800)


def test_the_runner_user_builds_a_base_rootfs_through_sudo(runner, checked, current):
    """What build.py does on a hosted runner that lacks the base: mmdebstrap through sudo, its
    tarball written to the user's file, loaded by the user's docker, nothing of root's left. A
    throwaway name, so the row's own base (and every layer built on it) is left alone. It runs
    in the .venv the checks job's build.py made."""
    workspace, runner_env = runner
    ref = "pytorch-cuda-rootfs:replay-sudo"
    try:
        proc = _base_as_runner(workspace, runner_env, ref)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "(through sudo;" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("sha256:")
        shell = _current(current, "run", "--rm", ref, "sh", "-c", "test ! -e /var/lib/apt/lists/lock && ls /var/lib/apt/lists")
        assert shell.returncode == 0 and shell.stdout.split() == ["partial"], shell.stdout + shell.stderr
        assert not [p for p in Path("/tmp").glob("pytorch-cuda-rootfs-*") if p.owner() == USER]  # nothing left behind
    finally:
        _current(current, "image", "rm", "--force", ref)


def test_a_runner_user_without_sudo_builds_a_base_rootfs_with_mmdebstrap(runner, checked, current):
    """Where the runner forbids root: no sudo, so mmdebstrap builds the tree in a user namespace
    (the user's /etc/subuid range), and the user's docker loads it. Built twice under two names:
    one image ID, because the tarball is the same bytes from the same mirror."""
    workspace, runner_env = runner
    if USER not in Path("/etc/subuid").read_text():
        pytest.fail(f"{USER} has no /etc/subuid range: useradd gives one where /etc/login.defs sets SUB_UID_COUNT")
    refs = ["pytorch-cuda-rootfs:replay-unshare-1", "pytorch-cuda-rootfs:replay-unshare-2"]
    sudoers = Path("/etc/sudoers.d") / USER
    grant = sudoers.read_text()
    sudoers.unlink()
    try:
        ids = []
        for ref in refs:
            proc = _base_as_runner(workspace, runner_env, ref)
            log = HOME / "rootfs.log"  # mmdebstrap's, where it got that far
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
            assert "(without root, in a user namespace;" in proc.stdout, proc.stdout
            ids.append(proc.stdout.strip().splitlines()[-1])
        assert ids[0].startswith("sha256:") and ids[0] == ids[1], ids
        # No apt lists or caches; owners, groups and set-uid bits as the packages set them.
        shell = _current(current, "run", "--rm", refs[0], "sh", "-c",
                         "ls -A /var/lib/apt/lists /var/cache/apt; stat -c '%U:%G:%a' /etc/shadow /usr/bin/su /var/mail; "
                         "apt-get --version | head -1")
        assert shell.returncode == 0, shell.stdout + shell.stderr
        assert shell.stdout.split()[:8] == ["/var/cache/apt:", "archives", "/var/lib/apt/lists:", "partial",
                                            "root:shadow:640", "root:root:4755", "root:mail:2775", "apt"], shell.stdout
        assert not [p for p in Path("/tmp").glob("pytorch-cuda-rootfs-*") if p.owner() == USER]
    finally:
        sudoers.write_text(grant)
        sudoers.chmod(0o440)
        for ref in refs:
            _current(current, "image", "rm", "--force", ref)


def test_the_merge_job_joins_the_platform_parts_into_one_index_under_the_rows_tags(runner, checked, docker_client, tmp_path):
    """The merge job for the 2.11 row, as a runner user, against a registry on 127.0.0.1 that asks
    for a password: the parts the two platform builds would have published (two small images,
    amd64 and arm64, pushed here under `<dated>-<arch>`) become one index under the row's dated
    and moving tags. The dated tag is the checkout's (commit day, lock), as the builds' is."""
    if BINARY is None:
        pytest.fail("no docker-registry binary: engine.sh --with-registry (build.py selftest) installs it")
    workspace, runner_env = runner
    logs = tmp_path / "logs"
    logs.mkdir()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow["jobs"]["merge"]["needs"] == ["matrix", "build"]  # no merge unless every build passed
    assert workflow["jobs"]["merge"]["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.indexes) }}"
    arm_row = matrix.load(ROOT / "matrix.yaml").select("2.11", "13.0")
    row = next(r for r in json.loads(checked["matrix"]["indexes"])["include"] if r["image"] == arm_row.name)
    src = build.source(ROOT)
    dated = publish.dated_tag(arm_row, {publish.CREATED_LABEL: src.created,
                                        publish.LOCK_LABEL: publish.lock_files_sha256(ROOT, arm_row)}, "the checkout")
    reg = LocalRegistry(tmp_path / "registry").start(users={REGISTRY_USER: REGISTRY_PASSWORD})
    ids = {}
    try:
        for platform in arm_row.platforms:
            ids[platform] = _small_part(docker_client, tmp_path, platform, f"{reg.host}/ml/{arm_row.repository}:{dated}-{platform.split('/')[1]}")
        run_job(workflow, "merge", expressions("push", reg.address("ml"), row), workspace, runner_env, logs)
        for tag in [dated, *arm_row.tags]:
            doc = json.loads(_skopeo_raw(reg, f"ml/{arm_row.repository}:{tag}"))
            platforms = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in doc["manifests"]}
            assert set(platforms) == set(arm_row.platforms), doc
            for platform, digest in platforms.items():
                manifest = json.loads(_skopeo_raw(reg, f"ml/{arm_row.repository}@{digest}"))
                assert manifest["config"]["digest"] == ids[platform]  # the part as pushed: the image's config
    finally:
        reg.stop()


def _small_part(docker_client, tmp: Path, platform: str, target: str) -> str:
    """A one-file image of platform (no RUN: nothing emulated), pushed with skopeo to target as a
    platform build's part; its image ID (the config digest on the classic store)."""
    from pytorch_cuda_build.engine import docker_env
    ctx = tmp / platform.replace("/", "-")
    ctx.mkdir()
    (ctx / "file").write_text(platform)
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY file /file\n")
    bc = docker_env.build_client(None)
    iid = ctx / "iid"
    subprocess.run([*bc.argv, "--platform", platform, "--iidfile", str(iid), str(ctx)], check=True, capture_output=True,
                   env=docker_env.build_env(bc))
    image_id = iid.read_text().strip()
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"--dest-creds={REGISTRY_USER}:{REGISTRY_PASSWORD}",
                    f"docker-daemon:{image_id}", f"docker://{target}"], check=True, capture_output=True)
    docker_client.images.remove(image_id, force=True)
    return image_id


def _skopeo_raw(reg: LocalRegistry, ref: str) -> bytes:
    return subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"--creds={REGISTRY_USER}:{REGISTRY_PASSWORD}",
                           f"docker://{reg.host}/{ref}"], check=True, capture_output=True).stdout


# ---- every event: which jobs run ------------------------------------------------------------------

def test_each_event_runs_the_jobs_the_replay_replays():
    """By the workflow's own `if:`s and `needs:`, with vars.REGISTRY set: a job added, or an event
    that starts running another job, fails here until the replay replays it."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    jobs = workflow["jobs"]
    for event, replayed in EVENTS.items():
        table, runs = expressions(event, "registry.invalid/ml"), set()
        for name in jobs:  # in the file's order, each after what it needs (a `needs:` names earlier jobs)
            needs = jobs[name].get("needs", [])
            if condition(jobs[name], table) and set([needs] if isinstance(needs, str) else needs) <= runs:
                runs.add(name)
        assert runs == set(replayed), (event, sorted(runs))
    assert set(jobs) == {j for replayed in EVENTS.values() for j in replayed}


def test_the_schedule_runs_each_on_request_tier_in_a_job_of_its_own():
    """The on-request job's matrix is one job per tier, each named by it, none of them failing the others."""
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["on-request"]
    assert tuple(e["tier"] for e in job["strategy"]["matrix"]["include"]) == ON_REQUEST
    assert job["strategy"]["fail-fast"] is False and job["name"] == "on request ${{ matrix.tier }}"


# ---- a pull request: checks, then pr-build up to its test step ------------------------------------

def test_a_pull_requests_checks_job_is_the_push_one(checked):
    """The checks job a pull request runs is the one `checked` replayed for the push: its steps
    and their env and conditions evaluate alike under both events."""
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["checks"]
    push, pr = expressions("push"), expressions("pull_request")
    assert condition(job, pr)
    for step in job["steps"]:
        assert condition(step, push) == condition(step, pr), step
        text = json.dumps({k: step.get(k) for k in ("run", "env", "with")})
        assert substitute(text, push) == substitute(text, pr), step


def _collected(out: str) -> set[str]:
    return {ln.strip() for ln in out.splitlines() if re.match(r"^tests/\S+\.py::", ln.strip())}


def test_pr_build_up_to_its_test_step_leaves_out_only_the_root_tier_by_name(runner, checked, classic, tmp_path):
    """pr-build as its runner runs it, but for the default row's build (the README's build line
    under CI=true, which the build job's replay runs as this user, on request): the disk step, the
    suite's tools through sudo (engine.sh as root), then the test step itself with pytest told to
    collect only (PYTEST_ADDOPTS). Each lane collects the whole suite but the tests marked with
    what PYTORCH_CUDA_TEST_LEAVE_OUT names, and says how many it left out. Then the two ways root
    is had: a `root` test run by this user fails on its precondition (so the leave-out is what
    keeps it out, not a skip), and a test that needs root for one command (a tmpfs mount) passes
    through the runner's sudo."""
    workspace, runner_env = runner
    logs = tmp_path / "logs"
    logs.mkdir()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["pr-build"]
    build_step, test_step = (job["steps"][step_index(workflow, "pr-build", says)] for says in
                             ("build.py --torch 2.7 --cuda 12.1", "build.py selftest"))
    leave_out = test_step["env"][LEAVE_OUT_ENV].split()
    assert leave_out == ["root"], leave_out
    freed = [p for p in job["steps"][step_index(workflow, "pr-build", "sudo rm -rf")]["run"].split()[3:]]
    assert freed and not [p for p in freed if Path(p).exists()], f"the disk step would delete {freed} on this machine"
    store_step = job["steps"][step_index(workflow, "pr-build", "containerd-snapshotter\"] = false")]
    runner_env = on_engine(runner_env, classic)
    run_job(workflow, "pr-build", expressions("pull_request"), workspace, runner_env, logs, event="pull_request",
            until=test_step["name"], left={build_step["name"]: "the default row's build: the build job's replay, on request"},
            step_env={test_step["name"]: {"PYTEST_ADDOPTS": "--collect-only -q -p no:cacheprovider"}})
    said = (logs / f"pr-build-{job['steps'].index(store_step)}.log").read_text(errors="replace")
    assert said.strip() == "the engine uses the classic image store", said  # nothing restarted here
    out = (logs / f"pr-build-{job['steps'].index(test_step)}.log").read_text(errors="replace")
    collected = _collected(out)

    def collect(*args: str) -> set[str]:
        log = tmp_path / "collect.log"
        log.write_text("")
        code = as_runner([".venv/bin/python", "-m", "pytest", "tests", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         runner_env, workspace, log, timeout=300)
        assert code == 0, log.read_text()[-3000:]
        return _collected(log.read_text())

    everything, root = collect(), collect("-m", "root")
    assert root and any("test_slurm.py" in t for t in root) and collected, out[-3000:]
    assert collected == everything - root, {"run but root": sorted(collected & root)[:10],
                                            "missing": sorted(everything - root - collected)[:10]}
    said = [int(n) for n in re.findall(rf"left out by name \({LEAVE_OUT_ENV}\): (\d+) tests marked root", out)]
    assert sum(said) == len(root), (said, len(root))

    one_root_test = sorted(t for t in root if "test_slurm.py" in t)[0]
    log = tmp_path / "root-test.log"
    code = as_runner([".venv/bin/python", "-m", "pytest", "-p", "no:cacheprovider", one_root_test], runner_env, workspace, log, timeout=300)
    assert code == 1 and "needs root on this host (marker root)" in log.read_text(), log.read_text()[-3000:]
    log = tmp_path / "sudo-test.log"
    code = as_runner([".venv/bin/python", "-m", "pytest", "-p", "no:cacheprovider", "-ra",
                      "tests/integration/test_faults.py::test_full_disk_during_render_changes_no_file"], runner_env, workspace, log,
                     timeout=600)
    assert code == 0 and "1 passed" in log.read_text(), log.read_text()[-3000:]


# ---- the weekly schedule: propose, security-refresh ---------------------------------------------

REFRESH_WHOLE = os.environ.get("PYTORCH_CUDA_TEST_SECURITY_REFRESH") == "1"


@pytest.mark.network
def test_the_schedule_proposes_rows_and_a_security_refresh_follows_the_findings(runner, checked, tmp_path):
    """The schedule's two jobs, each in a checkout of its own, against the real package index and
    Debian's security suite. Whether the check finds advisories is the day's news; the refresh
    step runs only with findings, and must then push a branch, re-locked and re-rendered.

    That step re-locks every row against the index (about 2.5 min, most of it waiting on the
    index): in this project's CI it is left out by name and only its condition is checked against
    the check's output; it runs on request, PYTORCH_CUDA_TEST_SECURITY_REFRESH=1. Its push goes to
    github.com in the workflow; git's url.insteadOf sends it to a bare repository of the runner
    user's here (nothing leaves the machine but the index's and the mirror's reads)."""
    seeded, runner_env = runner
    logs = tmp_path / "logs"
    logs.mkdir()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    remote = HOME / "remote.git"
    for argv in (["git", "init", "--quiet", "--bare", str(remote)],
                 ["git", "config", "--global", f"url.{remote}.insteadOf",
                  f"https://x-access-token:{TOKEN}@github.com/{REPOSITORY}.git"]):
        assert as_runner(argv, runner_env, HOME, logs / "remote.log", timeout=60) == 0, (logs / "remote.log").read_text()
    table = expressions("schedule")
    temp = Path(runner_env["RUNNER_TEMP"])

    proposing = checkout("propose", runner_env, seeded)
    run_job(workflow, "propose", table, proposing, runner_env, logs, event="schedule")
    i = step_index(workflow, "propose", "matrix --propose")
    assert (temp / f"propose-{i}.summary").read_text().startswith("### Proposed matrix rows\n```yaml\n")
    assert (proposing / "proposal.yaml").read_text().strip()

    refreshing = checkout("security-refresh", runner_env, seeded)
    j = step_index(workflow, "security-refresh", "git push")
    refresh = workflow["jobs"]["security-refresh"]["steps"][j]
    left = {} if REFRESH_WHOLE else {refresh["name"]: "re-locks every row (about 2.5 min): on request"}
    run_job(workflow, "security-refresh", table, refreshing, runner_env, logs, event="schedule", left=left)
    i = step_index(workflow, "security-refresh", "lock --check-security --record | tee")
    rc = dict(ln.split("=", 1) for ln in (temp / f"security-refresh-{i}.output").read_text().splitlines())["rc"]
    assert rc in ("0", "1") and "### Advisories against the committed locks" in (temp / f"security-refresh-{i}.summary").read_text()
    assert condition(refresh, {**table, "steps.check.outputs.rc": rc}) == (rc == "1")  # it runs exactly with findings
    if not REFRESH_WHOLE:
        return
    log = logs / "branches.log"
    as_runner(["git", "-C", str(remote), "for-each-ref", "--format=%(refname:short)", "refs/heads/"], runner_env, HOME, log, timeout=60)
    branches = log.read_text().split()
    if rc == "0":
        assert branches == [], branches
        return
    said = (logs / f"security-refresh-{j}.log").read_text(errors="replace")
    if "no newer pins to lock yet; nothing pushed" in said:
        assert branches == [], branches
        return
    assert len(branches) == 1 and re.fullmatch(r"security-refresh-\d{8}", branches[0]), branches
    log = logs / "pushed.log"
    as_runner(["git", "-C", str(remote), "log", "-1", "--name-only", "--format=%s", branches[0]], runner_env, HOME, log, timeout=60)
    assert log.read_text().startswith("Security refresh: re-lock and re-render"), log.read_text()[:500]
    changed = [f for f in log.read_text().splitlines()[1:] if f.strip()]
    assert changed and all(f.startswith("images/") or f in ("README.md", "docs/matrix.md") for f in changed), changed


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_PR_BUILD") != "1",
                    reason="the default row's build and the whole suite as the runner user (38 min on 2 cores, cold): "
                           "on request, PYTORCH_CUDA_TEST_PR_BUILD=1, alone")
def test_pr_build_runs_whole_as_the_runner_user(runner, checked, current, classic, tmp_path):
    """pr-build with nothing left out of the job: the default row's build under CI=true, then the
    whole suite but the root tier, as the runner user, on the runner's engine (Docker 26 with the
    classic store here); both engines' stores are left as they were found.
    Run it alone (`build.py selftest -- tests/integration/test_workflow_replay.py -k
    pr_build_runs_whole`): the suite it runs builds, tags and deletes the default row in that
    engine, and would meet another suite's tests there."""
    workspace, runner_env = runner
    logs = tmp_path / "logs"
    logs.mkdir()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    started = time.monotonic()
    with store_restored(classic), store_restored(current):  # the runner's engine; the suite's second one
        run_job(workflow, "pr-build", expressions("pull_request"), workspace, on_engine(runner_env, classic), logs,
                event="pull_request")
    out = (logs / f"pr-build-{step_index(workflow, 'pr-build', 'build.py selftest')}.log").read_text(errors="replace")
    print(f"pr-build, every step, as {USER}: {time.monotonic() - started:.0f} s")
    assert re.search(rf"left out by name \({LEAVE_OUT_ENV}\): \d+ tests marked root", out), out[-3000:]
