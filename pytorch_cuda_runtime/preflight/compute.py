"""Phase 1's compute check: on each GPU a bf16 matmul of fixed size and seed, its speed and its result.

The node's process runs `python -m pytorch_cuda_runtime.preflight.compute` as a child (torch is
imported there, never in the node's process), bounded by --gpu-timeout (60 s): the GPU part of a
node, NVML's queries included, ends within it. For each GPU torch sees, in turn:

  - A and B, SIZE x SIZE bf16 from torch.Generator().manual_seed(SEED) on the CPU, copied to it;
  - C = A @ B once; its checksum: C's bf16 bit patterns as integers, weighted by position
    (i mod 65521 + 1) and summed in int64 on the GPU: exact and independent of the order of the
    sum, so two GPUs that computed the same C give the same checksum, and a swapped or flipped
    element changes it;
  - WARMUP products, then REPEATS timed with CUDA events: TFLOP/s = 2 SIZE^3 REPEATS / seconds;
  - while the timed products run, the PCIe link's generation and width against their maxima
    (NVML; the driver lowers an idle link's speed and width, so it is read under load only).

The judgement across every GPU of the job (the roll call's first node holds every node's
results) is judge(), pure: a GPU under --peak-ratio x its product's dense bf16 peak
(gpupeaks.py; an unknown product gets no ratio, and its row says so), under --gpu-slow-ratio x
the job's median GPU of the same product, or whose checksum differs from the majority of the
same product's GPUs, is named.

Stand-in GPUs (standin.py) whose entries carry a "tflops" figure stand in for the measurement
alone: that figure is their speed, their product is one of small integers in plain Python (no
torch where the tests run) with the same weighted checksum, and "corrupt": true flips one bit of
it. Everything after the measurement (the PCIe reading through the fake NVML, the roll call's
judgement, the lines, the table, the report) is the code a GPU runs. The source says "stand-in".
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

from .. import gpupeaks
from . import health, standin

SIZE = 8192  # 2 * 8192**3 = 1.1 TFLOP a product: launch overheads stay far below its time
SEED = 0
WARMUP = 3  # cuBLAS picks its kernel and the clocks rise
REPEATS = 20
STANDIN_SIZE = 128
GPU_TIMEOUT_S = 60.0
SLOW_RATIO = 0.8  # healthy GPUs of one product run a large matmul within a few percent of each other
PEAK_RATIO = 0.4  # cuBLAS reaches well over half the dense peak on a large square bf16 product
WEIGHT_MOD = 65521


def checksum(torch: Any, c: Any) -> str:
    flat = c.reshape(-1).view(torch.int16).to(torch.int64)
    weights = torch.arange(flat.numel(), device=c.device, dtype=torch.int64) % WEIGHT_MOD + 1
    return f"{int((flat * weights).sum().item()) & (2**64 - 1):016x}"


def inputs(torch: Any, size: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, size, generator=g).to(torch.bfloat16),
            torch.randn(size, size, generator=g).to(torch.bfloat16))


def pcie(nv: Any, handle: Any) -> list[int]:
    return [int(nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)), int(nv.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
            int(nv.nvmlDeviceGetCurrPcieLinkWidth(handle)), int(nv.nvmlDeviceGetMaxPcieLinkWidth(handle))]


def nvml_device(nv: Any, uuid: str | None, index: int | None) -> tuple[Any, int | None, str | None]:
    """(handle, NVML index, serial) of the GPU whose UUID torch gives (or, for stand-ins, of index)."""
    if nv is None:
        return None, None, None
    for i in range(int(nv.nvmlDeviceGetCount())):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        if i == index or (uuid and health.text(nv.nvmlDeviceGetUUID(h)).removeprefix("GPU-") == uuid.removeprefix("GPU-")):
            try:
                serial = health.text(nv.nvmlDeviceGetSerial(h))
            except nv.NVMLError:
                serial = None
            return h, i, serial
    return None, None, None


def one_gpu(torch: Any, nv: Any, index: int, a: Any, b: Any, repeats: int) -> dict[str, Any]:
    """A CUDA device's figures: the product's checksum, TFLOP/s, the PCIe link read under load."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    handle, nvml_index, serial = nvml_device(nv, str(uuid) if uuid is not None else None, None)
    row: dict[str, Any] = {"cuda": index, "gpu": nvml_index if nvml_index is not None else index, "serial": serial,
                           "name": props.name, "pcie": None, "pcie_unread": None}
    with torch.cuda.device(index):
        a, b = a.to("cuda"), b.to("cuda")
        row["checksum"] = checksum(torch, a @ b)
        for _ in range(WARMUP):
            a @ b
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        row["pcie"], row["pcie_unread"] = _pcie_under_load(nv, handle)
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
    row["tflops"] = 2 * a.shape[0] ** 3 * repeats / seconds / 1e12
    return row


def _pcie_under_load(nv: Any, handle: Any) -> tuple[list[int] | None, str | None]:
    if handle is None:
        return None, "no NVML device with this GPU's UUID" if nv is not None else "no NVML"
    try:
        return pcie(nv, handle), None
    except nv.NVMLError as e:
        return None, health.text(e)


def standin_product(seed: int, size: int = STANDIN_SIZE) -> list[list[int]]:
    """The stand-ins' product, in plain Python on small integers (no torch needed where tests run)."""
    rng = random.Random(seed)
    a = [[rng.randrange(-8, 8) for _ in range(size)] for _ in range(size)]
    b = [[rng.randrange(-8, 8) for _ in range(size)] for _ in range(size)]
    columns = list(zip(*b))
    return [[sum(x * y for x, y in zip(row, col)) for col in columns] for row in a]


def int_checksum(values: list[int]) -> str:
    """checksum()'s weighted sum, over plain integers."""
    return f"{sum(v * (i % WEIGHT_MOD + 1) for i, v in enumerate(values)) & (2**64 - 1):016x}"


def standin_gpu(nv: Any, index: int, entry: dict[str, Any], product: list[list[int]]) -> dict[str, Any]:
    """A stand-in GPU: the stand-ins' product and its checksum, the entry's speed and corruption."""
    handle, nvml_index, serial = nvml_device(nv, None, index)
    flat = [v for row in product for v in row]
    if entry.get("corrupt"):
        flat[0] ^= 1  # one bit of one element: what silent corruption looks like
    row = {"cuda": index, "gpu": index, "serial": serial or entry.get("serial"), "name": entry["name"],
           "checksum": int_checksum(flat), "tflops": float(entry["tflops"])}
    row["pcie"], row["pcie_unread"] = _pcie_under_load(nv, handle)
    return row


def run(env: dict[str, str], node: str, size: int, seed: int) -> dict[str, Any]:
    """This node's figures: {"gpus": [...], "skipped": why or None, ...}."""
    rows = standin.rows(env, node)
    out: dict[str, Any] = {"size": size, "seed": seed, "repeats": REPEATS, "gpus": [], "skipped": None}
    if rows is not None:
        todo = [(i, r) for i, r in enumerate(rows) if "tflops" in r]
        out.update(source=f"{standin.source(env)}: figures from the file, product on the CPU", size=STANDIN_SIZE)
        if not todo:
            out["skipped"] = "stand-in GPUs without a compute figure (\"tflops\")"
            return out
        nv, _ = health.load(env, node)
        product = standin_product(seed)
        out["gpus"] = [standin_gpu(nv, i, r, product) for i, r in todo]
        return out
    import torch  # here: the node's process never imports torch

    if not torch.cuda.is_available():
        out["skipped"] = "torch sees no CUDA device"
        return out
    nv, _ = health.load(env, node)
    out["source"] = f"torch {torch.__version__}, cuBLAS"
    a, b = inputs(torch, size, seed)
    for i in range(torch.cuda.device_count()):
        t0 = time.monotonic()
        try:
            out["gpus"].append({**one_gpu(torch, nv, i, a, b, REPEATS), "seconds": round(time.monotonic() - t0, 2)})
        except Exception as e:  # a CUDA error on this GPU: named, and the others still measured
            out["gpus"].append({"cuda": i, "gpu": i, "serial": None, "name": "?",
                                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
    return out


# ---- the judgement

def local(result: dict[str, Any]) -> list[health.Finding]:
    """What one node judges alone: a GPU whose matmul failed, a PCIe link below its maximum under load."""
    out = []
    for g in result.get("gpus", []):
        who = health.label(g["gpu"], g.get("serial"))
        if g.get("error"):
            out.append(health.Finding("compute", who, f"the bf16 matmul failed: {g['error']}"))
        link = g.get("pcie")
        if link and (link[0] < link[1] or link[2] < link[3]):
            out.append(health.Finding("pcie", who, f"PCIe link gen {link[0]} x{link[2]} under load, below its maximum "
                                                   f"gen {link[1]} x{link[3]}"))
    return out


def judge(per_node: dict[str, dict[str, Any]], slow_ratio: float = SLOW_RATIO,
          peak_ratio: float = PEAK_RATIO) -> tuple[list[tuple[str, health.Finding]], list[dict[str, Any]]]:
    """Every GPU of the job: [(node, finding)], and the table's rows."""
    rows = [{"node": n, **g} for n, r in per_node.items() for g in r.get("gpus", []) if g.get("tflops") is not None]
    found: list[tuple[str, health.Finding]] = []
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    for name, group in by_name.items():
        median = statistics.median(r["tflops"] for r in group)
        top = gpupeaks.lookup(name)
        counts = Counter(r["checksum"] for r in group)
        majority, held = counts.most_common(1)[0]
        for r in group:
            who = health.label(r["gpu"], r.get("serial"))
            r["x_median"] = r["tflops"] / median if median else None
            r["x_peak"] = r["tflops"] / top.tflops if top else None
            r["peak"] = f"{top.tflops:g} ({top.product})" if top else f"none recorded for {name}: no ratio"
            if top and r["tflops"] < peak_ratio * top.tflops:
                found.append((r["node"], health.Finding("compute-peak", who, f"{r['tflops']:.1f} TFLOP/s bf16, "
                              f"{r['x_peak']:.2f} x the {top.product}'s dense bf16 peak {top.tflops:g}, under {peak_ratio:g} x")))
            if len(group) > 1 and r["tflops"] < slow_ratio * median:
                found.append((r["node"], health.Finding("compute-slow", who, f"slow: {r['tflops']:.1f} TFLOP/s bf16, under "
                              f"{slow_ratio:g} x the job's median {median:.1f} of {len(group)} {name} GPU(s)")))
            if len(counts) > 1 and (r["checksum"] != majority or held * 2 <= len(group)):
                why = (f"the majority's ({held} of {len(group)} {name} GPUs) is {majority}" if held * 2 > len(group)
                       else f"no checksum is held by a majority of the {len(group)} {name} GPUs, so which is wrong "
                            "cannot be told")
                found.append((r["node"], health.Finding("compute-checksum", who, f"the bf16 matmul's result differs: "
                              f"checksum {r['checksum']}; {why}")))
    return found, rows


def table(rows: list[dict[str, Any]], notes: list[str], size: int, seed: int) -> list[str]:
    """The GPU part as printed: one row per GPU with its figures and the checks it failed, then the notes."""
    head = [f"# GPUs: health through NVML; bf16 matmul {size}x{size} (seed {seed}), {REPEATS} timed products after "
            f"{WARMUP} warm-up",
            f"#{'node':>16}  {'gpu':>3}  {'serial':>14}  {'product':<24}  {'TFLOP/s':>8}  {'x peak':>6}  {'x median':>8}  "
            f"{'checksum':>16}  checks failed (or warned)"]
    body = []
    for r in rows:
        speed = f"{r['tflops']:.1f}" if r.get("tflops") is not None else "-"
        body.append(f" {r['node']:>16}  {r['gpu']:>3}  {r.get('serial') or '?':>14}  {str(r.get('name') or '?')[:24]:<24}  "
                    f"{speed:>8}  {_ratio(r.get('x_peak')):>6}  {_ratio(r.get('x_median')):>8}  "
                    f"{r.get('checksum') or '-':>16}  {', '.join(r.get('failed', [])) or 'none'}")
    return head + body + [f"# {n}" for n in notes]


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytorch_cuda_runtime.preflight.compute")
    p.add_argument("--node", required=True)
    p.add_argument("--size", type=int, default=SIZE)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = run(dict(os.environ), a.node, a.size, a.seed)
    with open(a.out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
