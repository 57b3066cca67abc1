"""Orchestrator of the smoke suite. Imports neither torch nor DeepSpeed itself:
every library touch happens in a child process with a timeout.

`--gpu-only` runs only what a GPU adds (gpucheck.py's steps on a lent GPU machine): every
family on the GPUs, none on CPU ranks (those are proven in CI), and the GPU sanity measure
(measure.py). With one GPU the sharding families show a world of one, and the report says so.
"""
import argparse
import json
import os
import platform
import shutil
import socket
import sys
from typing import Any
import tempfile
import time

from .. import banner
from .. import manifest as mf
from ..interrupt import Interrupted, catching
from . import launch, nocompile, versions
from .nocompile import empty_check
from .results import FAIL, INFO, SKIP, read_rank_files, record, summary, table, write_report

ZERO = ["zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_offload",
        "zero3_launcher"]
MULTI = ["collectives", "ddp"] + ZERO + ["fsdp2"]  # several ranks (torchrun/deepspeed)
SINGLE = ["bf16", "compile"]  # one process
GPU_ONLY = ["measure"]  # one process on GPU 0; run when named or under --gpu-only
FAMILIES = ["versions", "gpu", "extras"] + MULTI + SINGLE + GPU_ONLY + ["nocompile"]
DEFAULT = [f for f in FAMILIES if f not in GPU_ONLY]
# One GPU cannot show replication or sharding: these then also run on CPU ranks.
SHARDING = set(MULTI) - {"collectives"}
DEFAULT_REPORT = "/tmp/pytorch-cuda-smoke/report.json"
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pytorch-cuda-smoke", description=__doc__)
    p.add_argument("--report", default=DEFAULT_REPORT, help="JSON report path")
    p.add_argument("--manifest", default=None, help="manifest to check against (default: "
                   f"$PYTORCH_CUDA_MANIFEST or {mf.DEFAULT_PATH})")
    p.add_argument("--require-gpu", action="store_true", help="a missing GPU is a failure")
    p.add_argument("--cpu", action="store_true", help="force CPU mode (gloo), ignore GPUs")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launched step")
    p.add_argument("--only", default="", help="comma list of: " + ",".join(FAMILIES))
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--gpu-only", action="store_true", help="only what a GPU adds: no CPU-rank runs, the GPU "
                   "measure added; a missing GPU is a failure")
    a = p.parse_args(argv)
    if a.gpu_only and a.cpu:
        p.error("--gpu-only and --cpu exclude each other")
    a.manifest = a.manifest or mf.manifest_path()
    a.only = [x.strip() for x in a.only.split(",") if x.strip()] or list(FAMILIES if a.gpu_only else DEFAULT)
    a.require_gpu = a.require_gpu or a.gpu_only
    bad = [x for x in a.only if x not in FAMILIES]
    if bad:
        p.error(f"unknown --only name(s) {bad}; choose from {FAMILIES}")
    return a


def plan(only, gpus, ranks, gpu_only=False):
    """[(family, device, world)] in FAMILIES order. One GPU cannot show sharding: the
    SHARDING families then also run on `ranks` CPU ranks. The one-process families run
    on the CPU always (Inductor's C++ path, CPU autocast), and on GPU 0 when there is one.
    gpu_only keeps the GPU runs alone: what CPU ranks show, CI has shown."""
    runs = []
    for fam in [f for f in FAMILIES if f in only]:
        if fam in GPU_ONLY:
            runs += [(fam, "cuda", 1)] if gpus else []
        elif fam in SINGLE:
            runs += ([(fam, "cuda", 1)] if gpus else []) + [(fam, "cpu", 1)]
        elif fam in MULTI:
            if gpus:
                runs.append((fam, "cuda", gpus))
            if not gpus or (gpus == 1 and fam in SHARDING):
                runs.append((fam, "cpu", ranks))
    return [r for r in runs if r[1] == "cuda"] if gpu_only else runs


def world_of_one(gpus, runs):
    """One GPU shows no replication or sharding across ranks: say so rather than run CPU ranks."""
    multi = sorted({f for f, d, _ in runs if d == "cuda" and f in SHARDING})
    if gpus != 1 or not multi:
        return []
    return [record("world.one_gpu", INFO, "cuda x1", actual="world of one",
                   detail=f"{', '.join(multi)} ran on one rank: replication and sharding across ranks are not shown on "
                          "one GPU (CI shows them on CPU ranks)")]


class Suite:
    def __init__(self, args):
        self.args, self.records = args, []
        self.work = tempfile.mkdtemp(prefix="pytorch-cuda-smoke-")
        self.logs = os.path.join(os.path.dirname(os.path.abspath(args.report)), "logs")
        os.makedirs(self.logs, exist_ok=True)
        # Fresh, empty, one per kind of child (see nocompile.py): anything JIT-compiled
        # lands in one of these and is caught or reported. CPU children share theirs.
        self.ext = {k: os.path.join(self.work, f"torch_extensions_{k}") for k in ("cpu", "cuda", "ops", "extras")}
        for d in self.ext.values():
            os.makedirs(d)
        # The image compiled DeepSpeed's CPU ops at build time ($PYTORCH_CUDA_CPU_OPS): the CPU
        # children start from a copy (times kept, so torch finds them up to date); a build
        # that still happens shows up as a changed library in nocompile's INFO.
        seed = os.environ.get("PYTORCH_CUDA_CPU_OPS")
        if seed and os.path.isdir(seed):
            shutil.copytree(seed, self.ext["cpu"], dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
        self.jit_builds = []  # [(op, built, step, seconds)] in the CPU directory
        self.current = None

    def env(self, device="cpu", **extra):
        ext = self.ext["cpu" if device == "cpu" else "cuda"]
        # PYTORCH_CUDA_MANIFEST: a worker that reads the manifest (extras) reads the one this
        # suite was given with --manifest, not the image's default path.
        e = dict(os.environ, TORCH_EXTENSIONS_DIR=ext, PCR_TIMEOUT=str(self.args.timeout),
                 PYTORCH_CUDA_MANIFEST=os.path.abspath(self.args.manifest),
                 PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])))
        e.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores: no oversubscription
        if device == "cpu":
            e["DS_ACCELERATOR"] = "cpu"
            e["CUDA_VISIBLE_DEVICES"] = ""  # same code, truly without the GPU
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def step(self, name, cmd, env, timeout=None):
        self.current = name  # what an interruption stopped, for its record
        before = nocompile.built_ops(self.ext["cpu"])
        r = launch.run_step(cmd, env, timeout or self.args.timeout,
                            os.path.join(self.logs, name + ".log"))
        self.jit_builds += nocompile.new_builds(before, nocompile.built_ops(self.ext["cpu"]),
                                                name, r["seconds"])
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
    if family in SINGLE or family in GPU_ONLY:
        return [sys.executable, "-m"] + mod
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
                    PCR_EXPECT_WORLD=world, **family_env(family, out))
    r = suite.step(name, launcher_cmd(family, device, world), env)
    recs = read_rank_files(out)
    missing = sorted(set(range(world)) - {x["rank"] for x in recs})
    if missing and not r["timed_out"]:
        recs.append(record(f"{family}.ranks", FAIL, run, expected=list(range(world)),
                           actual=sorted({x["rank"] for x in recs}), detail=f"no results from {missing}"))
    return recs + suite.step_failure(f"{family}.launch", run, r, recs)


def family_env(family, out):
    """Extra environment of a family: compile gets caches of its own, empty, so the
    code is generated in this run and nothing of an earlier one is reused."""
    if family == "compile":
        cache = os.path.join(out, "inductor_cache")
        return {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    return {}


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


def run_extras(suite, manifest, gpus):
    """The train flavor's extras (extras.py), with the `cuda` accelerator the ops are built for
    and an extensions directory of their own that must stay empty: nothing compiles."""
    if not manifest.get("extras"):
        return []  # not a train image
    out = os.path.join(suite.work, "extras")
    os.makedirs(out)
    run = f"cuda x{gpus}" if gpus else "cpu"
    env = suite.env("cuda", PCR_RESULTS_DIR=out, PCR_RUN=run, DS_ACCELERATOR="cuda", TORCH_EXTENSIONS_DIR=suite.ext["extras"])
    r = suite.step("extras", [sys.executable, "-m", "pytorch_cuda_runtime.smoke.extras"], env)
    recs = read_rank_files(out)
    return recs + suite.step_failure("extras.launch", run, r, recs) + [
        empty_check("extras.nocompile", run, suite.ext["extras"], "the extras load prebuilt")]


def main(argv=None):
    args = parse_args(argv)
    t0 = time.monotonic()
    suite = Suite(args)
    facts: dict[str, Any] = {}
    stopped = None
    with catching():
        try:
            gpus = run_suite(suite, facts)
        except Interrupted as e:  # the steps that finished still make a report
            gpus, stopped = int(facts.get("cuda_device_count") or 0), e
            suite.records.append(record("interrupted", FAIL, expected="every step run", actual=f"{e} during {suite.current}",
                                        detail="the steps after it did not run; their records are missing"))
    rc = finish(suite, gpus, time.monotonic() - t0, host_facts(facts))
    return stopped.exit_code if stopped else rc


def run_suite(suite, facts):
    """Every step the arguments ask for, records into suite.records; returns the GPU count.
    facts is filled as soon as the probe answers, so an interrupted run still reports the host."""
    args = suite.args
    try:
        manifest = mf.load(args.manifest)
    except (OSError, ValueError) as e:
        manifest = {}
        suite.records.append(record("manifest", FAIL, expected=args.manifest, actual=str(e)))
    facts.update(suite.probe("cpu" if args.cpu else "host"))
    gpus = 0 if args.cpu else int(facts.get("cuda_device_count") or 0)
    reason = "--cpu given" if args.cpu else "no CUDA device visible"
    print(f"pytorch-cuda-smoke: mode {'gpu x%d' % gpus if gpus else 'cpu x%d' % args.ranks}",
          file=sys.stderr, flush=True)
    if "versions" in args.only:
        suite.records += versions.check(manifest, facts)
    if "gpu" in args.only:
        suite.records += run_gpu_basics(suite, gpus, reason)
    if "extras" in args.only:
        suite.records += run_extras(suite, manifest, gpus)
    runs = plan(args.only, gpus, args.ranks, args.gpu_only)
    suite.records += world_of_one(gpus, runs)
    if nocompile.cpu_jit_ops(runs):
        suite.records += nocompile.run_cpu_jit(suite, nocompile.cpu_jit_ops(runs))
    for family, device, world in runs:
        suite.records += run_family(suite, family, device, world)
    if "nocompile" in args.only:
        suite.records += nocompile.run_ops(suite, manifest) + nocompile.check_compiles(suite, gpus, runs)
    return gpus


def host_facts(facts):
    """What a committed report must say about where it ran (driver from nvidia-smi:
    torch does not report it)."""
    keys = ("python", "torch", "torch_cuda", "cudnn", "nccl", "deepspeed", "ds_build_accelerator",
            "cuda_device_count", "devices")
    smi = banner.query_gpus()
    return dict({k: facts.get(k) for k in keys}, platform=platform.platform(),
                nvidia_smi=[{"name": n, "driver": d, "capability": c} for n, d, c in smi or []])


def finish(suite, gpus, seconds, host):
    recs = suite.records
    print(table(recs))
    s = summary(recs)
    print(f"\n{s['PASS']} passed, {s['FAIL']} failed, {s['SKIPPED']} skipped, {s['INFO']} info "
          f"in {seconds:.0f}s; report {suite.args.report}")
    write_report(suite.args.report, {"manifest": suite.args.manifest, "host": host, "gpus": gpus,
                                     "seconds": round(seconds, 1), "summary": s, "results": recs,
                                     "logs": suite.logs})
    shutil.rmtree(suite.work, ignore_errors=True)
    return 1 if s["FAIL"] else 0
