"""Stage 2, the Python environment: resolve a row against the package index.

`uv pip compile` reads each wheel's metadata (range requests, no full downloads) and
pins the whole environment with hashes for the image's platform, not the host's.
The CUDA runtime, cuDNN and NCCL versions are then read from what the torch wheel
pins (directly, or from 2.11 on through `cuda-toolkit[...]`), never typed by hand.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pytorch_cuda_runtime import lockfile

from ..errors import EnvironmentProblem, ResolveError
from ..matrix import OS_PLATFORMS, Image
from .wheel_files import PIN

# Wheels are manylinux_2_28 at most for the torch versions we ship; bookworm has glibc 2.36.
# matrix.OS_PLATFORMS gives each OS platform's tag; this is linux/amd64's, every row's first.
PYTHON_PLATFORM = OS_PLATFORMS["linux/amd64"]

# Packages whose pins tell which CUDA stack the torch wheel carries. The CUDA 12
# wheels are suffixed -cu12; the CUDA 13 ones (through cuda-toolkit) are not.
_CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
_CUDNN = re.compile(r"^nvidia-cudnn-cu\d+$")
_NCCL = re.compile(r"^nvidia-nccl-cu\d+$")
# The packages whose versions must agree exactly between torch and the toolkit.
_COMPILER_CORE = {"nvidia-cuda-runtime", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "cuda-toolkit"}

# PYTORCH_CUDA_EXCLUDE_NEWER (an ISO 8601 date or UTC date-time, e.g. 2026-11-22T21:30:00Z)
# freezes resolution in time: uv ignores every file uploaded to the index after it
# (--exclude-newer), so the same inputs resolve to the same pins on any later day. The
# test suite sets it (tests/conftest.py) so that no test depends on the index's newest
# release; unset, `lock` resolves against the index as it is now.
EXCLUDE_NEWER_ENV = "PYTORCH_CUDA_EXCLUDE_NEWER"


@dataclass(frozen=True)
class WheelFacts:
    """What the torch wheel really brings, as read from the resolved metadata."""

    torch: str
    torch_cuda: str
    cudnn: str
    nccl: str
    deepspeed: str


def uv_binary() -> str:
    """The uv that came with the host tool's virtualenv, else one on PATH."""
    here = Path(sys.executable).with_name("uv")
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        raise EnvironmentProblem("uv not found; run through build.py so its virtualenv is set up")
    return found


def requirements_for(image: Image) -> list[str]:
    return [f"torch=={image.torch}", f"deepspeed=={image.deepspeed}", *image.extra_requirements]


def frozen_at(given: str | None = None) -> str | None:
    """The point in time resolution is frozen at: `given`, else $PYTORCH_CUDA_EXCLUDE_NEWER, else None."""
    value = (given or os.environ.get(EXCLUDE_NEWER_ENV, "")).strip()
    if not value:
        return None
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ResolveError(f"{EXCLUDE_NEWER_ENV}={value!r} is not an ISO 8601 date or date-time (e.g. 2026-11-22T21:30:00Z)") from None
    return value


def _uv_compile(image: Image, when: str | None, *extra: str, platform: str = "linux/amd64") -> list[str]:
    cmd = [
        uv_binary(), "pip", "compile", "-", "--quiet", "--generate-hashes", "--no-header", *extra,
        "--python-version", image.python, "--python-platform", OS_PLATFORMS[platform],
        "--index-url", image.index, "--no-cache",
    ]
    return [*cmd, "--exclude-newer", when] if when else cmd


def _run_uv(image: Image, requirements: str, what: str, exclude_newer: str | None, ca_bundle: str | None, *extra: str,
            platform: str = "linux/amd64") -> str:
    """`uv pip compile` of `requirements` for one of the image's OS platforms; stdout, or one ResolveError line."""
    env = dict(os.environ)
    if ca_bundle:
        env["SSL_CERT_FILE"] = ca_bundle  # uv ignores pip's config and the system store
    try:
        proc = subprocess.run(_uv_compile(image, frozen_at(exclude_newer), *extra, platform=platform), input=requirements,
                              capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        raise ResolveError(f"{image.name}: resolving against {image.index} timed out after 600 s") from None
    if proc.returncode != 0:
        where = "" if platform == "linux/amd64" else f" for {platform}"
        raise ResolveError(f"{image.name}: cannot resolve {what}{where} from {image.index}: {_first_error_line(proc.stderr)}")
    return proc.stdout


def compile_lock(image: Image, ca_bundle: str | None, upgrade: bool = False, exclude_newer: str | None = None,
                 platform: str = "linux/amd64") -> str:
    """Hash-pinned requirements for the image's whole Python environment on one OS platform.

    exclude_newer (ISO 8601) ignores files uploaded after it; None reads $PYTORCH_CUDA_EXCLUDE_NEWER.
    """
    reqs = requirements_for(image)
    return _run_uv(image, "\n".join(reqs) + "\n", " ".join(reqs), exclude_newer, ca_bundle, platform=platform)


def compile_extras(image: Image, runtime_lock: str, ca_bundle: str | None, exclude_newer: str | None = None,
                   platform: str = "linux/amd64") -> str:
    """The train flavor's extras resolved over the runtime's lock (its requirements and DeepSpeed
    pins, `runtime_lock`) held as constraints, so no runtime pin moves; every package of the result.

    Constraints are given as plain `name==version` lines: uv reads them from a file, and they
    carry no hashes (the runtime's hashes stay in its own lock)."""
    reqs = [*requirements_for(image), *(r for _, r in image.extras)]
    constraints = "".join(f"{name}=={version}\n" for name, version in sorted(pins(runtime_lock).items()))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="runtime-pins-") as f:
        f.write(constraints)
        f.flush()
        return _run_uv(image, "\n".join(reqs) + "\n", "the train extras " + " ".join(r for _, r in image.extras),
                       exclude_newer, ca_bundle, "--constraint", f.name, platform=platform)


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("error:", "×", "╰─▶", "Because", "hint:")) and len(ln) > 10:
            return ln.lstrip("×╰─▶ ").strip()
    return lines[-1] if lines else "uv failed without a message"


def pins(lock_text: str) -> dict[str, str]:
    """name (PEP 503) -> version of every `name==version` requirement of a requirements lock."""
    return lockfile.versions(lock_text)


def _one(pinned: dict[str, str], pattern: re.Pattern[str], what: str, torch: str) -> str:
    hits = [v for k, v in pinned.items() if pattern.match(k)]
    if len(hits) != 1:
        raise ResolveError(f"torch {torch}: expected one {what} package in its requirements, found {len(hits)}; is this a CUDA build?")
    return hits[0]


def wheel_facts(lock_text: str) -> WheelFacts:
    pinned = pins(lock_text)
    torch = pinned.get("torch", "?")
    runtime = _one(pinned, _CUDA_RUNTIME, "CUDA runtime", torch)
    return WheelFacts(
        torch=torch,
        torch_cuda=".".join(runtime.split(".")[:2]),
        cudnn=_one(pinned, _CUDNN, "cuDNN", torch),
        nccl=_one(pinned, _NCCL, "NCCL", torch),
        deepspeed=pinned.get("deepspeed", "?"),
    )


def pypi_toolkit(image: Image, wheel_lock: str, ca_bundle: str | None, exclude_newer: str | None = None,
                 platform: str = "linux/amd64") -> str:
    """Hash-pinned nvcc & co. from `cuda-toolkit[extras]` at the version torch pins, minus what torch already installs.

    exclude_newer as for compile_lock.
    """
    pinned = pins(wheel_lock)
    version = pinned.get("cuda-toolkit")
    if not version:
        raise ResolveError(f"{image.name}: torch {image.torch} pins no cuda-toolkit; a pypi toolkit needs one (use a debian toolkit for this CUDA major)")
    assert image.toolkit is not None  # a pypi toolkit: resolve_toolkit read it
    spec = f"cuda-toolkit[{','.join(image.toolkit.extras)}]=={version}"
    out = _run_uv(image, spec + "\n", spec, exclude_newer, ca_bundle, "--no-annotate", platform=platform)
    blocks = re.split(r"\n(?=\S)", out.strip())
    keep, notes = [], []
    for block in blocks:
        m = PIN.match(block)
        if not m:
            continue
        name, ver = m.group(1).lower().replace("_", "-"), m.group(2)
        if name in pinned:
            # torch's own pins are installed already and must not move; a compiler whose
            # runtime is not the one torch ships would build ops against the wrong CUDA.
            if pinned[name] != ver and name in _COMPILER_CORE:
                raise ResolveError(f"{image.name}: {spec} wants {name}=={ver}, torch pins {pinned[name]}")
            if pinned[name] != ver:
                notes.append(f"# {spec} asks for {name}=={ver}; torch pins {pinned[name]}, which is installed\n")
            continue
        keep.append(block)
    return "".join(notes) + "\n".join(keep) + "\n"
