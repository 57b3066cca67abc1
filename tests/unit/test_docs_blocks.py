"""Every command block a user would copy from the README, CONTRIBUTING.md, SECURITY.md and docs/*.md has a status, and this file
knows which (docs/measurements/ records commands as they ran on their day, and is not read):

- **run**: a test, or this project's CI entry point, runs the block's commands. RUN below names it
  and a fragment of the command that must stand both in the block and in the runner's source: the
  command itself, or what the runner selects the page's block by. A runner that needs other flags
  on this project's machines (a free port, host networking) says so in `differs`; lines of the
  block it does not run are named in `not_run`, with why. The blocks of OFFLINE run here.
- **form**: every line is a `python3 build.py` command (`eval "$(...)"` of one, variables before
  it), a `python -m pytest` line, or the on-request tiers' `export` loop. tests/unit/test_docs.py
  parses and validates each build.py line, and runs `--dry-run` of each build row it names; here
  the pytest arguments (after `selftest --`) name files, tests and markers that exist, and each
  PYTORCH_CUDA_ variable set is one the code or the tests read. Checked for its form, not run.
- **sketch**: the page says so in the line right before the block, `<!-- sketch: why -->`, where
  it cannot run here (a GPU, a real cluster, a user's registry) or stands for the user's own.

A fenced block is a command block unless its language says it is something else: `text` for
output and usage lines, or a file's language (`yaml`, `json`, `python`, `dockerfile`, `ini`); such
a block must not start like a command. A command block with no status fails here, and so does an
entry of RUN or OFFLINE that no block matches."""
from __future__ import annotations

import ast
import functools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT, code_blocks, run_cli

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGS = {"", "bash", "sh", "shell", "console"}
OTHER_LANGS = {"text", "yaml", "json", "python", "dockerfile", "ini"}
SKETCH = re.compile(r"<!-- sketch: (\S(?:(?!-->).)*\S) -->$")
# How a command line starts: what a block of another language must not start with.
COMMAND_START = re.compile(r"^(?:\$ |(?:[A-Z_][A-Z0-9_]*=\S* )*(?:python3?|\.venv/bin/python|docker|podman|sudo|kubectl|pip|uv|"
                           r"eval|srun|sbatch|bash|git|skopeo|oras|jq|torchrun|deepspeed|mkdir|cd|install|export|nvidia-ctk|"
                           r"ssh|rm|ip|for|if)(?:\s|$))")


@dataclass(frozen=True)
class Run:
    """Who runs a block: `path` or `path::NAME` (a test, a helper or fixture its tests call, or a
    module constant they run), and the fragments of the block's command its source holds."""
    runner: str
    says: tuple[str, ...]
    differs: str = ""  # what the runner changes, and why
    not_run: tuple[str, ...] = ()  # how the block's lines it leaves out start; why is in `differs`


# (page, how the block's first line starts) -> who runs it
RUN: dict[tuple[str, str], tuple[Run, ...]] = {
    ("README.md", "python3 build.py --torch 2.7 --cuda 12.1"): (
        Run("tests/conftest.py::default_build", ("--torch 2.7 --cuda 12.1",),
            differs="--quiet --retest: the suite's log and this session's own gate"),),
    ("README.md", "python3 build.py selftest\n"): (Run(".ci/run", ("python3 build.py selftest",)),),
    ("docs/index.md", "python3 build.py --torch 2.7 --cuda 12.1"): (
        Run("tests/conftest.py::default_build", ("--torch 2.7 --cuda 12.1",), differs="--quiet --retest, as the README's"),
        Run(".ci/run", ("python3 build.py selftest",))),
    ("docs/testing.md", "python3 build.py selftest\n"): (Run(".ci/run", ("python3 build.py selftest",)),),
    ("docs/matrix.md", "python3 build.py --torch 2.7 --cuda 12.6 --dry-run"): (
        Run("tests/unit/test_docs.py::test_every_documented_build_plans_offline", ("--dry-run",),
            differs="every documented build row's plan, offline"),),
    ("docs/arm64.md", "python3 build.py --torch 2.11 --cuda 13.0 --platform linux/arm64"): (
        Run("tests/integration/test_arm64.py::test_the_arm64_image_builds_tests_and_tags_under_emulation_and_runs_aarch64_torch",
            ("--torch 2.11 --cuda 13.0 --platform linux/arm64", "run --rm --platform linux/arm64",
             "import platform, torch; print(platform.machine(), torch.version.cuda)"),
            differs="on request (PYTORCH_CUDA_TEST_ARM64); the --platform all line is not run, the --dry-run line "
                    "runs in tests/unit/test_docs.py",
            not_run=("python3 build.py --torch 2.11 --cuda 13.0 --platform all", "python3 build.py --torch 2.11 --platform")),),
    ("docs/clusters.md", "$ SLURM_JOB_ID=4242"): (
        Run("tests/unit/test_docs_journeys.py::print_transcript", ("launch --print",)),),
    ("docs/clusters.md", "if ! srun"): (Run("tests/unit/test_docs_blocks.py::test_the_preflight_step_shown_is_the_one_job_writes",
                                            ("if ! srun",)),),
    ("docs/example.md", "docker run --rm --shm-size 1g"): (
        Run("tests/integration/test_worked_example.py::SCRIPT",
            ("torchrun --nproc-per-node 2 train.py --deepspeed_config ds_config.json",),
            differs="the options run in test_worked_example's test (tests/unit/test_docs_example.py holds them to the page's)"),),
    ("docs/extending.md", "$ pip install torchvision==0.23.0"): (
        Run("tests/integration/test_extend.py::MOVE_TORCH", ("pip install torchvision==0.23.0",)),),
    ("docs/extending.md", "docker build --secret"): (
        Run("tests/integration/test_extend.py::build_derived", ("docker", "build", "--secret id=ca,src=", "-t"),
            differs="the suite's CA bundle, --build-arg BASE= the tested image, --network host, a tag of the test's own"),),
    ("docs/image-reference.md", "docker inspect --format"): (
        Run("tests/integration/test_workflow_replay.py::_build_job", ("inspect --format {{json .Config.Labels}}",),
            differs="on the replayed build job's image (on request, PYTORCH_CUDA_TEST_BUILD_JOB)"),),
    ("docs/kubernetes.md", "mkdir -p my-train"): (
        Run("tests/integration/test_kubernetes_replay.py::derived_journey", ("docker push",),
            differs="the suite's registry for 127.0.0.1:5000; no Kubernetes cluster: the pods are replayed as containers",
            not_run=("kubectl apply",)),),
    ("docs/ops.md", "docker run --rm -e DS_ACCELERATOR=cuda"): (
        Run("tests/integration/test_gpu_ready.py::prebuilt_ops_load", ("ds_report", "-e DS_ACCELERATOR=cuda")),),
    ("docs/reproducibility.md", "git checkout REVISION"): (
        Run("tests/integration/test_verify_image.py::test_the_default_row_published_then_rebuilt_from_this_checkout_is_the_same_image",
            ("verify --image",),
            differs="on request (PYTORCH_CUDA_TEST_VERIFY_IMAGE), in this checkout at the commit it published from, with the "
                    "engine the suite runs",
            not_run=("git checkout", "eval")),),
    ("docs/slurm.md", "sudo install -D"): (Run("tests/integration/test_slurm.py::journey", ("sudo install ",),
                                               differs="as root, without sudo; sbatch with the test cluster's partition and account"),),
    ("docs/slurm.md", "install -D"): (
        Run("tests/unit/test_docs_jobs.py::test_the_install_line_installs_the_hook_oci_conf_names_executable_from_git",
            ("install -D -m 0755 pytorch_cuda_build/jobs/ocigpus.py",),
            differs="held to the journey's line, which tests/integration/test_slurm.py runs"),),
    ("docs/slurm.md", "#!/bin/bash"): (Run("tests/unit/test_docs_jobs.py::test_the_whole_generated_script_shown_is_todays",
                                           ("GENERATED",)),
                                       Run("tests/integration/test_slurm.py::documented_script", ("# GENERATED by",))),
    ("docs/slurm.md", "IMAGE='127.0.0.1:5000#"): (
        Run("tests/unit/test_docs_jobs.py::test_each_runtime_s_run_lines_stand_in_its_rendered_script", ("IMAGE=",)),),
    ("docs/slurm.md", 'IMAGE="docker://'): (
        Run("tests/unit/test_docs_jobs.py::test_each_runtime_s_run_lines_stand_in_its_rendered_script", ("IMAGE=",)),),
    ("docs/slurm.md", "python3 build.py job --torch 2.7 --cuda 12.1 --scheduler slurm --runtime pyxis"): (
        Run("tests/unit/test_docs_jobs.py::pyxis_line", ("--runtime pyxis",)),),
    ("docs/using.md", "docker run -d -p 127.0.0.1:6006:6006"): (
        Run("tests/integration/test_ways_in.py::test_tensorboard_serves_what_torch_wrote",
            ("tensorboard --logdir /workspace/runs --bind_all",),
            differs="host networking and a free port of 127.0.0.1 (--port) instead of -p 127.0.0.1:6006:6006"),),
}

# Blocks whose build.py lines run here, offline, as written: each line but those starting with the
# prefixes given, which need what a unit test has not (the package index, a cluster).
OFFLINE: dict[tuple[str, str], tuple[str, ...]] = {
    ("CONTRIBUTING.md", "python3 build.py lock --check"): (),
    ("docs/cli.md", "python3 build.py list"): (),
    ("docs/installing.md", "python3 build.py list"): (),
    ("docs/cli.md", "python3 build.py matrix --json"): ("python3 build.py matrix --propose",),
    ("docs/cli.md", "python3 build.py job"): (),
    ("docs/clusters.md", "python3 build.py job"): (),
    ("docs/kubernetes.md", "python3 build.py job --torch 2.7 --cuda 12.1 --scheduler kubernetes --kind indexed-job"): (
        "kubectl apply",),
    ("docs/kubernetes.md", "python3 build.py job --torch 2.7 --scheduler kubernetes --kind jobset"): (),
}
THIS = "tests/unit/test_docs_blocks.py::test_the_offline_blocks_run_as_written"


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    body: str
    before: str  # the last line before the fence that is not blank, stripped

    @property
    def first(self) -> str:
        return self.body.splitlines()[0] if self.body.strip() else ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    lines = text.splitlines()
    rel = str(path.relative_to(ROOT))
    return [Block(rel, n, lang, body, next((ln.strip() for ln in reversed(lines[:n - 1]) if ln.strip()), ""))
            for lang, body, n in code_blocks(text)]


@functools.cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(b for page in PAGES for b in page_blocks(page))


def command_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in COMMAND_LANGS]


def keyed(table: dict, block: Block):
    """The entry of table whose (page, start) is the block's, or None."""
    return next((v for (page, start), v in table.items() if page == block.page and starts(block, start)), None)


def starts(block: Block, start: str) -> bool:
    """The block's first line starts with start; a start that ends in a newline is the whole line."""
    return f"{block.first}\n".startswith(start)


def commands(body: str) -> list[str]:
    """The block's command lines: continuations joined, comment lines and blanks left out."""
    joined = body.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def flat(text: str) -> str:
    """A command as words: continuations joined, quotes dropped, one space between words."""
    return " ".join(text.replace("\\\n", " ").replace('"', "").replace("'", "").split())


def flat_source(text: str) -> str:
    """A runner's source with argv lists read as words: `"--torch", "2.7"` is `--torch 2.7`."""
    return " ".join(re.sub(r"""["'],\s*[fbr]?["']""", " ", text).split())


# --- the runners --------------------------------------------------------------------------------

def runner_source(runner: str) -> str:
    """The source of `path::NAME` (a function or a module-level assignment, found at any depth), or of the whole file."""
    path, _, name = runner.partition("::")
    text = (ROOT / path).read_text()
    if not name:
        return text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_source_segment(text, node) or ""
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{path} has no function or constant {name}")


def used(runner: str) -> bool:
    """A named helper or constant is called or read elsewhere in its file; a test (test_*) runs itself."""
    path, _, name = runner.partition("::")
    if not name or name.startswith("test_"):
        return True
    return len(re.findall(rf"\b{re.escape(name)}\b", (ROOT / path).read_text())) > 1


def run_problems(block: Block, runs: tuple[Run, ...]) -> list[str]:
    problems = []
    for run in runs:
        path = run.runner.partition("::")[0]
        if not (ROOT / path).is_file():
            problems.append(f"{run.runner}: no such file")
            continue
        try:
            source = runner_source(run.runner)
        except AssertionError as e:
            problems.append(str(e))
            continue
        if not used(run.runner):
            problems.append(f"{run.runner} is not called anywhere in {path}")
        for says in run.says:
            if flat(says) not in flat(block.body):
                problems.append(f"{says!r} is not in the block")
            if flat(says) not in flat_source(source) and says not in source:
                problems.append(f"{run.runner} does not hold {says!r}")
        lines = commands(block.body)
        for start in run.not_run:
            if not any(ln.startswith(start) for ln in lines):
                problems.append(f"not_run {start!r} starts no line of the block")
    return problems


# --- form: build.py lines, pytest lines, the on-request loop ---------------------------------------

ENV = re.compile(r"([A-Z_][A-Z0-9_]*)=(\S*) ")
BUILD_LINE = re.compile(r'^(?:eval "\$\()?((?:[A-Z_][A-Z0-9_]*=\S* )*)python3 build\.py(?: (.*?))?(?:\)")?$')
PYTEST_LINE = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S* )*)\.venv/bin/python -m pytest (.*)$")
EXPORT_LOOP = re.compile(r"^for v in ([A-Z0-9_ ]+); do export (PYTORCH_CUDA_TEST_)\$v=1; done$")


@functools.cache
def read_names() -> str:
    """Everything the tests and the two packages say: where a variable the docs set must be read."""
    return "\n".join(p.read_text() for top in ("tests", "pytorch_cuda_build", "pytorch_cuda_runtime")
                     for p in sorted((ROOT / top).rglob("*.py")) if p != Path(__file__))


@functools.cache
def pytest_names() -> dict[str, set[str]]:
    """test file (relative) -> the names pytest's -k matches in it: the file's stem, its classes and tests."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names = {path.stem}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) or (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                  and node.name.startswith("test")):
                names.add(node.name)
        found[str(path.relative_to(ROOT))] = names
    return found


def registered_markers() -> set[str]:
    import tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":", 1)[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def expression_words(expr: str) -> list[str]:
    return [w for w in re.findall(r"[\w.\[\]-]+", expr) if w not in ("and", "or", "not")]


def pytest_problems(args: list[str]) -> list[str]:
    """What in pytest's arguments names nothing here: a file, a test, a -k word or a -m marker."""
    problems, files, n = [], [], 0
    while n < len(args):
        arg = args[n]
        if arg in ("-k", "-m") and n + 1 < len(args):
            words = expression_words(args[n + 1])
            if arg == "-m":
                problems += [f"-m {w}: no such marker in pyproject.toml" for w in words if w not in registered_markers()]
            else:
                scope = files or list(pytest_names())
                problems += [f"-k {w}: no test name here holds it" for w in words
                             if not any(w.lower() in name.lower() for f in scope for name in pytest_names().get(f, ()))]
            n += 2
            continue
        if arg.startswith("tests"):
            path, _, name = arg.partition("::")
            if not (ROOT / path).exists():
                problems.append(f"{path}: no such file")
            elif name and name not in pytest_names().get(path, set()):
                problems.append(f"{arg}: no such test")
            else:
                files += [f for f in pytest_names() if f == path or f.startswith(path.rstrip("/") + "/")]
        n += 1
    return problems


def env_problems(assignments: str) -> list[str]:
    return [f"{name}: read nowhere in tests/ or the packages" for name, _ in ENV.findall(assignments)
            if name.startswith("PYTORCH_CUDA_") and name not in read_names()]


def form_problems(line: str) -> list[str] | None:
    """None: the line is of no form this file checks; else what is wrong with it (nothing: [])."""
    line = re.sub(r"\s+#.*$", "", line)  # a comment after the command
    if m := BUILD_LINE.match(line):
        words = shlex.split(m.group(2) or "")
        problems = env_problems(m.group(1))
        if words[:1] == ["selftest"] and "--" in words:
            problems += pytest_problems(words[words.index("--") + 1:])
        return problems
    if m := PYTEST_LINE.match(line):
        return env_problems(m.group(1)) + pytest_problems(shlex.split(m.group(2)))
    if m := EXPORT_LOOP.match(line):
        return env_problems("".join(f"{m.group(2)}{v}=1 " for v in m.group(1).split()))
    return None


# --- the status of a block ---------------------------------------------------------------------------

def status(block: Block) -> str:
    """run, form or sketch: why; '' for a block with none."""
    runs = keyed(RUN, block)
    if runs is not None or keyed(OFFLINE, block) is not None:
        names = [r.runner for r in runs or ()] + ([THIS] if keyed(OFFLINE, block) is not None else [])
        return f"run: {', '.join(names)}"
    if m := SKETCH.search(block.before):
        return f"sketch: {m.group(1)}"
    lines = commands(block.body)
    if lines and all(form_problems(ln) is not None for ln in lines):
        return "form"
    return ""


def test_every_command_block_has_a_status():
    blocks = command_blocks()
    assert len(blocks) > 100
    bare = [f"{b}: {b.first[:80]}" for b in blocks if not status(b)]
    assert not bare, ("command blocks that no test runs, that are no build.py command and that the page does not call a sketch "
                      "(add it to RUN or OFFLINE in this file, or put `<!-- sketch: why -->` on the line before it):\n"
                      + "\n".join(bare))


def test_a_block_run_by_a_test_is_no_sketch():
    both = [str(b) for b in command_blocks() if status(b).startswith("run") and SKETCH.search(b.before)]
    assert not both, f"these blocks run in a test and the page calls them a sketch: {both}"


@pytest.mark.parametrize("table", [RUN, OFFLINE], ids=["RUN", "OFFLINE"])
def test_every_entry_matches_one_command_block(table):
    for page, start in table:
        matches = [b for b in command_blocks() if b.page == page and starts(b, start)]
        assert len(matches) == 1, f"{page}: {len(matches)} command blocks start {start!r}: {[str(b) for b in matches]}"


def test_each_runner_exists_and_holds_the_block_s_command():
    problems = []
    for block in command_blocks():
        runs = keyed(RUN, block)
        if runs:
            problems += [f"{block}: {p}" for p in run_problems(block, runs)]
    assert not problems, "\n".join(problems)


def test_the_form_blocks_name_what_exists():
    problems = []
    for block in command_blocks():
        for line in commands(block.body):
            problems += [f"{block}: {line[:60]}: {p}" for p in form_problems(line) or ()]
    assert not problems, "\n".join(problems)


def test_a_block_of_another_language_does_not_start_like_a_command():
    bad = [f"{b} ({b.lang or 'none'}): {b.first[:60]}" for b in all_blocks() if b.lang not in COMMAND_LANGS
           and (b.lang not in OTHER_LANGS or COMMAND_START.match(b.first))]
    assert not bad, ("blocks whose language is unknown here, or that start like a command and are not tagged as one "
                     f"(commands are untagged or bash): {bad}")


# --- the checks find what they should ---------------------------------------------------------------

@pytest.mark.parametrize("line, problem", [
    ("PYTORCH_CUDA_TEST_NOSUCH=1 python3 build.py selftest -- -k cuda13", "PYTORCH_CUDA_TEST_NOSUCH"),
    ("python3 build.py selftest -- -k no_such_test_name", "-k no_such_test_name"),
    ("python3 build.py selftest -- -m 'not network and not gpuless'", "-m gpuless"),
    ("python3 build.py selftest -- tests/integration/test_gone.py", "tests/integration/test_gone.py"),
    (".venv/bin/python -m pytest tests/unit/test_docs.py::test_gone", "::test_gone"),
    ("for v in CUDA13 NOSUCH; do export PYTORCH_CUDA_TEST_$v=1; done", "PYTORCH_CUDA_TEST_NOSUCH"),
])
def test_the_form_check_finds_a_name_that_is_gone(line, problem):
    found = form_problems(line)
    assert found and problem in " ".join(found), found


@pytest.mark.parametrize("body, before, expected", [
    ("python3 build.py lock\n", "", "form"),
    ('eval "$(python3 build.py engine)"\n', "", "form"),
    ("python3 build.py lock\ndocker image ls\n", "", ""),  # a line of no form: the block needs a runner or a sketch
    ("docker run --gpus all img\n", "<!-- sketch: a GPU -->", "sketch: a GPU"),
    ("docker run --gpus all img\n", "<!-- sketch: -->", ""),  # a sketch says why
])
def test_the_status_of_a_block(body, before, expected):
    assert status(Block("docs/nowhere.md", 1, "", body, before)) == expected


def test_the_runner_check_finds_a_command_the_runner_does_not_hold():
    block = Block("docs/x.md", 1, "", "docker run --rm img ds_report\n", "")
    assert run_problems(block, (Run("tests/integration/test_gpu_ready.py::prebuilt_ops_load", ("ds_report --all",)),))
    assert run_problems(block, (Run("tests/integration/test_gpu_ready.py::no_such_helper", ("ds_report",)),))
    assert not run_problems(block, (Run("tests/integration/test_gpu_ready.py::prebuilt_ops_load", ("ds_report",)),))


# --- the offline blocks, run ------------------------------------------------------------------------

OFFLINE_ENV = {"DOCKER_HOST": "unix:///nonexistent/docker.sock", "HTTP_PROXY": "http://127.0.0.1:9",
               "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
DEFAULT_ROW = "2.7.1-cuda12.1-runtime"
PUBLISHED = {"registry": "127.0.0.1:5000/ml", "repository": "127.0.0.1:5000/ml/pytorch-cuda", "digest": "sha256:" + "ab" * 32}


@pytest.fixture
def published_checkout(tmp_path) -> Path:
    """The checkout, linked file by file, with the default row's published record: what a user has
    after `publish --push`, which the job lines without --image read."""
    root = tmp_path / "checkout"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != "build-results":
            (root / entry.name).symlink_to(entry)
    (root / "build-results" / DEFAULT_ROW).mkdir(parents=True)
    (root / "build-results" / DEFAULT_ROW / "published.json").write_text(json.dumps(PUBLISHED))
    return root


def test_the_offline_blocks_run_as_written(published_checkout, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # where --output writes
    ran = 0
    for (page, start), left_out in OFFLINE.items():
        (block,) = [b for b in command_blocks() if b.page == page and starts(b, start)]
        for line in commands(block.body):
            if left_out and line.startswith(left_out):
                continue
            argv = shlex.split(line, comments=True)
            assert argv[:2] == ["python3", "build.py"], f"{block}: {line}"
            proc = run_cli(published_checkout, *argv[2:], env=OFFLINE_ENV)
            assert proc.returncode == 0, f"{block}: {line}\n{proc.stderr}"
            ran += 1
    assert ran >= 10


def test_the_preflight_step_shown_is_the_one_job_writes():
    """clusters.md's excerpt of the sbatch script with --preflight, for the line the page names."""
    (block,) = [b for b in all_blocks() if b.page == "docs/clusters.md" and b.first.startswith("if ! srun")]
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--cuda", "12.1", "--scheduler", "slurm", "--runtime", "oci", "--nodes", "2",
                   "--gpus-per-node", "2", "--preflight", "--image", PUBLISHED["repository"] + "@" + PUBLISHED["digest"],
                   "--", "train.py", env=OFFLINE_ENV)
    assert proc.returncode == 0, proc.stderr
    assert block.body in proc.stdout
