"""MkDocs hooks (mkdocs.yml `hooks:`): publish the few repository files that live outside
docs/ (the bench report and its plots, CHANGELOG.md) and point the docs' links to them at
the published copies. A page links them by their path in the repository (`../bench/report.md`),
so the same link works on GitHub and on the site, and --strict still checks it."""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
# path in the repository -> path in the site
PUBLISHED = {
    "bench/report.md": "bench/report.md",
    "bench/arm64.md": "bench/arm64.md",
    "bench/pull.md": "bench/pull.md",
    "bench/2.11.0-cuda13.0-train/report.md": "bench/2.11.0-cuda13.0-train.md",
    "bench/2.7.1-cuda12.1-train/report.md": "bench/2.7.1-cuda12.1-train.md",
    "bench/gpu/2026-11-27-h100-2.11.0-cuda13.0-train/README.md": "bench/gpu-2026-11-27-h100.md",
    "bench/sizes.svg": "bench/sizes.svg",
    "bench/cold-build.svg": "bench/cold-build.svg",
    "CHANGELOG.md": "changelog.md",
}
OUTSIDE_LINK = re.compile(r"\]\((\.\./[^)#\s]+)")


def on_files(files, config):
    for repo_path, site_path in PUBLISHED.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri)

    def published(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join("docs", here, m.group(1)))
        if target not in PUBLISHED:
            return m.group(0)  # left as it is: --strict reports it as a broken link
        return "](" + posixpath.relpath(PUBLISHED[target], here or ".")

    return OUTSIDE_LINK.sub(published, markdown)
