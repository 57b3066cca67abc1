"""Every user and contributor page of the site's nav is in the README's page table and in the
site's home page (docs/index.md): a reader finds each page from either."""
from __future__ import annotations

import re

import yaml

from helpers import ROOT


def nav_pages() -> list[str]:
    """The pages of the nav's Users and Contributors sections, but the benchmark reports (bench/),
    which their pages link."""
    # mkdocs.yml may carry !!python tags in other projects; this one is plain YAML
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = []
    for section in nav:
        for name, entries in section.items():
            if name in ("Users", "Contributors"):
                pages += [page for entry in entries for page in entry.values() if not page.startswith("bench/")]
    return pages


def test_the_nav_has_the_user_pages():
    assert {"choosing.md", "example.md", "gpu-host.md", "slurm.md", "kubernetes.md"} <= set(nav_pages())


def test_the_readme_lists_every_page():
    listed = set(re.findall(r"^\| \[[^\]]+\]\(docs/([\w/.-]+\.md)\)", (ROOT / "README.md").read_text(), re.M))
    missing = [p for p in nav_pages() if p not in listed]
    assert not missing, f"the README's page table lacks: {', '.join(missing)}"


def test_the_sites_home_lists_every_page():
    linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]+)?\)", (ROOT / "docs" / "index.md").read_text()))
    missing = [p for p in nav_pages() if p not in linked]
    assert not missing, f"docs/index.md does not link: {', '.join(missing)}"
