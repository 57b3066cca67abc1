"""A test hook, for stand-in GPUs only: what nvidia-smi would say, from a file the test writes.

The tests' GPUs are stand-ins (character devices with NVIDIA's major number, tests/slurm.py) with
no driver behind them, so nvidia-smi cannot answer for them. PYTORCH_CUDA_PREFLIGHT_STANDIN names a
JSON file, {"HOSTNAME" or "*": [{"name": ..., "driver": ..., "capability": "9.0"}, ...]}, read here
and nowhere else; every line the preflight prints from it says "stand-in". A site never sets it.
An entry may also carry the compute check's stand-in (compute.py): "tflops", the speed it
reports, and "corrupt": true, a wrong result; and "serial".
"""
from __future__ import annotations

import json
import os
from typing import Any

VARIABLE = "PYTORCH_CUDA_PREFLIGHT_STANDIN"


def rows(env: dict[str, str], hostname: str) -> list[dict[str, Any]] | None:
    """This host's entries in the stand-in file, or None where the hook is unset."""
    path = env.get(VARIABLE)
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    return list(table.get(hostname, table.get("*", [])))


def gpus(env: dict[str, str], hostname: str) -> list[tuple[str, str, str]] | None:
    """[(name, driver, capability)] for this host from the stand-in file, or None where the hook is unset."""
    found = rows(env, hostname)
    return None if found is None else [(g["name"], g["driver"], g["capability"]) for g in found]


def source(env: dict[str, str]) -> str:
    return f"stand-in GPUs ({VARIABLE}={os.path.basename(env[VARIABLE])}), not a driver"
