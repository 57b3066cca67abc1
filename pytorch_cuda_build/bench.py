"""Benchmarks: measure and report, never assert. Reports go to build-results/bench/.

`banner`: container start-up with and without the banner (`docker run --rm IMAGE true`),
interleaved so drift in the machine's load hits both sides alike.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from .matrix import Image


def _time_run(ref: str, env: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["docker", "run", "--rm", *env, ref, "true"], check=True, capture_output=True, timeout=120)
    return time.perf_counter() - t0


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def banner(image: Image, ref: str, runs: int, out_dir: Path) -> dict:
    _time_run(ref, [])  # warm the page cache and the daemon
    on, off = [], []
    for _ in range(runs):
        on.append(_time_run(ref, []))
        off.append(_time_run(ref, ["-e", "PYTORCH_CUDA_NO_BANNER=1"]))
    result = {
        "benchmark": "banner start-up", "image": image.name, "ref": ref, "runs": runs,
        "with_banner_s": stats(on), "without_banner_s": stats(off),
        "median_overhead_s": statistics.median(on) - statistics.median(off),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "banner.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "banner.md").write_text(markdown(result))
    return result


def markdown(r: dict) -> str:
    rows = ["| `docker run --rm IMAGE true` | median s | min s | max s |", "|---|---|---|---|"]
    for label, key in (("banner on", "with_banner_s"), ("banner off", "without_banner_s")):
        s = r[key]
        rows.append(f"| {label} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    return (f"Banner start-up overhead for `{r['ref']}`, {r['runs']} interleaved runs each: "
            f"**{r['median_overhead_s'] * 1000:.0f} ms** (median difference)\n\n" + "\n".join(rows) + "\n")
