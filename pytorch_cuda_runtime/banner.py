"""Start-up banner and preflight warnings, printed to stderr on container start.

Must not import torch (it costs seconds): versions come from the baked manifest,
GPUs from nvidia-smi (mounted by the NVIDIA runtime). Must never fail the
container start: main() catches everything.
"""
import os
import shutil
import subprocess
import sys

from . import manifest as mf
from . import stack

SHM_MIN_BYTES = 1 << 30
SMI_TIMEOUT_S = 5


def query_gpus(timeout=SMI_TIMEOUT_S):
    """[(name, driver, compute_cap)] or None when nvidia-smi is absent/fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return parse_smi(out.stdout)


def parse_smi(text):
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 3 and fields[0]:
            gpus.append((fields[0], fields[1], fields[2]))
    return gpus


def shm_bytes(path="/dev/shm"):
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def version_lines(m):
    return [
        f"== pytorch-cuda {m.get('image', '?')} ({m.get('os', '?')}) ==",
        f"torch {m.get('torch', '?')} | CUDA platform {m.get('cuda_platform', '?')}, "
        f"torch.version.cuda {m.get('torch_cuda', '?')} | cuDNN {m.get('cudnn', '?')} | "
        f"NCCL {m.get('nccl', '?')}",
        f"DeepSpeed {m.get('deepspeed', '-')} | Python {m.get('python', '?')}",
        ops_line(m),
    ]


def ops_line(m):
    """Which DeepSpeed ops are prebuilt, for what, and with which compiler: a minor version
    other than torch's CUDA is said as openly as the platform/wheel difference above."""
    ops = ", ".join(m.get("prebuilt_ops") or []) or "none"
    toolkit = m.get("cuda_toolkit") or "?"
    same = ".".join(toolkit.split(".")[:2]) == m.get("torch_cuda")
    note = "" if same else f" (torch's is {m.get('torch_cuda', '?')}; same major, accepted by torch and DeepSpeed)"
    return (f"DeepSpeed ops prebuilt for {m.get('ops_accelerator', '?')}: {ops} | built with CUDA {toolkit}{note} "
            f"for {m.get('ops_arch_list', '?')}")


def gpu_lines(gpus):
    return [f"GPU {i}: {name}, driver {drv}, compute capability {cap}"
            for i, (name, drv, cap) in enumerate(gpus)]


def warnings_for(m, gpus, shm):
    """Preflight warnings, each with its fix. Pure: unit-testable."""
    warns = []
    if not gpus:
        warns.append("no GPU visible. Run with the NVIDIA runtime: "
                     "`docker run --gpus all ...` (needs the NVIDIA Container Toolkit).")
    driver_min = m.get("driver_min")
    for i, (name, drv, cap) in enumerate(gpus or []):
        if driver_min and mf.release(drv) < mf.release(driver_min):
            warns.append(f"GPU {i} driver {drv} is older than {driver_min}, the minimum for "
                         f"CUDA {m.get('cuda_platform', '?')}. Upgrade the host driver or use "
                         f"an image row for an older CUDA platform.")
        archs = m.get("cuda_arch_list")
        if archs:
            ok, how = mf.arch_supported(cap, archs)
            if not ok:
                warns.append(f"GPU {i} ({name}): {how}: torch has no kernels for it. "
                             f"Use an image row whose torch supports this GPU.")
    if shm is not None and shm < SHM_MIN_BYTES:
        warns.append(f"/dev/shm is {shm // (1 << 20)} MiB (< 1 GiB): NCCL and DataLoader "
                     f"workers may fail. Run with `--ipc=host` or `--shm-size=8g`.")
    return warns


def ib_devices(sysfs="/sys/class/infiniband", dev="/dev/infiniband"):
    """RDMA devices NCCL can use: the host's HCAs (sysfs) and whether their device files were passed in."""
    try:
        names = sorted(os.listdir(sysfs))
    except OSError:
        names = []
    return names, os.path.isdir(dev) and bool(os.listdir(dev))


def ib_line(names, passed):
    if names and passed:
        return f"InfiniBand/RoCE: {', '.join(names)} (NCCL uses them through rdma-core's libibverbs)"
    if names:
        return (f"InfiniBand/RoCE: {', '.join(names)} present but /dev/infiniband not passed in: NCCL falls back "
                "to TCP sockets. Add `--device /dev/infiniband` (and `--cap-add IPC_LOCK`).")
    return "InfiniBand/RoCE: no devices visible (NCCL uses TCP sockets across nodes)"


def stack_changes():
    """What moved away from the tested stack (stack.py), or None where the image has no
    constraints file to compare with."""
    try:
        return stack.changes(stack.read(), stack.installed())
    except OSError:
        return None


def extend_line(moved):
    """How to add packages, and how the pinned stack is held (and lifted): the resolvers' own
    refusal cannot say it."""
    if moved is None:
        return []
    return [f"pip/uv install as any user; torch, triton, DeepSpeed and the CUDA wheels stay as tested "
            f"({stack.CONSTRAINTS}). To move one: {stack.HOW_TO_OVERRIDE}"]


def render(m, gpus, shm, ib=((), False), moved=None):
    lines = version_lines(m)
    lines += gpu_lines(gpus or [])
    lines.append(ib_line(*ib))
    lines += extend_line(moved)
    lines += [f"WARNING: {w}" for w in warnings_for(m, gpus, shm)]
    if moved:
        lines.append(f"WARNING: {stack.changed_line(moved)}")
    return "\n".join(lines)


def main():
    if os.environ.get("PYTORCH_CUDA_NO_BANNER") == "1":
        return 0
    try:
        try:
            m = mf.load()
        except (OSError, ValueError) as e:
            m = {}
            print(f"pytorch-cuda: manifest unreadable ({e})", file=sys.stderr)
        print(render(m, query_gpus(), shm_bytes(), ib_devices(), stack_changes()), file=sys.stderr)
    except Exception as e:  # never block the container start
        print(f"pytorch-cuda: banner skipped ({type(e).__name__}: {e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
