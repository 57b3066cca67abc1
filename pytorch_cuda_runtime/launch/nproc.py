"""How many ranks this node starts, decided without importing torch.

  1. PYTORCH_CUDA_NPROC_PER_NODE, where set;
  2. the scheduler's own count: PET_NPROC_PER_NODE (Kubeflow), SLURM_GPUS_ON_NODE (Slurm);
  3. else `auto`.
`auto` is torchrun's own (one rank per GPU torch sees, honouring CUDA_VISIBLE_DEVICES) where
this node shows a GPU; where it shows none, 1: torchrun's `auto` would start one rank per CPU
core. `cpu`, `gpu` and numbers go to torchrun as they are.

A GPU shows as (visible_gpus): /dev/nvidia0, /dev/nvidia1, ... (what the NVIDIA runtime, CDI,
Apptainer's --nv and Slurm's device cgroup give a container), else the GPU lines of
`nvidia-smi -L`; CUDA_VISIBLE_DEVICES, where set, then counts as CUDA reads it (its list up to
the first invalid entry, so "" and "-1" mean none). NVIDIA_VISIBLE_DEVICES is a request to the
NVIDIA runtime, not a count (the image itself sets it to `all`): only `none` and `void` are read,
as no GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping

from . import LaunchError
from .sources import Topology

NAMED = ("auto", "cpu", "gpu")


def cuda_visible_count(value: str) -> int:
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def dev_nodes(dev: str = "/dev") -> list[str]:
    try:
        return os.listdir(dev)
    except OSError:
        return []


def nvidia_smi_count(timeout: float = 10.0) -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in r.stdout.splitlines()) if r.returncode == 0 else 0


def visible_gpus(env: Mapping[str, str], devices: Iterable[str] | None = None,
                 smi: Callable[[], int] = nvidia_smi_count) -> tuple[int, str]:
    """How many GPUs this node shows, and how that was seen."""
    if env.get("NVIDIA_VISIBLE_DEVICES", "").strip() in ("none", "void"):
        return 0, f"NVIDIA_VISIBLE_DEVICES={env['NVIDIA_VISIBLE_DEVICES'].strip()}"
    nodes = sorted(d for d in (dev_nodes() if devices is None else devices) if re.fullmatch(r"nvidia\d+", d))
    found, how = len(nodes), f"/dev/{', /dev/'.join(nodes)}" if nodes else ""
    if not found:
        found, how = smi(), "nvidia-smi -L"
    if not found:
        return 0, "no /dev/nvidiaN and no GPU from nvidia-smi -L"
    if "CUDA_VISIBLE_DEVICES" in env:
        return cuda_visible_count(env["CUDA_VISIBLE_DEVICES"]), f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    return found, how


def _checked(value: str, origin: str) -> str:
    value = value.strip()
    if value in NAMED or (re.fullmatch(r"\d+", value) and int(value) > 0):
        return value
    raise LaunchError(f"{origin}={value!r} is not a positive whole number, auto, cpu or gpu")


def nproc_per_node(env: Mapping[str, str], topo: Topology,
                   gpus: Callable[[], tuple[int, str]]) -> tuple[str, str]:
    """torchrun's --nproc_per_node and why."""
    override = env.get("PYTORCH_CUDA_NPROC_PER_NODE", "").strip()
    if override:
        value, why = _checked(override, "PYTORCH_CUDA_NPROC_PER_NODE"), "PYTORCH_CUDA_NPROC_PER_NODE"
    elif topo.nproc is not None and topo.nproc_from is not None:
        if topo.nproc == "0" and topo.nproc_from == "SLURM_GPUS_ON_NODE":
            return "1", "SLURM_GPUS_ON_NODE=0: one CPU rank"
        value, why = _checked(topo.nproc, topo.nproc_from), f"{topo.nproc_from}={topo.nproc}"
    else:
        value, why = "auto", "no count given"
    if value != "auto":
        return value, why
    n, how = gpus()
    if n:
        return "auto", f"{why}: one rank per GPU torch sees ({n} seen: {how})"
    return "1", f"{why}: one CPU rank, no GPU ({how})"
