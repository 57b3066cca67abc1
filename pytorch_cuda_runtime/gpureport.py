"""gpucheck's report: report.json for machines, report.md for people; the same facts in both.

The header names what the checks ran on (GPU, driver, torch, CUDA, nvcc, Python), as measured
there, never as the row claims it; the table lists every check with its outcome, a check that
did not run as SKIPPED with the reason. Standard library only.
"""
import os

from .smoke.results import FAIL, PASS, describe, summary, write_report


def header(desc, facts):
    """(label, value) rows of what was checked on what."""
    smi = facts.get("nvidia_smi") or []
    gpus = "; ".join(f"{g['name']} (compute {g['capability']})" for g in smi) or "none visible (nvidia-smi absent or lists none)"
    return [
        ("Row", f"{desc['image']}: torch {desc['torch']}, CUDA {desc['torch_cuda']}, DeepSpeed {desc['deepspeed']}"),
        ("GPU", gpus),
        ("Driver", ", ".join(sorted({g["driver"] for g in smi})) or "none"),
        ("torch", f"{facts.get('torch', 'not imported')} (CUDA {facts.get('torch_cuda', '-')}, "
                  f"{facts.get('gpus', 0)} device(s) visible to torch)"),
        ("CUDA compiler", f"nvcc {facts['nvcc']} in {facts['cuda_home']}" if facts.get("nvcc") else "none found"),
        ("Ops compiled for", facts.get("ops_arch", "nothing compiled")),
        ("Python", f"{facts['python']} (bundle made for {desc['python']})"),
        ("Platform", facts["platform"]),
    ]


def markdown(desc, facts, records, seconds):
    s = summary(records)
    lines = [f"# GPU check of {desc['image']}", "",
             f"{s[PASS]} passed, {s[FAIL]} failed, {s['SKIPPED']} skipped, {s['INFO']} info in {seconds:g} s.", "",
             "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in header(desc, facts)]
    lines += ["", "| Check | Run | Rank | Status | Detail |", "| --- | --- | --- | --- | --- |"]
    for r in records:
        detail = describe(r).replace("|", "\\|").replace("\n", " ")
        rank = "-" if r.get("rank") is None else r["rank"]
        lines.append(f"| {r['check']} | {r.get('run') or '-'} | {rank} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def write(report_dir, desc, facts, records, seconds):
    """Both files, each written whole (a temporary name, then renamed); their paths."""
    json_path, md_path = os.path.join(report_dir, "report.json"), os.path.join(report_dir, "report.md")
    write_report(json_path, {"bundle": {k: desc[k] for k in ("image", "torch", "torch_cuda", "deepspeed", "python")},
                             "machine": dict(header(desc, facts)), "facts": facts, "seconds": seconds,
                             "summary": summary(records), "checks": records})
    tmp = md_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(markdown(desc, facts, records, seconds))
    os.replace(tmp, md_path)
    return json_path, md_path
