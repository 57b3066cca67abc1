"""gpucheck's report: report.json for machines, report.md for people; the same facts in both.

The header names what the checks ran on (GPU, driver, torch, CUDA, Python), as measured there,
never as the row claims it; the plan lists every step with its estimate, bound, time and state
(done, skipped, not run, running: the step a kill cut when the run ended there); the table lists
every check with its outcome, a check that did not run as SKIPPED with the reason. Written before
and after every step. Standard library only.
"""
import os
from typing import Any, Sequence

from .smoke.results import FAIL, PASS, Record, describe, summary, write_report


def header(desc: dict[str, Any], facts: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, value) rows of what was checked on what."""
    smi = facts.get("nvidia_smi") or []
    gpus = "; ".join(f"{g['name']} (compute {g['capability']})" for g in smi) or "none visible (nvidia-smi absent or lists none)"
    wheel = desc["ops_wheel"]
    return [
        ("Row", f"{desc['image']}: torch {desc['torch']}, CUDA {desc['torch_cuda']}, DeepSpeed {desc['deepspeed']}"),
        ("Mode", facts.get("mode", "GPU")),
        ("GPU", gpus),
        ("Driver", ", ".join(sorted({g["driver"] for g in smi})) or "none"),
        ("torch", f"{facts.get('torch', 'not imported')} (CUDA {facts.get('torch_cuda', '-')}, "
                  f"{facts.get('gpus', 0)} device(s) visible to torch)"),
        ("Ops", f"prebuilt by `build.py gpu-bundle` for {wheel['arch_list']} against torch {wheel['torch']}: "
                f"{', '.join(wheel['ops'])}; nothing compiled here"),
        ("Python", f"{facts['python']} (bundle made for {desc['python']})"),
        ("Platform", facts["platform"]),
    ]


def plan_lines(steps: Sequence[dict[str, Any]], running: str | None) -> list[str]:
    if not steps:
        return []
    state = next((s["state"] for s in steps if s["step"] == running), "")
    note = {"cut": f"**Cut: `{running}`**, stopped before it finished.",
            "running": f"**Running when this report was written: `{running}`**; if the run ended here, it was cut "
                       "(killed) during this step."}
    lines = ["", note.get(state, "Every planned step ended."),
             "", "| Step | State | Seconds | Estimate | Bound |", "| --- | --- | --- | --- | --- |"]
    for s in steps:
        took = "-" if s["seconds"] is None else f"{s['seconds']:g}"
        lines.append(f"| {s['step']} | {s['state']} | {took} | {s['estimate_s']:g} | {s['bound_s']:g} |")
    return lines


def markdown(desc: dict[str, Any], facts: dict[str, Any], records: list[Record], seconds: float,
             steps: Sequence[dict[str, Any]] = (), running: str | None = None) -> str:
    s = summary(records)
    lines = [f"# GPU check of {desc['image']}", "",
             f"{s[PASS]} passed, {s[FAIL]} failed, {s['SKIPPED']} skipped, {s['INFO']} info in {seconds:g} s.", "",
             "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in header(desc, facts)]
    lines += plan_lines(list(steps), running)
    lines += ["", "| Check | Run | Rank | Status | Detail |", "| --- | --- | --- | --- | --- |"]
    for r in records:
        detail = describe(r).replace("|", "\\|").replace("\n", " ")
        rank = "-" if r.get("rank") is None else r["rank"]
        lines.append(f"| {r['check']} | {r.get('run') or '-'} | {rank} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def write(report_dir: str, desc: dict[str, Any], facts: dict[str, Any], records: list[Record], seconds: float,
          steps: Sequence[dict[str, Any]] = (), running: str | None = None) -> tuple[str, str]:
    """Both files, each written whole (a temporary name, then renamed); their paths."""
    json_path, md_path = os.path.join(report_dir, "report.json"), os.path.join(report_dir, "report.md")
    write_report(json_path, {"bundle": {k: desc[k] for k in ("image", "torch", "torch_cuda", "deepspeed", "python")},
                             "machine": dict(header(desc, facts)), "facts": facts, "seconds": seconds,
                             "running": running, "steps": list(steps), "summary": summary(records), "checks": records})
    tmp = md_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(markdown(desc, facts, records, seconds, steps, running))
    os.replace(tmp, md_path)
    return json_path, md_path
