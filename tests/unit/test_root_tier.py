"""The `root` tier is declared where root is needed, and the GitHub workflow leaves out only
registered tiers (docs/testing.md, "What runs where").

A test that makes the host itself a fixture (a user, a network namespace, /etc/hosts, sudoers) as
root must be in a module of the root tier (marked `root`, or `engine26`, which implies it); one
command that needs root goes through helpers.as_root (sudo where the user is not root). At run time
helpers.needs_root checks the same for what this text scan cannot see."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from pytorch_cuda_build.tooling.selftest import LEAVE_OUT_ENV

ROOT = Path(__file__).resolve().parent.parent.parent
TESTS = ROOT / "tests"
# What only root may do to the host: users, sudoers, namespaces, /etc/hosts, mounts, another's files.
ROOT_OPS = re.compile(r'"useradd"|"userdel"|"usermod"|/etc/sudoers|"netns"|"/etc/hosts"|"mount"|os\.chown\(|geteuid\(\) == 0')
TIER = re.compile(r"pytest\.mark\.(root|engine26)\b")


def root_lines(path: Path) -> list[str]:
    return [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if ROOT_OPS.search(line) and "as_root(" not in line and not line.lstrip().startswith("#")]


def module_marks(path: Path) -> str:
    text = path.read_text()
    start = text.find("pytestmark =")
    return text[start:text.find("\n\n", start)] if start >= 0 else ""


def test_what_needs_root_is_in_a_module_of_the_root_tier():
    helpers = {p.stem: root_lines(p) for p in TESTS.glob("*.py") if p.name not in ("conftest.py", "helpers.py")}
    assert not root_lines(TESTS / "helpers.py"), "helpers.py: root only through as_root or needs_root"
    unmarked = []
    for test in sorted((TESTS / "integration").glob("test_*.py")):
        used = [h for h, lines in helpers.items() if lines and re.search(rf"^from {h} import|^import {h}\b", test.read_text(), re.M)]
        if (root_lines(test) or used) and not TIER.search(module_marks(test)):
            unmarked.append(f"{test.name}: {(root_lines(test) or used)[:3]}")
    assert not unmarked, "needs root, and its module is not marked root (docs/testing.md): " + "; ".join(unmarked)


def test_the_scan_sees_a_useradd_in_an_unmarked_module(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text('import subprocess\npytestmark = []\n\n\ndef test_x():\n    subprocess.run(["useradd", "x"])\n')
    assert root_lines(bad) and not TIER.search(module_marks(bad))


def test_pr_build_leaves_out_only_registered_markers_and_this_projects_ci_leaves_out_nothing():
    markers = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    jobs = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())["jobs"]
    named = {job: step["env"][LEAVE_OUT_ENV] for job, spec in jobs.items() for step in spec["steps"]
             if LEAVE_OUT_ENV in step.get("env", {})}
    assert named == {"pr-build": "root"} and "root" in markers, named
    assert LEAVE_OUT_ENV not in (ROOT / ".ci" / "run").read_text()
