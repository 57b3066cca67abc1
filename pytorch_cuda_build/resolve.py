"""Stage 2: resolve a row against the package index (the only stage that needs the network).

`uv pip compile` reads each wheel's metadata (range requests, no full downloads) and
pins the whole environment with hashes for the image's platform, not the host's.
The CUDA runtime, cuDNN and NCCL versions are then read from what the torch wheel
pins (directly, or from 2.11 on through `cuda-toolkit[...]`), never typed by hand.
"""
from __future__ import annotations

import lzma
import os
import re
import ssl
import urllib.error
import urllib.request
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import EnvironmentProblem, ResolveError
from .matrix import Image

# Wheels are manylinux_2_28 at most for the torch versions we ship; bookworm has glibc 2.36.
PYTHON_PLATFORM = "x86_64-manylinux_2_28"

# Packages whose pins tell which CUDA stack the torch wheel carries. The CUDA 12
# wheels are suffixed -cu12; the CUDA 13 ones (through cuda-toolkit) are not.
_CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
_CUDNN = re.compile(r"^nvidia-cudnn-cu\d+$")
_NCCL = re.compile(r"^nvidia-nccl-cu\d+$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


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


def compile_lock(image: Image, ca_bundle: str | None, upgrade: bool = False) -> str:
    """Hash-pinned requirements for the image's whole Python environment."""
    cmd = [
        uv_binary(), "pip", "compile", "-", "--quiet", "--generate-hashes", "--no-header",
        "--python-version", image.python, "--python-platform", PYTHON_PLATFORM,
        "--index-url", image.index, "--no-cache",
    ]
    env = dict(os.environ)
    if ca_bundle:
        env["SSL_CERT_FILE"] = ca_bundle  # uv ignores pip's config and the system store
    try:
        proc = subprocess.run(
            cmd, input="\n".join(requirements_for(image)) + "\n", capture_output=True, text=True, env=env, timeout=600
        )
    except subprocess.TimeoutExpired:
        raise ResolveError(f"{image.name}: resolving against {image.index} timed out after 600 s") from None
    if proc.returncode != 0:
        reason = _first_error_line(proc.stderr)
        raise ResolveError(f"{image.name}: cannot resolve {' '.join(requirements_for(image))} from {image.index}: {reason}")
    return proc.stdout


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("error:", "×", "╰─▶", "Because", "hint:")) and len(ln) > 10:
            return ln.lstrip("×╰─▶ ").strip()
    return lines[-1] if lines else "uv failed without a message"


def pins(lock_text: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements lock."""
    out = {}
    for line in lock_text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


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


_DEBIAN_INDEX: dict[tuple[str, str], dict[str, str]] = {}


def debian_versions(mirror: str, suite: str, names: list[str], ca_bundle: str | None) -> dict[str, str]:
    """name -> version of each package in the suite's main index, as apt in the build will see it."""
    key = (mirror, suite)
    if key not in _DEBIAN_INDEX:
        url = f"{mirror.rstrip('/')}/dists/{suite}/main/binary-amd64/Packages.xz"
        context = ssl.create_default_context(cafile=ca_bundle) if ca_bundle and url.startswith("https") else None
        try:
            with urllib.request.urlopen(url, timeout=120, context=context) as r:
                text = lzma.decompress(r.read()).decode()
        except (urllib.error.URLError, OSError, lzma.LZMAError) as e:
            raise ResolveError(f"cannot read the Debian package index {url}: {e}") from None
        index = {}
        for stanza in text.split("\n\n"):
            fields = dict(ln.split(": ", 1) for ln in stanza.splitlines() if ": " in ln and not ln.startswith(" "))
            if "Package" in fields:
                index[fields["Package"]] = fields["Version"]
        _DEBIAN_INDEX[key] = index
    index = _DEBIAN_INDEX[key]
    missing = [n for n in names if n not in index]
    if missing:
        raise ResolveError(f"Debian {suite} at {mirror} has no package {', '.join(missing)}")
    return {n: index[n] for n in names}
