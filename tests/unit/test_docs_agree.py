"""Pages that say what the code decides say what the code says, read from the code's one place:

- the exit-code table (docs/faults.md) has every code the error tree (pytorch_cuda_build.errors and
  every subclass in the package) and the CLI's signal handling give, and no other;
- the marker table (docs/testing.md) and CONTRIBUTING.md name the markers pyproject.toml registers;
- every flavor a page names (`--flavor X`, `flavors: [...]`) is one of matrix.FLAVORS;
- the image reference's labels section names every label render and build put on an image;
- a default the command reference states for an option is the parser's default, and `job --bundle`'s
  the path the script it writes uses;
- cleanup.md names every place the tool keeps things (paths.py's state and store, the second
  engine's folders), and no page gives the build cache a mount the templates lack;
- faults.md's fault-injection list names every stage the tier kills, and testing.md's line that
  runs every on-request tier at once selects each tier's tests.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import tomllib

import pytest

import pytorch_cuda_build
from pytorch_cuda_build import cli, matrix
from pytorch_cuda_build.errors import PipelineError
from pytorch_cuda_build.stages import render

from helpers import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", *sorted(DOCS.rglob("*.md"))]
# The CLI's own codes beside the error tree's (cli.py): 130 on SIGINT or SIGTERM, 141 on a closed pipe.
SIGNAL_CODES = {130, 141}


def error_classes() -> set[type]:
    for module in pkgutil.walk_packages(pytorch_cuda_build.__path__, "pytorch_cuda_build."):
        if ".checks" not in module.name:  # the image's test files, run by pytest inside a gate
            importlib.import_module(module.name)
    found, todo = set(), [PipelineError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return found


def test_the_exit_code_table_is_the_error_trees():
    codes = {cls.exit_code for cls in error_classes()} | SIGNAL_CODES | {0}
    section = (DOCS / "faults.md").read_text().split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    table = {int(c) for c in re.findall(r"^\| (\d+) \|", section, re.M)}
    assert table == codes, f"docs/faults.md's exit codes {sorted(table)}; the code gives {sorted(codes)}"


def registered_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":", 1)[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def test_the_marker_table_names_the_registered_markers():
    section = (DOCS / "testing.md").read_text().split("## Tiers and markers", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `(\w+)` \| marker", section, re.M))
    assert table == registered_markers()


def test_contributing_names_only_registered_markers():
    section = (ROOT / "CONTRIBUTING.md").read_text().split("## The test tiers", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\*\*(\w+)\*\*", section)) - {"unit"}  # unit is a folder, not a marker
    assert named and named <= registered_markers(), named - registered_markers()


def named_flavors(text: str) -> set[str]:
    found = set(re.findall(r"--flavor[ =](\w+)", text))
    for listed in re.findall(r"flavors: \[([^\]]*)\]", text):
        found |= {w.strip() for w in listed.split(",") if w.strip() not in ("", "...")}
    return found


def test_every_flavor_a_page_names_is_the_matrixs():
    # cli.md names `--flavor slim` on purpose, as a refused value.
    bad = {f"{p.relative_to(ROOT)}: {f}" for p in PAGES for f in named_flavors(p.read_text().replace("--flavor slim", ""))
           if f not in matrix.FLAVORS}
    assert not bad, sorted(bad)


def test_the_flavor_check_sees_a_flavor_the_matrix_lacks():
    assert named_flavors("python3 build.py --torch 2.7 --flavor slim; flavors: [runtime, gpu]") == {"slim", "runtime", "gpu"}


def test_the_labels_section_names_every_label():
    m = matrix.load(ROOT / "matrix.yaml")
    keys = {k for image in m.images for k, _ in render.labels(image, {"files_sha256": "x", "cuda_toolkit": "13.0.88"})}
    keys |= {"org.opencontainers.image.revision", "org.opencontainers.image.created"}  # stages/build.py, at build time
    build_py = (ROOT / "pytorch_cuda_build" / "stages" / "build.py").read_text()
    assert all(f"--label\", f\"{k}=" in build_py for k in ("org.opencontainers.image.revision", "org.opencontainers.image.created"))
    section = (DOCS / "image-reference.md").read_text().split("## Labels", 1)[1].split("\n## ", 1)[0]
    words = " ".join(section.split())
    missing = [k for k in sorted(keys) if f"`{k.removeprefix('org.opencontainers.image.').removeprefix('io.pytorch-cuda.')}`"
               not in words and f"`{k}`" not in words]
    assert not missing, f"docs/image-reference.md's labels section does not name: {missing}"


def option_rows() -> list[tuple[str, str, str]]:
    """(command, option, its row) for each option row of the command reference."""
    text = (DOCS / "cli.md").read_text()
    parts = re.split(r"^## `([\w-]+)`\s*$", text, flags=re.M)
    rows = []
    for command, body in zip(parts[1::2], parts[2::2]):
        for row in re.findall(r"^\| (`--.*)$", body, re.M):
            for option in re.findall(r"`(--[\w-]+)", row.split(" | ", 1)[0]):
                rows.append((command, option, row))
    return rows


def parser_defaults() -> dict[tuple[str, str], object]:
    p = cli.parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    out = {}
    for command, parser in sub.items():
        for action in parser._actions:
            for option in action.option_strings:
                out[(command, option)] = action.default
    return out


STATED = re.compile(r"\(?default:? `?([^`),;]+)`?")


@pytest.mark.parametrize("command, option, row", option_rows(), ids=[f"{c} {o}" for c, o, _ in option_rows()])
def test_a_stated_default_is_the_parsers(command, option, row):
    default = parser_defaults().get((command, option))
    if default in (None, False, True, argparse.SUPPRESS) or isinstance(default, list) or "default" not in row:
        return
    assert str(default) in row, f"docs/cli.md gives {option} of `{command}` another default than the parser's {default!r}: {row}"


def test_every_option_the_command_reference_lists_is_the_parsers():
    known = parser_defaults()
    gone = [f"{o} ({c})" for c, o, _ in option_rows() if (c, o) not in known]
    assert not gone, f"docs/cli.md lists options its command does not take: {', '.join(gone)}"


def rendered_env_and_ports() -> tuple[set[str], set[str]]:
    """The variables the committed Dockerfiles set (`ENV`) and the ports they declare (`EXPOSE`)."""
    names, ports = set(), set()
    for dockerfile in (ROOT / "images").rglob("Dockerfile"):
        for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
            words = line.strip()
            if words.startswith("ENV "):
                names |= set(re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=", words[4:]))
            elif words.startswith("EXPOSE "):
                ports |= set(words.split()[1:])
    return names, ports


def test_the_image_reference_names_every_variable_and_port_the_images_set():
    names, ports = rendered_env_and_ports()
    assert "PYTORCH_CUDA_CPU_OPS" in names and "2222" in ports
    text = (DOCS / "image-reference.md").read_text()
    env = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    table = text.split("## Ports", 1)[1].split("\n## ", 1)[0]
    assert not [n for n in sorted(names) if f"`{n}`" not in env], "image-reference.md's environment section lacks some"
    assert set(re.findall(r"^\| (\d+) \|", table, re.M)) == ports


# --- where the tool keeps things, and what the build cache holds ----------------------------------
# Found stale once: cleanup.md, the command reference's prune and ops.md named a wheelhouse and the
# toolkit's .debs among the build cache's mounts, which the templates no longer have (every file a
# build reads comes from the host's store), and cleanup.md did not name the store at all.

def test_cleanup_names_every_place_the_tool_keeps_things():
    """Each variable the tool reads for where it keeps state, the store or the second engine is on cleanup.md."""
    code = "".join((ROOT / "pytorch_cuda_build" / p).read_text() for p in ("paths.py", "tooling/engine_current.py"))
    variables = set(re.findall(r'os\.environ\.get\("(PYTORCH_CUDA_\w+)"', code))
    assert {"PYTORCH_CUDA_STATE", "PYTORCH_CUDA_STORE", "PYTORCH_CUDA_ENGINE_HOME"} <= variables
    page = (DOCS / "cleanup.md").read_text()
    assert not [v for v in sorted(variables) if f"`{v}`" not in page and f"`${v}`" not in page], "cleanup.md lacks some"


def cache_mounts() -> list[str]:
    """The ids and targets of the templates' BuildKit cache mounts."""
    found = []
    for template in sorted((ROOT / "templates").glob("*.j2")):
        found += [" ".join(m) for m in re.findall(r"--mount=type=cache,id=([^,]+),target=([^,\s]+)", template.read_text())]
    return found


# What a page may say the build cache's mounts hold, and what a template's cache mount must then hold.
CACHED = {"a wheelhouse": ("wheelhouse", "wheel"), "the toolkit's .debs": (r"toolkit(?:'s)? \.debs", "debs")}


def cached_names(text: str, mounts: list[str]) -> list[str]:
    text = " ".join(text.split())
    return [what for what, (name, key) in CACHED.items()
            if re.search(rf"(?:cache mounts?|build cache's mounts)\b[^.]*?\b{name}\b|\b{name} cache\b", text, re.I)
            and not any(key in m for m in mounts)]


def test_no_page_names_a_cache_mount_the_templates_lack():
    mounts = cache_mounts()
    assert any("opscache" in m for m in mounts)
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in PAGES if "measurements" not in p.parts for n in cached_names(p.read_text(), mounts)]
    assert not bad, f"pages name a build cache the templates have no cache mount for: {bad}"


def test_the_cache_check_finds_a_wheelhouse():
    assert cached_names("The cache mounts (the wheelhouse, the toolkit .debs) are kept.", ["x /opscache"]) == list(CACHED)


# --- a default computed by the code --------------------------------------------------------------

def test_the_bundle_default_the_reference_states_is_the_scripts():
    """--bundle's default is the generated script's BUNDLE= path, with its shell read as the page writes it."""
    from helpers import run_cli
    row = (DOCS / "cli.md").read_text().split("| `--bundle DIR` |", 1)[1].split("\n", 1)[0]
    stated = re.search(r"\(default `([^`]+)`", row).group(1)
    digest = "sha256:" + "0123456789abcdef" * 4
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--cuda", "12.1", "--scheduler", "slurm", "--nodes", "2", "--runtime", "oci",
                   "--image", f"127.0.0.1:5000/ml/pytorch-cuda@{digest}", "--", "train.py")
    assert proc.returncode == 0, proc.stderr
    bundle = re.search(r'^BUNDLE="([^"]+)"$', proc.stdout, re.M).group(1)
    written = (bundle.replace("${SLURM_SUBMIT_DIR:-$PWD}", "$SLURM_SUBMIT_DIR").replace("$(id -un)", "USER")
               .replace("2.7.1-cuda12.1-runtime", "<image>").replace(digest[7:19], "<12 hex of the digest>"))
    assert written == stated, f"docs/cli.md says --bundle defaults to {stated}; the script uses {bundle}"


# --- the fault tier and the on-request tiers -----------------------------------------------------

def kill_stages() -> list[str]:
    """The stages tests/integration/test_fault_injection.py kills a run in (its KILLS table's keys)."""
    import ast
    tree = ast.parse((ROOT / "tests" / "integration" / "test_fault_injection.py").read_text())
    (table,) = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "KILLS" for t in n.targets)]
    assert isinstance(table, ast.Dict)
    return [k.value for k in table.keys if isinstance(k, ast.Constant)]


def test_the_fault_page_names_every_stage_the_fault_tier_kills():
    text = (DOCS / "faults.md").read_text()
    bullet = " ".join(text.split("- SIGKILL of the run's process group at each stage:", 1)[1].split("\n- ", 1)[0].split())
    stages = kill_stages()
    assert "fetch" in stages and "publish" in stages
    missing = [s for s in stages if not re.search(rf"\b{re.escape(s)}\b", bullet)]
    assert not missing, f"docs/faults.md's fault-injection list lacks the stages {missing} that the tier kills"


def selects(expression: str, names: set[str]) -> bool:
    """pytest's -k: each word a case-insensitive substring of one of the item's names."""
    words = re.sub(r"[\w.\[\]-]+", lambda m: m.group(0) if m.group(0) in ("and", "or", "not") else
                   str(any(m.group(0).lower() in n.lower() for n in names)), expression)
    return bool(eval(words, {"__builtins__": {}}))  # noqa: S307 (True, False, and, or, not, parentheses only)


def test_the_all_at_once_line_runs_every_tier_the_schedule_runs():
    """testing.md's line that sets every on-request variable but PR_BUILD's selects every test the weekly
    schedule runs for those variables (.github/workflows/images.yml, its on-request job)."""
    import ast

    import yaml
    from test_workflow import on_request_variables

    from helpers import code_blocks
    (block,) = [b for _, b, _ in code_blocks((DOCS / "testing.md").read_text()) if b.startswith("for v in ")]
    loop, line = block.splitlines()[:2]
    assert {f"PYTORCH_CUDA_TEST_{v}" for v in loop.split(" in ", 1)[1].split(";")[0].split()} == \
        on_request_variables() - {"PYTORCH_CUDA_TEST_PR_BUILD"}
    expression = re.search(r'-k "([^"]+)"', line).group(1)
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())
    missed = []
    for tier in workflow["jobs"]["on-request"]["strategy"]["matrix"]["include"]:
        path, _, name = tier["tests"].partition("::")
        tests = [name] if name else [n.name for n in ast.walk(ast.parse((ROOT / path).read_text()))
                                     if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        if not all(selects(expression, {path.rsplit("/", 1)[1], test}) for test in tests):
            missed.append(tier["variable"])
    assert not missed, f"docs/testing.md's all-at-once -k does not select the tests of {missed}"


def test_the_k_reading_is_pytests():
    assert selects("cuda13 or test_hermetic", {"test_hermetic.py", "test_the_day_moved"})
    assert not selects("cuda13 or test_fault_injection", {"test_hermetic.py", "test_the_day_moved"})
    assert not selects("build_job and not verify", {"test_workflow_replay.py", "test_build_job_verify"})
