"""The rendered Dockerfiles read as docker-library's do: few comments, one line each, with a
docs link where more is needed; notes for people editing the templates stay in the templates
(`{# #}`), and the steps hold shell, not Python one-liners."""
from __future__ import annotations

import re

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import lock, render

from helpers import ROOT

MATRIX = matrix.load(ROOT / "matrix.yaml")
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
PRAGMA = re.compile(r"^# hadolint ignore=")
# Text only a person editing the templates needs; none of it may reach an image's Dockerfile.
EDITOR_ONLY = ("tests/", "render replaces", "REPRODUCIBLE_EPOCH", "{#", "#}", "{{", "{%")
LINK = re.compile(r"see (docs/[\w./-]+?\.md)(#[\w-]+)?\b")


def comments(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("#")]


def test_every_image_has_a_dockerfile():
    assert [p.parent.name for p in DOCKERFILES] == sorted(i.name for i in MATRIX.images)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_at_most_one_line_in_five_is_a_comment(path):
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    assert 5 * len(comments(path.read_text())) <= len(lines), f"{len(comments(path.read_text()))} of {len(lines)} lines"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_no_editor_notes_reach_the_dockerfile(path):
    text = path.read_text()
    assert [m for m in EDITOR_ONLY if m in text] == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_each_comment_is_one_line(path):
    """Past the header, no comment runs on to a second line (a hadolint pragma is no comment)."""
    lines = path.read_text().splitlines()
    body = lines[next(i for i, ln in enumerate(lines) if not ln.startswith("#")):]
    runs = [(a, b) for a, b in zip(body, body[1:]) if a.startswith("#") and b.startswith("#") and not PRAGMA.match(b)]
    assert runs == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_no_python_one_liners(path):
    assert not re.search(r"\bpython3? -c\b", path.read_text())


# Bound beside the script that imports it (wheellayer.py reads the lock's format through it).
IMPORTED_BESIDE = {"pytorch_cuda_runtime/lockfile.py"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_steps_before_the_package_copy_bind_single_module_files(path):
    """pytorch_cuda_runtime is COPY'd after the heavy layers; a step above that COPY binds the one
    file it runs, so a change to another module does not rebuild the CPU ops' compile."""
    text = path.read_text()
    copy = text.index("\nCOPY pytorch_cuda_runtime /opt/pytorch-cuda/lib/pytorch_cuda_runtime\n")
    early = text[:copy]
    assert "-m pytorch_cuda_runtime" not in early and "source=pytorch_cuda_runtime," not in early
    bound = dict(re.findall(r"--mount=type=bind,source=(pytorch_cuda_runtime/\w+\.py),target=(/tmp/\w+\.py)", early))
    assert set(bound) >= {"pytorch_cuda_runtime/torchfacts.py", "pytorch_cuda_runtime/cpuops.py",
                          "pytorch_cuda_runtime/ninjalogs.py"}
    for source, target in bound.items():
        assert (ROOT / source).is_file(), source
        if source in IMPORTED_BESIDE:
            continue
        assert re.search(rf"python (-B )?{re.escape(target)} ", early), f"{source} is bound but not run"
    assert set(re.findall(r"python (?:-B )?(/tmp/\w+\.py)", early)) == {t for s, t in bound.items() if s not in IMPORTED_BESIDE}


@pytest.mark.parametrize("image", MATRIX.images, ids=lambda i: i.name)
def test_apt_packages_one_a_line_with_the_one_line_value(image):
    """One package a line, yet the ARG's value (Docker joins continuation lines keeping their
    indent) is the one-line list's, so the apt layer's cache key did not change."""
    text = (lock.image_dir(ROOT, image) / "Dockerfile").read_text()
    raw = re.search(r'^ARG APT_PACKAGES="([^"]*)"$', text, re.M).group(1)
    pins = lock.read(ROOT, image).get("apt", {})
    assert raw.split(" \\\n") == ["\\\n" + render.apt_pinned(image.os.packages, pins)[0],
                                  *render.apt_pinned(image.os.packages, pins)[1:]]
    assert re.sub(r"\\[ \t]*\n", "", raw) == render.apt_list(image.os.packages, pins)


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="docs/ is not written yet")
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_docs_links_name_pages_that_exist(path):
    for page, anchor in LINK.findall(path.read_text()):
        assert (ROOT / page).is_file(), page
        if anchor:
            heads = [re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)]
            assert anchor[1:] in heads, f"{page}{anchor}"
