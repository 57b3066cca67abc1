"""Orchestrator of the smoke suite. Imports neither torch nor DeepSpeed itself:
every library touch happens in a child process with a timeout."""
import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

from .. import manifest as mf
from . import launch, nocompile, versions
from .results import FAIL, SKIP, read_rank_files, record, summary, table, write_report

FAMILIES = ["versions", "gpu", "collectives", "zero3", "zero3_offload", "zero3_launcher",
            "fsdp2", "nocompile"]
SHARDING = {"zero3", "zero3_offload", "zero3_launcher", "fsdp2"}
DEFAULT_REPORT = "/tmp/pytorch-cuda-smoke/report.json"
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pytorch-cuda-smoke", description=__doc__)
    p.add_argument("--report", default=DEFAULT_REPORT, help="JSON report path")
    p.add_argument("--require-gpu", action="store_true", help="a missing GPU is a failure")
    p.add_argument("--cpu", action="store_true", help="force CPU mode (gloo), ignore GPUs")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launched step")
    p.add_argument("--only", default="", help="comma list of: " + ",".join(FAMILIES))
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks (default 2)")
    a = p.parse_args(argv)
    a.only = [x.strip() for x in a.only.split(",") if x.strip()] or list(FAMILIES)
    bad = [x for x in a.only if x not in FAMILIES]
    if bad:
        p.error(f"unknown --only name(s) {bad}; choose from {FAMILIES}")
    return a


def plan(only, gpus, ranks):
    """[(family, device, world)]. One GPU cannot show sharding: the sharding
    families then also run on `ranks` CPU ranks."""
    runs = []
    for fam in [f for f in only if f in SHARDING or f == "collectives"]:
        if gpus:
            runs.append((fam, "cuda", gpus))
        if not gpus or (gpus == 1 and fam in SHARDING):
            runs.append((fam, "cpu", ranks))
    return runs


class Suite:
    def __init__(self, args):
        self.args, self.records = args, []
        self.work = tempfile.mkdtemp(prefix="pytorch-cuda-smoke-")
        self.logs = os.path.join(os.path.dirname(os.path.abspath(args.report)), "logs")
        os.makedirs(self.logs, exist_ok=True)
        # Fresh, empty: anything JIT-compiled by a child lands here and is caught.
        self.ext_dir = os.path.join(self.work, "torch_extensions")
        os.makedirs(self.ext_dir)

    def env(self, device="cpu", **extra):
        e = dict(os.environ, TORCH_EXTENSIONS_DIR=self.ext_dir, PCR_TIMEOUT=str(self.args.timeout),
                 PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])))
        e.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores: no oversubscription
        if device == "cpu":
            e["DS_ACCELERATOR"] = "cpu"
            e["CUDA_VISIBLE_DEVICES"] = ""  # same code, truly without the GPU
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def step(self, name, cmd, env):
        r = launch.run_step(cmd, env, self.args.timeout, os.path.join(self.logs, name + ".log"))
        print(f"  {name}: rc={r['rc']} {r['seconds']}s{' TIMEOUT' if r['timed_out'] else ''}",
              file=sys.stderr, flush=True)
        return r

    def step_failure(self, check, run, r, rank_recs):
        """A crash/timeout that left no FAIL record still must name itself."""
        if r["timed_out"]:
            return [record(check, FAIL, run, expected=f"done within {self.args.timeout:g}s",
                           actual="timed out, process group killed", detail=f"log {r['log']}")]
        if r["rc"] != 0 and not any(x["status"] == FAIL for x in rank_recs):
            return [record(check, FAIL, run, expected="exit 0", actual=f"exit {r['rc']}",
                           detail=launch.tail(r["log"], 3).strip().replace("\n", " | "))]
        return []

    def probe(self, device):
        r = self.step(f"probe_{device}", [sys.executable, "-m", "pytorch_cuda_runtime.smoke.probe"],
                      self.env(device))
        with open(r["log"], encoding="utf-8", errors="replace") as f:
            lines = [l for l in f if l.startswith("PROBE ")]
        if not lines:
            self.records += self.step_failure("probe", device, dict(r, rc=r["rc"] or 1), [])
            return {}
        return json.loads(lines[-1][6:])


def _bin(name):
    """A console script of this venv (torchrun, deepspeed)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else shutil.which(name)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_cmd(family, device, world):
    mod = ["pytorch_cuda_runtime.smoke.worker", family]
    if family == "zero3_launcher":
        ds = _bin("deepspeed")
        cmd = [ds] if ds else [sys.executable, "-m", "deepspeed.launcher.runner"]
        # A CPU machine has no "GPUs" to count: the launcher needs --num_gpus.
        return cmd + ["--num_gpus", str(world), "--master_port", str(_free_port()),
                      "--module"] + mod
    tr = _bin("torchrun")
    cmd = [tr] if tr else [sys.executable, "-m", "torch.distributed.run"]
    return cmd + ["--standalone", "--nproc_per_node", str(world), "-m"] + mod


def run_family(suite, family, device, world):
    run = f"{device} x{world}"
    name = f"{family}_{device}{world}"
    out = os.path.join(suite.work, name)
    os.makedirs(out)
    env = suite.env(device, PCR_DEVICE=device, PCR_RESULTS_DIR=out, PCR_RUN=run, PCR_WORK=out,
                    PCR_EXPECT_WORLD=world)
    r = suite.step(name, launcher_cmd(family, device, world), env)
    recs = read_rank_files(out)
    missing = sorted(set(range(world)) - {x["rank"] for x in recs})
    if missing and not r["timed_out"]:
        recs.append(record(f"{family}.ranks", FAIL, run, expected=list(range(world)),
                           actual=sorted({x["rank"] for x in recs}), detail=f"no results from {missing}"))
    return recs + suite.step_failure(f"{family}.launch", run, r, recs)


def run_gpu_basics(suite, gpus, reason):
    if not gpus:
        status = FAIL if suite.args.require_gpu else SKIP
        return [record("gpu.basics", status, detail=reason, actual="0 GPUs"
                       if status == FAIL else None, expected="a CUDA device" if status == FAIL else None)]
    out = os.path.join(suite.work, "gpu")
    os.makedirs(out)
    r = suite.step("gpu_basics", [sys.executable, "-m", "pytorch_cuda_runtime.smoke.gpu_basics"],
                   suite.env("cuda", PCR_RESULTS_DIR=out, PCR_RUN=f"cuda x{gpus}"))
    recs = read_rank_files(out)
    return recs + suite.step_failure("gpu.basics", f"cuda x{gpus}", r, recs)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.monotonic()
    suite = Suite(args)
    try:
        manifest = mf.load()
    except (OSError, ValueError) as e:
        manifest = {}
        suite.records.append(record("manifest", FAIL, expected=mf.manifest_path(), actual=str(e)))
    facts = suite.probe("cpu" if args.cpu else "host")
    gpus = 0 if args.cpu else int(facts.get("cuda_device_count") or 0)
    reason = "--cpu given" if args.cpu else "no CUDA device visible"
    print(f"pytorch-cuda-smoke: mode {'gpu x%d' % gpus if gpus else 'cpu x%d' % args.ranks}",
          file=sys.stderr, flush=True)
    if "versions" in args.only:
        suite.records += versions.check(manifest, facts)
    if "gpu" in args.only:
        suite.records += run_gpu_basics(suite, gpus, reason)
    for family, device, world in plan(args.only, gpus, args.ranks):
        suite.records += run_family(suite, family, device, world)
    if "nocompile" in args.only:
        suite.records += nocompile.check(suite.ext_dir, facts, manifest)
    return finish(suite, gpus, time.monotonic() - t0)


def finish(suite, gpus, seconds):
    recs = suite.records
    print(table(recs))
    s = summary(recs)
    print(f"\n{s['PASS']} passed, {s['FAIL']} failed, {s['SKIPPED']} skipped, {s['INFO']} info "
          f"in {seconds:.0f}s; report {suite.args.report}")
    write_report(suite.args.report, {"manifest": mf.manifest_path(), "gpus": gpus,
                                     "seconds": round(seconds, 1), "summary": s, "results": recs,
                                     "logs": suite.logs})
    shutil.rmtree(suite.work, ignore_errors=True)
    return 1 if s["FAIL"] else 0
