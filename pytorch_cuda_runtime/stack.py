"""The pinned GPU stack: torch, triton, DeepSpeed and the NVIDIA/CUDA wheels, as the image was tested.

    python -m pytorch_cuda_runtime.stack constraints --output /opt/pytorch-cuda/constraints.txt
    python -m pytorch_cuda_runtime.stack check      (exit 1 and one line per package that moved)

The image's last build step writes the constraints file from what is installed then (the lock's
pins, checked by every wheel layer, and the DeepSpeed wheel built with the ops), and the image sets
PIP_CONSTRAINT and UV_CONSTRAINT to it. Every `pip install` and `uv pip install` then resolves
with these versions held: adding transformers leaves torch alone, and an install that needs
another torch is refused by the resolver, which names the package and its pin. The resolvers'
own errors cannot say how to override, so the file's header does, and so do the banner and
docs/extending.md. Everything not named here may move.

The banner compares the installed versions with the file (changes()): after a deliberate
override it says that the stack is no longer the tested one. Standard library only: the
banner imports this on every container start.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
from pathlib import Path

from pytorch_cuda_runtime import lockfile

CONSTRAINTS = Path("/opt/pytorch-cuda/constraints.txt")
# What the prebuilt DeepSpeed ops and the image's tests depend on: moving any of these can break
# the ops (built against this torch and CUDA) or NCCL and cuDNN as tested.
PROTECTED = re.compile(r"^(torch|triton|deepspeed|nvidia-.+|cuda-.+)$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")

HEADER = """\
# The GPU stack this image was built and tested with. pip (PIP_CONSTRAINT) and uv (UV_CONSTRAINT)
# read this file on every install: new packages never move these, and an install that needs
# another version of one is refused by the resolver, which names the package and its pin here.
#
# To move one on purpose, clear the variable for that command:
#     PIP_CONSTRAINT= pip install torch==VERSION
#     UV_CONSTRAINT= uv pip install torch==VERSION
# or, in a derived Dockerfile, for the steps after it:
#     ENV PIP_CONSTRAINT= UV_CONSTRAINT=
# The prebuilt DeepSpeed ops were compiled against this torch and CUDA, and the image's tests ran
# with these versions: after an override the banner says the stack differs from what was tested.
# The image's labels and SBOM keep describing the image as built. See docs/extending.md.
"""
HOW_TO_OVERRIDE = "PIP_CONSTRAINT= pip install ... or UV_CONSTRAINT= uv pip install ..."


canonical = lockfile.canonical


def installed() -> dict[str, str]:
    """name -> version of every distribution this interpreter sees (the first one found of a name, as import would)."""
    out: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonical(name), d.version)
    return out


def protected(versions: dict[str, str]) -> dict[str, str]:
    return {n: v for n, v in sorted(versions.items()) if PROTECTED.match(n)}


def constraints_text(versions: dict[str, str]) -> str:
    pins = protected(versions)
    if "torch" not in pins:
        raise ValueError("torch is not installed: no stack to pin")
    return HEADER + "".join(f"{n}=={v}\n" for n, v in pins.items())


def read(path: Path = CONSTRAINTS) -> dict[str, str]:
    """The pins of a constraints file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def changes(pins: dict[str, str], versions: dict[str, str]) -> list[str]:
    """One entry per pinned package whose installed version is not its pin: 'torch 2.8.0 (tested: 2.7.1)'."""
    out = []
    for name, want in sorted(pins.items()):
        have = versions.get(name)
        if have is None:
            out.append(f"{name} removed (tested: {want})")
        elif have != want:
            out.append(f"{name} {have} (tested: {want})")
    return out


def changed_line(moved: list[str]) -> str:
    shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
    return (f"the pinned stack differs from what this image was tested with: {shown}. The prebuilt DeepSpeed ops "
            "and the image's tests no longer vouch for it; its labels and SBOM describe the image as built.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytorch_cuda_runtime.stack", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    write = sub.add_parser("constraints", help="write the constraints file from what is installed now")
    write.add_argument("--output", type=Path, default=CONSTRAINTS)
    check = sub.add_parser("check", help="exit 1, one line each, where an installed version is not its pin")
    check.add_argument("--constraints", type=Path, default=CONSTRAINTS)
    a = ap.parse_args(argv)
    try:
        if a.command == "constraints":
            text = constraints_text(installed())
            tmp = a.output.with_name(a.output.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, a.output)
            print(f"stack: {len(read(a.output))} pins in {a.output}")
            return 0
        moved = changes(read(a.constraints), installed())
    except (OSError, ValueError) as e:
        print(f"stack: {e}", file=sys.stderr)
        return 2
    for line in moved:
        print(line)
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
