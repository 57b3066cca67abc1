"""The docs say which CI they mean. There are two: this project's CI (`.ci/run`, run as root on
our own build machines: `python3 build.py selftest`, the whole suite) and the GitHub workflow
(`.github/workflows/images.yml`, on GitHub-hosted runners: it builds, tests and publishes the
matrix). Every line of the README and of docs/**/*.md that says "CI" names one of them on the same
line; lines in fenced code blocks and link targets are not read."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

WORD = re.compile(r"\bCI\b")
LINK_TARGET = re.compile(r"\]\([^)]*\)")  # `[text](publishing.md#the-ci-workflow)`: the target is not prose
FENCE = re.compile(r"^\s*(```|~~~)")
# What names the CI on the same line. Kept short on purpose: each one says which CI it is.
QUALIFIERS = (
    "project's CI",     # this project's CI
    "`.ci/run`",        # this project's CI, by its entry point
    "GitHub workflow",  # .github/workflows/images.yml
    "workflow's",       # "the GitHub workflow's merge job" and the like
    "GitHub Actions",   # what runs the GitHub workflow
    "CI=true",          # the environment variable both CIs set, not a CI
)
# "CI workflow" names the GitHub workflow only where the line says GitHub too.
CI_WORKFLOW = "CI workflow"


def unqualified(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, line) for each line outside fenced code that says CI and names neither CI."""
    found, fenced = [], False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = LINK_TARGET.sub("]()", line)
        if not WORD.search(prose):
            continue
        if any(q in prose for q in QUALIFIERS) or (CI_WORKFLOW in prose and "GitHub" in prose):
            continue
        found.append((number, line.strip()))
    return found


@pytest.mark.parametrize("line", [
    "CI runs them, within the whole suite.",
    "how CI builds what it publishes",
    "CI's fan-out",
    "## The CI workflow",
    "see [CI](publishing.md#the-ci-workflow)",
])
def test_the_checker_finds_an_unqualified_ci(line):
    assert unqualified([line]) == [(1, line)]


@pytest.mark.parametrize("line", [
    "This project's CI runs them.",
    "In this project's CI (`.ci/run`) the sbatch script runs.",
    "the GitHub workflow's merge job",
    "The GitHub workflow checks that the locks match.",
    "## The GitHub CI workflow",
    "except where `CI=true`, where it fails",
    "see [publishing](publishing.md#the-ci-workflow)",  # a link target, not prose
    "CIFAR-10 and CIs are other words",
])
def test_the_checker_passes_a_named_ci(line):
    assert unqualified([line]) == []


def test_the_checker_skips_fenced_code_and_reads_on_after_it():
    lines = ["```", "CI: the parts in the registry", "```", "CI runs it."]
    assert unqualified(lines) == [(4, "CI runs it.")]


def test_the_pages_exist():
    assert ROOT / "docs" / "clusters.md" in PAGES and len(PAGES) > 10


def test_every_ci_in_the_docs_names_which_ci():
    bad = [f"{page.relative_to(ROOT)}:{number}: {line}"
           for page in PAGES for number, line in unqualified(page.read_text().splitlines())]
    assert not bad, "say which CI: this project's CI (`.ci/run`) or the GitHub workflow\n" + "\n".join(bad)
