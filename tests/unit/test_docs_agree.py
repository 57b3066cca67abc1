"""Pages that say what the code decides say what the code says, read from the code's one place:

- the exit-code table (docs/faults.md) has every code the error tree (pytorch_cuda_build.errors and
  every subclass in the package) and the CLI's signal handling give, and no other;
- the marker table (docs/testing.md) and CONTRIBUTING.md name the markers pyproject.toml registers;
- every flavor a page names (`--flavor X`, `flavors: [...]`) is one of matrix.FLAVORS;
- the image reference's labels section names every label render and build put on an image;
- a default the command reference states for an option is the parser's default.
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
