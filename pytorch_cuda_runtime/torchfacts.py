"""Print what the installed torch reports about itself, as torch-facts.json.

    python torchfacts.py > /opt/pytorch-cuda/torch-facts.json

The banner and the smoke suite compare the GPU with torch's CUDA arch list, read from this
file: importing torch at every container start would cost seconds. It is measured from the
installed wheel at build time, so it cannot disagree with it, and an empty list fails the
build. Standard library and torch only: the image's build bind-mounts this one file before
the runtime package is installed, so editing another module does not rebuild this layer.
"""
from __future__ import annotations

import json
import sys
from typing import Any


class NoArchList(Exception):
    """torch reports no CUDA arch list: a CPU wheel, or one the banner could not check a GPU against."""


def facts(torch: Any) -> dict[str, list[str]]:
    """{"cuda_arch_list": ["sm_50", ...]}, in torch's own order."""
    archs = torch._C._cuda_getArchFlags().split()
    if not archs:
        raise NoArchList("torch reports no CUDA arch list")
    return {"cuda_arch_list": archs}


def main() -> int:
    import torch  # here, not at the top: the tests give facts() a stand-in and have no torch

    try:
        print(json.dumps(facts(torch)))
    except NoArchList as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
