"""The docs stay true: the site builds with --strict (a broken link or anchor fails), every
`python3 build.py ...` line of the README and docs/ is one the CLI takes (and a build line's plan
comes out of --dry-run, offline), every command and option of --help is in the command reference,
the module map names every module, and the matrix table has one source, `render`."""
from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytorch_cuda_build import cli, files, matrix, spec, validate
from pytorch_cuda_build.errors import RenderError, UsageError
from pytorch_cuda_build.registry import sign
from pytorch_cuda_build.stages import render

from helpers import ROOT, run_cli

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"
# Pages outside docs/ that a user reads beside the README: their links and commands are checked as its are.
ROOT_PAGES = [README, ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md"]
# `python3 build.py ARGS`, up to what ends a command in prose: the end of inline code or of the
# line, a table cell, the `)` of "$(...)", or a shell comment.
COMMAND = re.compile(r"\bpython3? build\.py((?:[ \t][^`\n|)#]*)?)")
# Offline, and no daemon: a plan must come from the committed files alone.
OFFLINE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock", "HTTP_PROXY": "http://127.0.0.1:9",
           "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0 is no warning of ours
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    proc = mkdocs_build(ROOT / "mkdocs.yml", site)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARNING" not in out, out
    return site


def test_the_site_builds_strict_with_no_warning(site):
    assert (site / "index.html").is_file()
    assert (site / "bench" / "report" / "index.html").is_file()  # the benchmark's report, published from bench/


@pytest.mark.parametrize("broken", ["[gone](no-such-page.md)", "[gone](using.md#no-such-heading)"], ids=["link", "anchor"])
def test_a_broken_link_or_anchor_fails_the_build(tmp_path, broken):
    for name in ("docs", "bench"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    page = tmp_path / "docs" / "limits.md"
    page.write_text(page.read_text() + f"\n{broken}\n")
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "limits.md" in proc.stderr


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", ROOT_PAGES, ids=lambda p: p.name)
def test_the_root_pages_links_reach_pages_and_anchors(site, page):
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, f"{page.name} links into the docs"
    for link in local:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), link
        if path.startswith("docs/") and anchor:
            html = site / Path(path).relative_to("docs").with_suffix("") / "index.html"
            if html.parent.name == "index":
                html = html.parent.parent / "index.html"
            assert f'id="{anchor}"' in html.read_text(), link
        elif path.endswith(".md") and anchor:  # a page outside docs/: its headings, as GitHub makes their anchors
            assert anchor in [slug(h) for h in re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)], link


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in [*ROOT_PAGES, *PAGES]:
        for m in COMMAND.finditer(path.read_text()):
            found.append((f"{path.relative_to(ROOT)}: python3 build.py{m.group(1)}", shlex.split(m.group(1))))
    return found


COMMANDS = documented_commands()


def with_command(argv: list[str]) -> list[str]:
    """argv as cli.main reads it: a first word that is no command means `build`."""
    skip = 2 if argv[:1] == ["--matrix"] else 1 if argv[:1] and argv[0].startswith("--matrix=") else 0
    first = next((a for a in argv[skip:] if not a.startswith("-")), None)
    if first not in cli.NAMES and not {"-h", "--help"} & set(argv):
        return argv[:skip] + ["build"] + argv[skip:]
    return argv


def test_the_docs_show_commands():
    assert len(COMMANDS) > 30
    assert any(argv == ["--torch", "2.7", "--cuda", "12.1"] for _, argv in COMMANDS)  # the README's two commands
    assert any(argv == ["selftest"] for _, argv in COMMANDS)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses(where, argv, tmp_path, monkeypatch):
    """The parser keeps what argparse refuses (a documented --flavor slim) for validate() to report
    with every other problem: a documented command must pass validation too, on a machine that has
    what it reads (the placeholders filled in, the files it names present, the signing key's
    passphrase set). docs/measurements/ records commands as they ran on their day: parsed only."""
    argv = [_filled(a) for a in argv]
    for n, value in enumerate(argv[1:], 1):  # files the command reads, the user's own: here
        if argv[n - 1] in ("--record", "--ops-wheel") and not value.startswith("-") and not (ROOT / value).exists():
            argv[n] = str(tmp_path / value)
            (tmp_path / value).write_text("")
        elif argv[n - 1] == "--output" and value.startswith("~/"):  # a folder of the user's home, made before (`mkdir -p`)
            argv[n] = str(tmp_path / value[2:])
            (tmp_path / value[2:]).mkdir(parents=True, exist_ok=True)
        elif argv[n - 1] in ("--from", "--to") and not value.startswith("-") and not (ROOT / value).exists():  # a user's folder
            argv[n] = str(tmp_path / value.lstrip("/"))
            (tmp_path / value.lstrip("/")).mkdir(parents=True, exist_ok=True)
    if {"-h", "--help"} & set(argv):
        with pytest.raises(SystemExit, match="^0$"):
            cli.parser().parse_args(with_command(argv))
        return
    parsed = cli.parser().parse_args(with_command(argv))
    if where.startswith("docs/measurements/"):
        assert not getattr(parsed, spec.BAD), getattr(parsed, spec.BAD)
        return
    monkeypatch.chdir(ROOT)  # the docs' relative paths are the checkout's
    monkeypatch.setenv(sign.PASSPHRASE_ENV, "the user's")
    monkeypatch.setattr(sign, "check_key", lambda folder: "F" * 40)  # a key the user made with signing-key
    monkeypatch.setattr(matrix, "load", _loaded)  # matrix.yaml read once for all the commands, not once each
    validate.validate(parsed, ROOT / "matrix.yaml")  # a UsageError names what is wrong


_loaded = functools.lru_cache(matrix.load)


# What the docs write for the user to fill in, and a value of that form.
PLACEHOLDERS = {"HOST/NS": "127.0.0.1:5000/ml", "REGISTRY/": "127.0.0.1:5000/", "<digest>": "0" * 64}


def _filled(arg: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        arg = arg.replace(placeholder, value)
    return arg


def dry_runs() -> list[tuple[str, str | None, str]]:
    """Each row that a documented build line (one row, not --all) names."""
    rows = set()
    for _, argv in COMMANDS:
        if not argv or {"-h", "--help"} & set(argv):
            continue  # `python3 build.py` named in prose, not a command; or a --help, which plans nothing
        try:
            args = cli.parser().parse_args(with_command(argv))
        except UsageError:
            continue  # test_every_documented_command_parses names it
        if args.command == "build" and not args.all:
            rows.add((args.torch, args.cuda, args.flavor))
    return sorted(rows, key=str)


@pytest.mark.parametrize("torch, cuda, flavor", dry_runs())
def test_every_documented_build_plans_offline(torch, cuda, flavor):
    argv = ["--torch", torch, "--flavor", flavor, "--dry-run"] + (["--cuda", cuda] if cuda else [])
    proc = run_cli(ROOT, *argv, env=OFFLINE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("row:"), proc.stdout


def reference_sections() -> dict[str, str]:
    """`## \\`command\\`` -> that section of the command reference."""
    text = (DOCS / "cli.md").read_text()
    parts = re.split(r"^## `([\w-]+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def options(p: argparse.ArgumentParser) -> list[str]:
    """What --help shows of a parser: its long options, and its positionals by metavar."""
    shown = []
    for action in p._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            shown.append(max(action.option_strings, key=len))
        elif action.nargs != argparse.REMAINDER:
            shown.append(action.metavar or action.dest)
    return shown


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def named(word: str, text: str) -> bool:
    """word in text as a word of its own: `--check` is not named by `--check-security`."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_every_command_and_option_of_help_is_in_the_command_reference():
    p, sections = cli.parser(), reference_sections()
    intro = (DOCS / "cli.md").read_text().split("\n## ", 1)[0]
    missing = [f"{opt} (build.py)" for opt in options(p) if not named(opt, intro)]
    for name, sub in subparsers(p).items():
        if name not in sections:
            missing.append(f"## `{name}` section")
            continue
        missing += [f"{opt} ({name})" for opt in options(sub) if not named(opt, sections[name])]
    assert not missing, f"docs/cli.md does not name: {', '.join(missing)}"


def modules() -> list[tuple[str, str]]:
    """(package, path inside it) of every module and script the two packages hold."""
    found = []
    for package in ("pytorch_cuda_build", "pytorch_cuda_runtime"):
        for path in sorted((ROOT / package).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            if path.suffix in (".py", ".sh", ".txt") or path.parent.name == "bin":
                found.append((package, str(path.relative_to(ROOT / package))))
    return found


def test_the_module_map_names_every_module():
    parts = re.split(r"^### (.+)$", (DOCS / "architecture.md").read_text(), flags=re.M)
    sections = {head.split("/:")[0]: body for head, body in zip(parts[1::2], parts[2::2]) if "/:" in head}
    missing = [f"{package}/{rel}" for package, rel in modules() if f"`{rel}`" not in sections.get(package, "")]
    assert not missing, f"docs/architecture.md's module map lacks: {', '.join(missing)}"
    named = set(re.findall(r"^\| `([\w./-]+)` \|", sections["pytorch_cuda_build"] + sections["pytorch_cuda_runtime"], re.M))
    gone = named - {rel for _, rel in modules()}
    assert not gone, f"the module map names modules that do not exist: {', '.join(sorted(gone))}"


EMPTY_TABLE = f"before\n{render.README_START}\n{render.README_END}\nafter\n"


def test_render_writes_the_one_table_into_the_readme_and_the_docs(tmp_path):
    root = files.copy_project(ROOT, tmp_path / "project")
    m = matrix.load(root / "matrix.yaml")
    for name in render.TABLE_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(EMPTY_TABLE)
    render.write(root, m, list(m.images), log=lambda _: None)
    table = render.matrix_table(root, m)
    for name in render.TABLE_FILES:
        assert (root / name).read_text() == f"before\n{render.README_START}\n{table}\n{render.README_END}\nafter\n"
    render.check(root, m, list(m.images))

    docs_page = root / "docs" / "matrix.md"
    docs_page.write_text(docs_page.read_text().replace("| `2.7.1-cuda12.1-runtime` |", "| `edited by hand` |"))
    with pytest.raises(RenderError, match=r"docs/matrix\.md \(matrix table\)"):
        render.check(root, m, list(m.images))
    docs_page.write_text("no markers\n")
    with pytest.raises(RenderError, match=r"docs/matrix\.md lacks the"):
        render.check(root, m, list(m.images))


def test_the_committed_tables_are_renders_own():
    for name in render.TABLE_FILES:
        text = (ROOT / name).read_text()
        assert render.matrix_table(ROOT, matrix.load(ROOT / "matrix.yaml")) in text, name
