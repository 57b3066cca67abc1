"""Assertion helpers shared by the test tiers: show the command and its output on failure."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# One copy, shipped with the structure checks that need them too.
from pytorch_cuda_build.checks.support import run_image, shown  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def venv_tool(name: str) -> str:
    """A linter that comes with build.py's .venv (pytorch_cuda_build/requirements.txt), else from PATH."""
    found = Path(sys.executable).with_name(name)
    path = str(found) if found.exists() else shutil.which(name)
    if not path:
        pytest.fail(f"{name} missing: it comes with build.py's .venv (pytorch_cuda_build/requirements.txt)")
    return path


def project_copy(dest: Path) -> Path:
    """A throwaway copy of the project (committed inputs and code) that a test may break.

    Its .venv links to ours, so its build.py runs at once without a new virtualenv.
    """
    from pytorch_cuda_build.files import copy_project
    return copy_project(ROOT, dest)


# The default user's line in templates/finish.j2: the fault tests insert failing steps before it.
USER_LINE = "USER 1000:1000"


def insert_before_user(root: Path, steps: str) -> None:
    """Insert Dockerfile steps before the USER line of a project copy's finish.j2; a template
    without that line fails here, rather than leaving the copy unbroken and the test vacuous."""
    tpl = root / "templates" / "finish.j2"
    text = tpl.read_text()
    assert text.count(USER_LINE) == 1, f"{tpl} must have exactly one {USER_LINE!r} line"
    tpl.write_text(text.replace(USER_LINE, steps + "\n" + USER_LINE, 1))


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str):
    """A real, small filesystem at mnt, to fill up (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def run_build_py(root: Path, *args: str, env: dict | None = None, timeout: int = 3600) -> subprocess.CompletedProcess:
    """Run a project's build.py with our virtualenv, as a user would."""
    import os
    import sys

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(root / "build.py"), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=root)


def run_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """build.py's CLI run in this process against the project at root: what run_build_py
    checks, without a new interpreter importing the tool (about 1 s each).

    For usage errors and offline commands; run_build_py covers the entry point itself
    (build.py, its virtualenv). Exit code and both streams come back as from a process.
    """
    from unittest import mock

    from pytorch_cuda_build import cli

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # main() installs its own
    try:
        with mock.patch.dict(os.environ, env or {}), mock.patch.object(cli, "ROOT", Path(root)), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(["build.py", *args], rc, out.getvalue(), err.getvalue())


def tree_snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
