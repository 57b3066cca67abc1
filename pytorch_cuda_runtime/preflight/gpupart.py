"""Phase 1's GPU part on each node, and its judgement across the job at the roll call.

On a node whose job requested GPUs: the health checks (health.py, NVML, no torch), then the
compute check's child (compute.py, torch), both within --gpu-timeout (60 s) together. A node
judges its own GPUs' health and PCIe links; the roll call's first node, which holds every node's
results, judges the compute figures across the job (compute.judge). Each finding is a line naming
the node, the GPU (index and serial), the fault and its check; a check named in --warn
(PYTORCH_CUDA_PREFLIGHT_WARN) gives a warning line instead, and the preflight goes on.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from . import compute, fakenvml, health, rollcall, standin


@dataclass(frozen=True)
class Options:
    timeout_s: float = compute.GPU_TIMEOUT_S
    size: int = compute.SIZE
    seed: int = compute.SEED
    slow_ratio: float = compute.SLOW_RATIO
    peak_ratio: float = compute.PEAK_RATIO
    warn: frozenset[str] = frozenset()


def run(env: dict[str, str], node: str, listed: bool, requested: int, opts: Options) -> dict[str, Any]:
    """This node's GPU part: {"health", "compute", "findings", "skipped"}; findings as dicts."""
    if not requested:
        return {"skipped": "the job requested no GPUs", "findings": []}
    if not listed:
        return {"skipped": "no GPU listed (the node check names it)", "findings": []}
    deadline = time.monotonic() + opts.timeout_s
    if standin.rows(env, node) is not None and not env.get(fakenvml.VARIABLE):
        record: dict[str, Any] = {"skipped": f"stand-in GPUs have no driver to ask (the fake NVML, {fakenvml.VARIABLE}, "
                                             "is not set)", "gpus": []}
    else:
        gpus, source = health.read(env, node)
        record = health.summary(gpus, source) if gpus is not None else {"skipped": source, "gpus": []}
    found = [health.Finding(**f) for g in record["gpus"] for f in g["findings"]]
    figures = compute_child(env, node, opts, deadline - time.monotonic())
    found += compute.local(figures)
    return {"health": record, "compute": figures, "findings": [asdict(f) for f in found], "skipped": None}


def compute_child(env: dict[str, str], node: str, opts: Options, left_s: float) -> dict[str, Any]:
    """compute.py's figures, or a record whose error says why there are none (its bound, its exit)."""
    bound = left_s
    if bound <= 0:
        return _failed(f"the health checks took the GPU part's whole bound ({opts.timeout_s:g} s, --gpu-timeout): no "
                       "time left for the compute check")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-preflight-gpu-") as tmp:
        out = os.path.join(tmp, "compute.json")
        argv = [sys.executable, "-m", "pytorch_cuda_runtime.preflight.compute", "--node", node, "--size", str(opts.size),
                "--seed", str(opts.seed), "--out", out]
        with open(os.path.join(tmp, "log"), "w+", encoding="utf-8") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                _stop(proc)
                return _failed(f"the compute check did not end within the GPU part's bound ({opts.timeout_s:g} s, "
                               "--gpu-timeout) and was stopped")
            except BaseException:
                _stop(proc)
                raise
            log.seek(0)
            lines = [ln.strip() for ln in log if ln.strip()]
        try:
            with open(out, encoding="utf-8") as f:
                figures: dict[str, Any] = json.load(f)
            return figures
        except (OSError, ValueError):
            return _failed(f"the compute check ended (exit {rc}) without figures: {lines[-1][:200] if lines else 'no output'}")


def _failed(why: str) -> dict[str, Any]:
    return {"gpus": [], "skipped": None, "error": why}


def _stop(proc: subprocess.Popen[Any], grace: float = 5) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def node_lines(part: dict[str, Any], warn: frozenset[str]) -> tuple[list[str], list[str]]:
    """(failure lines, warning lines) of this node's own judgement: health, PCIe, a failed matmul."""
    fails, warns = health.split([health.Finding(**f) for f in part.get("findings", [])], warn)
    error = (part.get("compute") or {}).get("error")
    if error:
        (warns if "compute" in warn else fails).append(f"GPUs: {error} [compute]")
    return fails, warns


def job_verdict(results: dict[str, dict[str, Any]], opts: Options) -> dict[str, Any]:
    """The roll call's judgement of every node's GPU part: lines and warnings (labelled with their
    node), the table's rows, and the record for the report."""
    parts = {n: r.get("gpu") or {} for n, r in results.items()}
    figures = {n: p["compute"] for n, p in parts.items() if p.get("compute")}
    found, rows = compute.judge(figures, opts.slow_ratio, opts.peak_ratio)
    lines: list[str] = []
    warnings: list[str] = []
    for node, f in found:
        (warnings if f.check in opts.warn else lines).append(f"{rollcall.label(node)}: {f.line()} [{f.check}]")
    failed: dict[tuple[str, str], list[str]] = {}
    for node, f in [*found, *((n, health.Finding(**f)) for n, p in parts.items() for f in p.get("findings", []))]:
        failed.setdefault((node, f.gpu), []).append(f.check + (" (warning)" if f.check in opts.warn else ""))
    table_rows = _rows(parts, rows, failed)
    notes = [f"{rollcall.label(n)}: GPU part skipped: {p['skipped']}" for n, p in parts.items() if p.get("skipped")]
    notes += [f"{rollcall.label(n)}: health not read: {p['health']['skipped']}" for n, p in parts.items()
              if (p.get("health") or {}).get("skipped")]
    notes += [f"{rollcall.label(n)}: compute check skipped: {p['compute']['skipped']}" for n, p in parts.items()
              if (p.get("compute") or {}).get("skipped")]
    notes += [f"{rollcall.label(n)}: compute figures from {p['compute']['source']}" for n, p in parts.items()
              if (p.get("compute") or {}).get("source") and (p.get("compute") or {}).get("gpus")]
    notes += [f"{rollcall.label(r['node'])}: GPU {r['gpu']}: {note}" for r in table_rows for note in r.get("notes", [])]
    notes += sorted({f"{r['name']}: no dense bf16 peak recorded (gpupeaks.py): no ratio" for r in rows
                     if r.get("x_peak") is None})
    return {"lines": lines, "warnings": warnings,
            "record": {"rows": table_rows, "notes": notes, "nodes": parts, "warn": sorted(opts.warn),
                       "slow_ratio": opts.slow_ratio, "peak_ratio": opts.peak_ratio,
                       "size": next((f["size"] for f in figures.values() if "size" in f), opts.size), "seed": opts.seed}}


def _rows(parts: dict[str, dict[str, Any]], figures: list[dict[str, Any]],
          failed: dict[tuple[str, str], list[str]]) -> list[dict[str, Any]]:
    """One row per GPU of the job: its health (where read) and its compute figures (where measured)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for node, part in parts.items():
        for g in (part.get("health") or {}).get("gpus", []):
            out[(node, g["index"])] = {"node": node, "gpu": g["index"], "serial": g.get("serial"), "name": g.get("name"),
                                       "notes": g.get("notes", [])}
    for r in figures:
        keep = {k: r[k] for k in ("serial", "name", "tflops", "x_peak", "x_median", "checksum", "peak") if k in r}
        row = out.setdefault((r["node"], r["gpu"]), {"node": r["node"], "gpu": r["gpu"], "notes": []})
        row.update({k: v for k, v in keep.items() if v is not None or k not in row})
    for (node, _), row in out.items():
        row["failed"] = sorted(set(failed.get((node, health.label(row["gpu"], row.get("serial"))), [])))
    return list(out.values())
