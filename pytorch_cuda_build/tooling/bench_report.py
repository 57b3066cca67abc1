"""`build.py bench`'s reports: the figures bench.py measured as markdown and SVG, and a run of some
measures merged into the last report (which keeps the others, and says which were re-measured)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..matrix import Image
from . import pullcost


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def markdown(r: dict) -> str:
    rows = ["| `docker run --rm IMAGE true` | median s | min s | max s |", "|---|---|---|---|"]
    for label, key in (("banner on", "with_banner_s"), ("banner off", "without_banner_s")):
        s = r[key]
        rows.append(f"| {label} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    return (f"Banner start-up overhead for `{r['ref']}`, {r['runs']} interleaved runs each: "
            f"**{r['median_overhead_s'] * 1000:.0f} ms** (median difference)\n\n" + "\n".join(rows) + "\n")


def svg_bars(title: str, unit: str, bars: list[tuple[str, float]]) -> str:
    """A small horizontal bar chart; no plotting library on the host."""
    width, left, row = 640, 230, 28
    top = max(v for _, v in bars) or 1
    h = 40 + row * len(bars)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<text x="8" y="18" font-weight="bold">{title}</text>']
    for k, (label, v) in enumerate(bars):
        y = 30 + k * row
        w = (width - left - 90) * v / top
        parts += [f'<text x="8" y="{y + 15}">{label}</text>',
                  f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{row - 8}" fill="#4c78a8"/>',
                  f'<text x="{left + w + 6:.1f}" y="{y + 15}">{v:.2f} {unit}</text>']
    return "\n".join(parts + ["</svg>"]) + "\n"


def platforms_markdown(r: dict) -> str:
    def fig(p: str, key: str) -> str:
        v = (r.get(p) or {}).get(key)
        return "not measured (cached)" if v is None and r.get(p) else "not measured" if v is None else f"{v:.0f} s"
    lines = [f"# arm64 beside amd64: {r['image']}", "",
             f"Measured {r['date']} {pullcost.at_commit(r)} on this {r['host']} machine ({r['cpus']} CPUs), by `python3 build.py bench --full --only arm64 "
             f"--torch {r['image'].split('-')[0]}`: build step times from each platform's last build that built, the gate's "
             "smoke run, and the arm64 image's size measured now. linux/arm64 ran under QEMU (user-mode emulation).", "",
             "| figure | linux/amd64 (native) | linux/arm64 (emulated) |", "|---|---|---|"]
    for key, label in (("build_s", "build: the steps that ran (steps from the cache not counted)"), ("apt_s", "  of which the base stage (apt)"),
                       ("python_env_s", "  of which the locked wheels (pip install)"), ("ops_s", "  of which the DeepSpeed op compile (nvcc)"),
                       ("cpu_ops_s", "  of which the CPU-accelerator ops (g++)"), ("smoke_s", "the gate's smoke run")):
        lines.append(f"| {label} | {fig('linux/amd64', key)} | {fig('linux/arm64', key)} |")
    for p in ("linux/amd64", "linux/arm64"):
        if r.get(p) and r[p].get("smoke_checks"):
            s = r[p]["smoke_checks"]
            lines.append(f"| smoke checks ({p}) | {s.get('PASS')} passed, {s.get('FAIL')} failed, {s.get('SKIPPED')} skipped | |")
    s = r["size"]
    lines += ["", f"linux/arm64 image size / floor: {s['image'] / 1e9:.2f} GB / {s['floor'] / 1e9:.2f} GB (base OS + Python "
              f"{s['base_os_python'] / 1e9:.2f} + locked env {s['locked_env'] / 1e9:.2f}) = **{s['ratio_to_floor']:.3f}x** (target <= 1.03x).", ""]
    lines += [f"- {p}: {r[p]['log']} ({r[p]['log_time']})" if r.get(p) else f"- {p}: no build that built here" for p in ("linux/amd64", "linux/arm64")]
    return "\n".join(lines) + "\n"


def save_partial(path: Path, r: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**r, "partial": True}, indent=2) + "\n")


def previous(path: Path, image: Image, key: str) -> Any:
    """One figure of the last full report for this image, or None."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return old.get(key) if old.get("image") == image.name else None


def merge_previous(path: Path, r: dict, only: set[str], complete: bool) -> dict:
    """A run of some measures keeps the last report's figures for the others, and says so;
    a run of every measure (complete) replaces the report."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return r
    # The pull measure builds rows of its own, whatever --torch names: it joins the report of
    # any row instead of starting another row's report with nothing but itself.
    row_free = only <= {"pull"}
    if (old.get("image") != r["image"] and not row_free) or complete:
        return r
    first = old.get("measured_first", old["date"])
    # the first run's date and commit stay the report's; each later one is listed with its own
    merged = {**old, **r, "image": old["image"], "date": first, "commit": old.get("commit"), "measured_first": first,
              "updated": [*old.get("updated", []), {"date": r["date"], "commit": r.get("commit"), "measures": sorted(only)}]}
    # Two measures fill "size": size (the image, its floor) and cold (the naive images).
    merged["size"] = {**old.get("size", {}), **r.get("size", {})}
    return merged


def row_stats(d: dict) -> str:
    return f"{d['median']:.2f} | {d['min']:.2f} | {d['max']:.2f} | {d['n']}"


def report_markdown(r: dict) -> str:
    lines = [f"# Benchmark: {r['image']}", "", f"Measured {r['date']} {pullcost.at_commit(r)} on this machine ({r['cpus']} CPUs), by "
             "`python3 build.py bench --full`. Medians over repeated runs; ratios come from the same run.", ""]
    lines += [f"Re-measured {u['date']} {pullcost.at_commit(u)}: {', '.join(u['measures'])} (the other figures are from the first run)."
              for u in r.get("updated", [])]
    if r.get("updated"):
        lines.append("")
    lines += ["| measure | result | target | met |", "|---|---|---|---|"]
    if "image" in r.get("size", {}):
        s = r["size"]
        lines.append(f"| image size / floor ({s['image'] / 1e9:.2f} GB / {s['floor'] / 1e9:.2f} GB: base OS + Python {s['base_os_python'] / 1e9:.2f} + locked env {s['locked_env'] / 1e9:.2f}) | {s['ratio_to_floor']:.3f}x | <= 1.03x | {'yes' if s['ratio_to_floor'] <= 1.03 else 'no'} |")
        if "naive" in s:
            lines.append(f"| naive Dockerfile image (same base, one pip install) | {s['naive'] / 1e9:.2f} GB ({s['naive'] / s['floor']:.3f}x floor) | reported | - |")
        if "naive_ops" in s:
            lines.append(f"| naive DS_BUILD_* Dockerfile image (same base and toolkit .debs, ops prebuilt) | {s['naive_ops'] / 1e9:.2f} GB ({s['naive_ops'] / s['floor']:.3f}x floor) | reported | - |")
    if "train" in r and "image" in r.get("size", {}):
        lines += train_markdown(r["train"], r["size"]["image"])
    if "cold" in r:
        cd = r["cold"]
        med = statistics.median
        if not cd.get("naive_s"):  # a flavor other than the runtime: no naive baseline
            lines += cold_alone_markdown(cd)
        else:
            lines.append(f"| cold build, this tool / naive ({med(cd['ours_s']):.0f} s / {med(cd['naive_s']):.0f} s) | {cd['ratio_to_naive']:.2f}x | <= 1.3x | {'yes' if cd['ratio_to_naive'] <= 1.3 else 'no'} |")
            lines.append(f"| the same without the DeepSpeed op prebuild ({med(cd['ours_ops_s']):.0f} s, which naive does not do) | {cd['ratio_to_naive_without_ops']:.2f}x | - | {'yes' if cd['ratio_to_naive_without_ops'] <= 1.3 else 'no'} |")
            if "ratio_to_naive_ops" in cd:
                lines.append(f"| cold build, this tool / naive with the same ops via DS_BUILD_* ({med(cd['ours_s']):.0f} s / {med(cd['naive_ops_s']):.0f} s) | {cd['ratio_to_naive_ops']:.2f}x | <= 1.1x | {'yes' if cd['ratio_to_naive_ops'] <= 1.1 else 'no'} |")
            elif "naive_ops_s" in cd:
                lines.append("| cold build against naive DS_BUILD_* ops | not measured: this row's toolkit is not Debian's | <= 1.1x | - |")
        if cd.get("ours_cpu_ops_s") and any(cd["ours_cpu_ops_s"]):
            lines.append(f"| of this tool's cold build: CPU-accelerator ops compiled at build time (naive builds none) | {med(cd['ours_cpu_ops_s']):.0f} s | reported | - |")
    if "opscache" in r:
        oc = r["opscache"]
        vs = f" (cold: {oc['cold_ops_step_s']:.0f} s)" if "cold_ops_step_s" in oc else ""
        lines.append(f"| `--no-cache` rebuild: op prebuild stage{vs} / whole build | {oc['ops_step_s']:.0f} s / {oc['seconds']:.0f} s | ops from the cache | {'yes' if oc['served_from_cache'] else 'no'} |")
    if "rebuild_nochange_s" in r:
        d = r["rebuild_nochange_s"]
        lines.append(f"| no-change rebuild through build.py (median of {d['n']}) | {d['median']:.2f} s | <= 3 s | {'yes' if d['median'] <= 3 else 'no'} |")
    if "smoke_change" in r:
        sc = r["smoke_change"]
        lines.append(f"| smoke-suite-only change: steps rebuilt | {len(sc['rebuilt_steps'])} ({sc['seconds']:.1f} s, no tests) | last layers only | {'yes' if all('[runtime' in x for x in sc['rebuilt_steps']) else 'no'} |")
    if "second_row" in r:
        sr = r["second_row"]
        lines.append(f"| second row with the same lock ({sr['image']}): unique bytes | {sr['unique_bytes'] / 1e6:.1f} MB ({sr['unique_fraction'] * 100:.3f}%) | <= 1% | {'yes' if sr['unique_fraction'] <= 0.01 else 'no'} |")
        if "fraction_of_cold_build" in sr:
            lines.append(f"| second row build time / first row's cold build | {sr['seconds']:.1f} s ({sr['fraction_of_cold_build'] * 100:.1f}%) | <= 20% | {'yes' if sr['fraction_of_cold_build'] <= 0.2 else 'no'} |")
    if "matrix" in r:
        mx = r["matrix"]
        shared = sum(1 for v in mx["locked_wheels_step_s"].values() if v)
        vs = f" ({mx['fraction_of_cold_build']:.2f}x one row's cold build)" if "fraction_of_cold_build" in mx else ""
        lines.append(f"| matrix build, {len(mx['rows'])} rows with --jobs {mx['jobs']}: wall time{vs} | {mx['seconds']:.0f} s | shared layers once | {'yes' if shared <= 1 else 'no'} |")
        lines.append(f"| matrix build: machine busy (all CPUs, /proc/stat) | {mx['cpu_busy'] * 100:.0f}% | busy | - |")
        lines.append(f"| matrix build: rows that ran the locked-wheels step themselves | {shared} of {len(mx['rows'])} | 1 | {'yes' if shared <= 1 else 'no'} |")
    if "banner" in r:
        b = r["banner"]
        lines.append(f"| banner start-up overhead (median difference, {b['runs']} runs) | {b['median_overhead_s'] * 1000:.0f} ms | <= 200 ms | {'yes' if b['median_overhead_s'] <= 0.2 else 'no'} |")
    series_at = len(lines)  # the series table's head, dropped below when no series was measured
    lines += ["", "| series (s) | median | min | max | n |", "|---|---|---|---|---|"]
    if "rebuild_nochange_s" in r:
        lines.append(f"| no-change rebuild | {row_stats(r['rebuild_nochange_s'])} |")
    if "cold" in r:
        for key, label in (("ours_s", "cold build, this tool"), ("ours_python_env_s", "  of which the locked-wheels step"),
                           ("ours_ops_s", "  of which the op prebuild"), ("ours_te_s", "  of which Transformer Engine's extension"),
                           ("ours_cpu_ops_s", "  of which the CPU-accelerator ops"),
                           ("naive_s", "cold build, naive"), ("naive_ops_s", "cold build, naive with DS_BUILD_* ops")):
            if r["cold"].get(key):
                lines.append(f"| {label} | {row_stats(stats(r['cold'][key]))} |")
    if "banner" in r:
        lines += [f"| container start, banner on | {row_stats(r['banner']['with_banner_s'])} |",
                  f"| container start, banner off | {row_stats(r['banner']['without_banner_s'])} |"]
    if len(lines) == series_at + 3:
        del lines[series_at:]
    if "pull" in r:
        lines += ["", "## Pull cost", "", pullcost.markdown(r["pull"]).rstrip()]
    if "smoke_change" in r:
        lines += ["", "Steps rebuilt after a change to the smoke suite only:", ""] + [f"- `{x}`" for x in r["smoke_change"]["rebuilt_steps"]]
    if "image" in r.get("size", {}) and "naive" in r["size"]:
        lines += ["", "![sizes](sizes.svg)", "", "![cold build](cold-build.svg)"]
    return "\n".join(lines) + "\n"


def cold_alone_markdown(cd: dict) -> list[str]:
    """A cold build with no naive baseline (the train flavor): its time, and the compiles in it,
    which run side by side in BuildKit (so the parts overlap and do not add up)."""
    med = statistics.median
    parts = [f"DeepSpeed ops stage {med(cd['ours_ops_s']):.0f} s"]
    if cd.get("ours_te_s") and any(cd["ours_te_s"]):
        parts.append(f"Transformer Engine stage {med(cd['ours_te_s']):.0f} s")
    parts.append(f"locked wheels {med(cd['ours_python_env_s']):.0f} s")
    return [f"| cold build, this tool: empty build cache and store, ops compiled ({', '.join(parts)}, "
            f"partly side by side) | {med(cd['ours_s']):.0f} s ({med(cd['ours_s']) / 60:.0f} min) | reported | - |"]


def train_markdown(t: dict, image_bytes: int) -> list[str]:
    lines = []
    if t.get("runtime_image"):
        lines.append(f"| the extras over the runtime image {t['runtime_ref']} ({image_bytes / 1e9:.2f} GB - "
                     f"{t['runtime_image'] / 1e9:.2f} GB) | {(image_bytes - t['runtime_image']) / 1e9:+.2f} GB | reported | - |")
    if "te_compile_s" in t:
        lines.append(f"| Transformer Engine's PyTorch extension, compiled in te-builder ({t['te_compile_jobs']} jobs) | "
                     f"{t['te_compile_s']:.0f} s | reported | - |")
    return lines
