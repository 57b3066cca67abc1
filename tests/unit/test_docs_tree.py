"""The tracked tree holds no leftovers: no merge's or patch's remains (`*.orig`, `*.rej`), no
editor's backups or swap files (`*~`, `*.bak`, `*.swp`, `.#name`, `#name#`). mkdocs publishes
every file under docs/, so a leftover there is a page of the site (a `docs/clusters.md.orig` was,
with a node count the page itself no longer gave). And every Markdown file under docs/ is a page
of the site's nav: a page the nav lacks is one nobody finds, or a copy."""
from __future__ import annotations

import fnmatch
import subprocess

import pytest
import yaml

from helpers import ROOT

LEFTOVERS = ("*.orig", "*.rej", "*~", "*.bak", "*.swp", "*.swo", ".#*", "#*#", "*.tmp")


def tracked() -> list[str]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")  # a source tarball has no index to read
    return [p for p in proc.stdout.split("\0") if p]


def leftovers(paths: list[str]) -> list[str]:
    return [p for p in paths if any(fnmatch.fnmatch(p.rsplit("/", 1)[-1], pattern) for pattern in LEFTOVERS)]


@pytest.mark.parametrize("path", ["docs/clusters.md.orig", "images/x/Dockerfile.rej", "README.md~", "docs/.#slurm.md",
                                  "tests/#notes#", "a/b.swp", "matrix.yaml.bak"])
def test_the_check_finds_a_leftover(path):
    assert leftovers(["README.md", path]) == [path]


def test_the_tracked_tree_holds_no_leftover():
    paths = tracked()
    assert "README.md" in paths
    found = leftovers(paths)
    assert not found, f"leftover files are tracked (git rm them): {', '.join(found)}"


def nav_files(nav) -> set[str]:
    found: set[str] = set()
    for entry in nav:
        if isinstance(entry, str):
            found.add(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                found |= nav_files(value) if isinstance(value, list) else {value}
    return found


def test_every_markdown_file_under_docs_is_a_page_of_the_nav():
    nav = nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.removeprefix("docs/") for p in tracked() if p.startswith("docs/") and p.endswith(".md")}
    assert "slurm.md" in pages
    assert not pages - nav, f"docs/ pages the site's nav lacks: {', '.join(sorted(pages - nav))}"
