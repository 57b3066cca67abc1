"""Compile DeepSpeed's ops for its CPU accelerator at build time, so a CPU host compiles nothing.

    DS_ACCELERATOR=cpu python cpuops.py BUILDER...   (e.g. CPUAdamBuilder)

DeepSpeed's CPU accelerator (CPU-only training, the smoke suite on CPU hosts) never uses the
ops built for cuda: one wheel serves one accelerator, and the CPU one compiles its own ops on
first use, into torch's extensions directory. Loading each builder here does that compile in
the image, for the default user, and torch then finds the ops up to date. Standard library and
DeepSpeed only: the image's build bind-mounts this one file before the runtime package is
installed, so editing another module does not rebuild this layer.
"""
from __future__ import annotations

import sys
from typing import Any


class UnknownBuilder(Exception):
    """The accelerator has no op builder of that name (DeepSpeed renamed or dropped it)."""


def load_all(accelerator: Any, builders: list[str]) -> None:
    """Build (or find up to date) and load each named op, in order."""
    for name in builders:
        builder = accelerator.create_op_builder(name)
        if builder is None:
            raise UnknownBuilder(f"DeepSpeed's {accelerator.device_name()} accelerator has no op builder {name}")
        builder.load(verbose=False)


def main(argv: list[str] | None = None) -> int:
    builders = sys.argv[1:] if argv is None else argv
    if not builders:
        print("usage: DS_ACCELERATOR=cpu cpuops.py BUILDER...", file=sys.stderr)
        return 2
    # here, not at the top: the tests give load_all() a stand-in and have no DeepSpeed
    from deepspeed.accelerator import get_accelerator

    try:
        load_all(get_accelerator(), builders)
    except UnknownBuilder as e:
        print(f"cpuops: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
