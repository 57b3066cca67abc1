"""Phase 1: this node's facts (read as the banner reads them) and the checks against what the row
and the job need. Facts in, lines out: check() is pure, the unit tests drive it.

The row's needs come from the image's manifest: driver_min (the floor of its CUDA platform),
cuda_arch_list (what torch is built for, torch-facts.json) and ops_arch_list (what the prebuilt
DeepSpeed ops are built for, ops-facts.json). The job's come from the options `build.py job`
writes: GPUs per node, /dev/shm's size, and whether it asked for RDMA.
"""
from __future__ import annotations

import re
import resource
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from .. import banner
from .. import manifest as mf
from ..launch import nproc
from . import standin

CAP_IPC_LOCK = 14  # linux/capability.h: mlock beyond RLIMIT_MEMLOCK


@dataclass
class Facts:
    """What one node shows. gpus None: no driver answered (nvidia-smi absent or failing)."""
    node: str
    gpus: list[tuple[str, str, str]] | None
    gpu_source: str
    device_nodes: list[str]
    cuda_visible: str | None
    shm_bytes: int | None
    memlock: int  # RLIMIT_MEMLOCK's soft limit in bytes, resource.RLIM_INFINITY for unlimited
    ipc_lock: bool
    ib_names: list[str]
    ib_passed: bool
    ib_disabled: bool  # NCCL_IB_DISABLE=1


@dataclass
class Needs:
    gpus_per_node: int = 0
    shm_bytes: int = banner.SHM_MIN_BYTES
    rdma: bool = False
    manifest: dict = field(default_factory=dict)


def hostname():
    return socket.gethostname().split(".")[0]


def has_ipc_lock(status="/proc/self/status"):
    try:
        with open(status, encoding="ascii") as f:
            line = next((ln for ln in f if ln.startswith("CapEff:")), "CapEff: 0")
    except OSError:
        return False
    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)


def query_without_cap(timeout=10, run=subprocess.run):
    """[(name, driver, '?')] from an nvidia-smi that lacks the compute_cap field (drivers before
    R510 refuse the banner's query as a whole), or None where nvidia-smi is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                  capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [(f[0], f[1], "?") for f in (line.split(", ") for line in out.stdout.splitlines()) if len(f) >= 2 and f[0]]


def gather(env, node=None):
    """This node's facts: stand-in GPUs where the test hook names them, else nvidia-smi's (an old
    driver's nvidia-smi answers without the compute capability)."""
    node = node or hostname()
    fake = standin.gpus(env, node)
    if fake is not None:
        gpus, source = fake, standin.source(env)
    else:
        gpus, source = banner.query_gpus(timeout=10), "nvidia-smi"
        gpus = gpus if gpus is not None else query_without_cap()
    names, passed = banner.ib_devices()
    return Facts(node=node, gpus=gpus, gpu_source=source,
                 device_nodes=sorted(d for d in nproc.dev_nodes() if re.fullmatch(r"nvidia\d+", d)),
                 cuda_visible=env.get("CUDA_VISIBLE_DEVICES"), shm_bytes=banner.shm_bytes(),
                 memlock=resource.getrlimit(resource.RLIMIT_MEMLOCK)[0], ipc_lock=has_ipc_lock(),
                 ib_names=names, ib_passed=passed, ib_disabled=env.get("NCCL_IB_DISABLE", "").strip() == "1")


def visible(f):
    """GPUs the ranks can use: what the driver lists, narrowed by CUDA_VISIBLE_DEVICES."""
    n = len(f.gpus or [])
    return min(n, nproc.cuda_visible_count(f.cuda_visible)) if f.cuda_visible is not None else n


def ops_archs(text):
    """TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX') as arch names ('sm_80', 'sm_90', 'compute_90')."""
    out = []
    for item in filter(None, (t.strip() for t in (text or "").replace(" ", ";").split(";"))):
        num = item.removesuffix("+PTX").replace(".", "")
        out.append(f"sm_{num}")
        if item.endswith("+PTX"):
            out.append(f"compute_{num.rstrip('a')}")
    return out


def mib(n):
    return f"{n / (1 << 20):.0f} MiB"


def check(f, needs):
    """The problems of one node, each one line: what it found, what the row or the job needs."""
    return [*_gpus(f, needs), *_driver(f, needs.manifest), *_archs(f, needs.manifest), *_shm(f, needs), *_rdma(f, needs)]


def _gpus(f, needs):
    want = needs.gpus_per_node
    if not want:
        return []
    if f.gpus is None:
        dev = ", ".join(f"/dev/{d}" for d in f.device_nodes) or "no /dev/nvidiaN"
        return [f"no GPU driver answers (nvidia-smi absent or failing; {dev}): the job requested {want} GPUs per node"]
    seen = visible(f)
    if seen < want:
        narrowed = f", CUDA_VISIBLE_DEVICES={f.cuda_visible!r}" if f.cuda_visible is not None else ""
        return [f"{seen} GPU{'s' if seen != 1 else ''} visible ({f.gpu_source}: {len(f.gpus)} listed{narrowed}), "
                f"the job requested {want} per node"]
    return []


def _driver(f, m):
    floor = m.get("driver_min")
    drivers = sorted({d for _, d, _ in f.gpus or []})
    old = [d for d in drivers if floor and mf.release(d) < mf.release(floor)]
    if not old:
        return []
    plat, runtime = m.get("cuda_platform", "?"), m.get("torch_cuda", "?")
    return [f"driver {old[0]} ({f.gpu_source}) is older than {floor}, the floor of this image's CUDA {plat} platform "
            f"(torch's CUDA {runtime} runtime): CUDA would fail at first use (error 35, cudaErrorInsufficientDriver). Upgrade the node's "
            f"driver to {floor} or newer; on a data-center GPU, CUDA forward compatibility (NVIDIA's cuda-compat "
            f"package for CUDA {runtime}, first on LD_LIBRARY_PATH) runs it on an older driver branch it supports"]


def _archs(f, m):
    lists = [("torch", m.get("cuda_arch_list"))]
    if m.get("ops_accelerator") == "cuda" and m.get("prebuilt_ops"):
        lists.append(("the prebuilt DeepSpeed ops", ops_archs(m.get("ops_arch_list"))))
    out = []
    for i, (name, _, cap) in enumerate(f.gpus or []):
        if not re.fullmatch(r"\d+\.\d+", cap.strip()):
            continue  # the driver did not say; nothing to compare
        for who, archs in lists:
            if archs:
                ok, how = mf.arch_supported(cap, archs)
                if not ok:
                    out.append(f"GPU {i} ({name}, compute capability {cap.strip()}, {f.gpu_source}): {how}: {who} "
                               "in this image has no code for it; use a row built for this GPU")
    return out


def _shm(f, needs):
    if f.shm_bytes is None or f.shm_bytes >= needs.shm_bytes:
        return []
    return [f"/dev/shm is {mib(f.shm_bytes)}, the job needs {mib(needs.shm_bytes)} (NCCL's and the data loaders' "
            "shared memory): give the container a larger /dev/shm (--shm-size, --ipc=host, the node's tmpfs)"]


def uses_rdma(f, needs):
    """RDMA is in use where the job asked for it, or where NCCL finds devices passed in and may use them."""
    return needs.rdma or (bool(f.ib_names) and f.ib_passed and not f.ib_disabled)


def _rdma(f, needs):
    out = []
    if needs.rdma and not (f.ib_names and f.ib_passed):
        found = (f"{', '.join(f.ib_names)} in /sys/class/infiniband but /dev/infiniband not passed in"
                 if f.ib_names else "no device in /sys/class/infiniband")
        out.append(f"the job asked for RDMA but {found}: request the node's RDMA device resource and "
                   "pass /dev/infiniband into the container")
    if uses_rdma(f, needs) and f.memlock != resource.RLIM_INFINITY and not f.ipc_lock:
        out.append(f"locked-memory limit {f.memlock // 1024} KiB (ulimit -l) and no CAP_IPC_LOCK, where RDMA is used: "
                   "NCCL registers (pins) its buffers with the RDMA device and needs it unlimited; set `ulimit -l "
                   "unlimited` for the job (Slurm: the nodes' limits and PropagateResourceLimits) or grant IPC_LOCK")
    return out


def summary(f, needs):
    """One line of what the node shows, for the log and the report."""
    gpus = ("no GPU driver answers" if f.gpus is None else
            f"{visible(f)} GPU(s) via {f.gpu_source}" + (f": {f.gpus[0][0]}, driver {f.gpus[0][1]}, "
                                                         f"compute capability {f.gpus[0][2]}" if f.gpus else ""))
    shm = mib(f.shm_bytes) if f.shm_bytes is not None else "?"
    lock = "unlimited" if f.memlock == resource.RLIM_INFINITY else f"{f.memlock // 1024} KiB"
    rdma = ", ".join(f.ib_names) if f.ib_names else "none"
    return (f"node {f.node}: {gpus}; /dev/shm {shm}; memlock {lock}{' (CAP_IPC_LOCK)' if f.ipc_lock else ''}; "
            f"RDMA devices {rdma}{'' if f.ib_passed or not f.ib_names else ' (not passed in)'}; "
            f"requested {needs.gpus_per_node} GPU(s) per node")
