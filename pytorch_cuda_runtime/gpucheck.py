"""Prove one matrix row's GPU half on a machine lent for minutes, from a gpu-bundle: nothing is
compiled there, no Docker, no network.

    bash DIR/run.sh [--report DIR] [--budget S] [--rehearse] [--python PATH]
    (= python -m pytorch_cuda_runtime.gpucheck --bundle DIR ...)

The machine brings Python and torch (the ones the bundle was made for); the bundle
(`build.py gpu-bundle`) brings DeepSpeed's wheel with the row's ops prebuilt for that Python and
torch, libaio's shared library for async_io, the small wheels DeepSpeed needs, this package and
the row's manifest. It prints its plan first (every step with its estimated seconds, from
gpu_estimates.json, the last GPU record's step times), then runs the steps in order:

  bundle.files          every file's sha256 equals bundle.json's (what travelled is what was locked)
  machine.python        Python is the bundle's
  machine.torch         torch imports, is the torch the wheel was built against, and is a CUDA build
  install.dependencies  what the machine lacks of the bundle's wheels (pip decides, --no-index)
  install.deepspeed     the prebuilt wheel, --no-deps; both into a directory of their own, first on
                        PYTHONPATH: the machine's own torch and packages are never replaced
  preflight.health      the preflight's GPU health checks (preflight/health.py: Xid, ECC, row
                        remapping, retired pages, NVLink, throttling, temperature), one record a GPU
  preflight.compute     the preflight's compute check (preflight/compute.py): a bf16 matmul on each
                        GPU against its product's peak and the others, its checksum, the PCIe link
                        under load; the machine is a job of one node
  smoke.*               the smoke suite's GPU-only mode (smoke/cli.py), one step per family: versions,
                        GPU basics, the four ops loaded under DeepSpeed's `cuda` accelerator with an
                        empty TORCH_EXTENSIONS_DIR, NCCL collectives, DDP, ZeRO 1/2/3 with and without
                        offload, the `deepspeed` launcher, FSDP2, bf16, torch.compile, the train row's
                        carried extras, the GPU measure (recorded, never asserted), and last that the
                        GPU families compiled nothing

report.json and report.md are written before each step (naming it as running) and after it, each
file whole (a temporary name, then renamed): a kill at any point, SIGKILL included, leaves every
finished step recorded and the cut one named. Each step has its own time bound (3 x its estimate,
at least a minute), and no step starts that the budget (--budget, default 540 s) has no room for.

--rehearse: a machine without a GPU, and perhaps with a CPU torch, runs the same path: the files,
the install of the prebuilt wheel, the plan, the report after each step; the steps that need a GPU
are SKIPPED with that reason. Exit 0: every check that ran passed; 1: a check failed; 2: the bundle
or the arguments are unusable; 128 + N: stopped by signal N (143: SIGTERM from `timeout`), after
writing the report. Standard library only (torch in children).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from . import banner
from .gpurunner import Check, estimate, print_plan, run_steps
from .gpusteps import plan
from .interrupt import Interrupted, catching
from .smoke.results import FAIL

BUNDLE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUDGET = 540  # a lent machine's command runs at most 600 s: the report is written before then


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpucheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=BUNDLE, help="the bundle (default: the one this package came in)")
    p.add_argument("--report", help="directory for report.json, report.md and logs/ (default: BUNDLE/report)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"seconds for the whole run: no step starts that would not fit (default {DEFAULT_BUDGET})")
    p.add_argument("--rehearse", action="store_true", help="a machine without a GPU: run every step that needs none")
    a = p.parse_args(argv)
    if a.budget <= 0:
        p.exit(2, f"gpucheck: error: --budget {a.budget:g}: expected a positive number of seconds\n")
    return a


def load(a: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """bundle.json and a writable report directory, or one line and exit 2."""
    with open(os.path.join(a.bundle, "bundle.json")) as f:
        desc = json.load(f)
    if desc.get("schema") != 2 or "ops_wheel" not in desc:
        raise ValueError(f"{a.bundle}/bundle.json is no bundle of this gpucheck (schema {desc.get('schema')}, "
                         "expected 2 with a prebuilt ops wheel): make it again with `build.py gpu-bundle`")
    report_dir = os.path.abspath(a.report or os.path.join(a.bundle, "report"))
    os.makedirs(report_dir, exist_ok=True)
    if not os.access(report_dir, os.W_OK):
        raise OSError(f"{report_dir} is not writable (name another with --report)")
    return desc, report_dir


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        desc, report_dir = load(a)
    except (OSError, ValueError) as e:
        print(f"gpucheck: error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="pytorch-cuda-gpucheck-")
    c = Check(os.path.abspath(a.bundle), desc, report_dir, work, a.budget, a.rehearse)
    smi = banner.query_gpus() or []
    c.facts["nvidia_smi"] = [{"name": n, "driver": d, "capability": cap} for n, d, cap in smi]
    c.gpus = len(smi)  # for the plan; torch's own count replaces it (machine.torch)
    c.steps = plan(c.gpus)
    total, est = estimate(c.steps)
    c.facts["plan_estimate_s"] = total
    print_plan(c, total, est)
    stopped = None
    try:
        with catching():
            try:
                c.write()
                run_steps(c)
            except Interrupted as e:  # what finished still makes a report, and the cut step is named
                stopped = e
                for s in c.steps:
                    s.state = "cut" if s.state == "running" else ("not run" if s.state == "planned" else s.state)
                c.add("interrupted", FAIL, expected="every step run", actual=f"{e} during {c.current}",
                      detail="the steps after it did not run")
    finally:
        for d in (work, c.suite.work if c.suite else None):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    paths = c.write()
    failed = sum(r["status"] == FAIL for r in c.records)
    print(f"gpucheck: {len(c.records)} checks, {failed} failed, in {c.elapsed():g} s; {paths[0]} and {paths[1]}",
          file=sys.stderr)
    return stopped.exit_code if stopped else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
