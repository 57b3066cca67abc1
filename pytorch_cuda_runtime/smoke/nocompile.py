"""Run-time compilation: none on a GPU host; on CPU ranks, shown, not hidden.

The image's DeepSpeed ops are prebuilt for the `cuda` accelerator (manifest
`ops_accelerator`). The ops step (ops.py) proves they load without a compiler; every
child points TORCH_EXTENSIONS_DIR at a fresh directory, so a JIT build leaves files:
  - the ops step's directory must stay empty;
  - so must the GPU families' one: nothing is compiled on a GPU host;
  - CPU families run with DS_ACCELERATOR=cpu, for which DeepSpeed JIT-compiles its CPU
    ops (cpu_adam, shm_comm, its CPU fused_adam) by design. They share one directory,
    so each op builds once per suite run, and the builds are reported as INFO.
"""
import os
import sys

from . import zero
from .results import FAIL, INFO, PASS, read_rank_files, record


def built_files(ext_dir):
    found = []
    for root, _, files in os.walk(ext_dir):
        found += [os.path.relpath(os.path.join(root, f), ext_dir) for f in files]
    return sorted(found)


def built_ops(ext_dir):
    """{op directory: (mtime_ns of its newest library, or 0 when a build left none)}.

    torch nests op directories under py<ver>_<cuda>/ (DeepSpeed) or not (a build_directory
    of one's own); an op directory is one holding build.ninja."""
    out = {}
    for root, _, files in os.walk(ext_dir) if os.path.isdir(ext_dir) else []:
        if "build.ninja" in files:
            libs = [os.path.join(root, f) for f in files if f.endswith(".so")]
            out[os.path.basename(root)] = max((os.stat(p).st_mtime_ns for p in libs), default=0)
    return out


def clear_locks(ext_dir):
    """torch.utils.cpp_extension waits on a build's `lock` file; a killed build leaves it."""
    for root, _, files in os.walk(ext_dir):
        if "lock" in files:
            os.remove(os.path.join(root, "lock"))


def empty_check(check, run, ext_dir, what):
    files = built_files(ext_dir)
    return record(check, PASS if not files else FAIL, run,
                  expected=f"empty TORCH_EXTENSIONS_DIR ({what})",
                  actual=files[:8] if files else "empty",
                  detail=f"{len(files)} files JIT-built at run time" if files else "")


def new_builds(before, after, step, seconds):
    """[(op, built, step, seconds)] for op directories a step added, completed or rebuilt."""
    return [(op, bool(mtime), step, seconds) for op, mtime in after.items()
            if op not in before or mtime != before[op]]


def jit_info(builds, run="cpu"):
    """INFO: what the CPU families compiled, and in which family's wall time."""
    if not builds:
        return record("nocompile.cpu_jit_builds", INFO, run, actual="nothing compiled")
    names = sorted({op for op, ok, _, _ in builds if ok})
    failed = sorted({op for op, ok, _, _ in builds if not ok} - set(names))
    detail = "; ".join(f"{op}{'' if ok else ' (no library)'} in {step} ({seconds:g} s step)"
                       for op, ok, step, seconds in builds)
    return record("nocompile.cpu_jit_builds", INFO, run,
                  actual=", ".join(names) + (f"; failed: {', '.join(failed)}" if failed else ""),
                  detail=detail + ". DS_ACCELERATOR=cpu JIT-compiles: the wheel's ops are for cuda")


def cpu_jit_ops(runs):
    """The DeepSpeed ops the planned CPU families will JIT-compile (DS_ACCELERATOR=cpu)."""
    fams = [zero.VARIANTS[f] for f, device, _ in runs if device == "cpu" and f in zero.VARIANTS]
    ops = ["shm_comm"] if fams else []  # built by init_distributed on the cpu accelerator
    if any(v["offload"] for v in fams):
        ops.append("cpu_adam")
    if any(not v["offload"] and v["adam"] == "default" for v in fams):
        ops.append("fused_adam")  # DeepSpeed's CPU FusedAdam
    return ops


def run_cpu_jit(suite, ops):
    """Build them once, before the families, each within a timeout of its own."""
    out = os.path.join(suite.work, "cpu_jit")
    os.makedirs(out)
    env = suite.env("cpu", PCR_RESULTS_DIR=out, PCR_RUN="cpu")
    r = suite.step("cpu_jit", [sys.executable, "-m", "pytorch_cuda_runtime.smoke.ops", "--jit",
                               ",".join(ops)], env, timeout=suite.args.timeout * len(ops))
    recs = read_rank_files(out)
    if r["timed_out"]:  # torch waits forever on a killed build's lock file
        clear_locks(suite.ext["cpu"])
    # A timeout here is INFO too: the families then build what is missing themselves.
    return recs + [dict(x, status=INFO) for x in suite.step_failure("nocompile.cpu_jit", "cpu", r, recs)]


def run_ops(suite, manifest):
    """The prebuilt DeepSpeed ops load under the accelerator they were built for, with
    nothing compiled. Never DS_ACCELERATOR=cpu nor a hidden GPU here: CUDA extensions
    load on a CPU-only host too."""
    acc = manifest.get("ops_accelerator")
    if not acc:
        return [record("nocompile.ops_accelerator", FAIL, expected="manifest 'ops_accelerator'",
                       actual=None, detail=f"{suite.args.manifest} names no accelerator for its ops")]
    ops = list(manifest.get("prebuilt_ops") or [])
    if not ops:
        return [record("nocompile.prebuilt_ops", FAIL, expected="manifest 'prebuilt_ops'", actual=None,
                       detail=f"{suite.args.manifest} lists no prebuilt ops")]
    out, run = os.path.join(suite.work, "ops"), f"ops DS_ACCELERATOR={acc}"
    os.makedirs(out)
    env = dict(suite.env("host", PCR_RESULTS_DIR=out, PCR_RUN=run),
               DS_ACCELERATOR=acc, TORCH_EXTENSIONS_DIR=suite.ext["ops"])
    r = suite.step("ops", [sys.executable, "-m", "pytorch_cuda_runtime.smoke.ops", ",".join(ops)], env)
    recs = read_rank_files(out)
    recs += suite.step_failure("nocompile.ops", run, r, recs)
    return recs + [empty_check("nocompile.torch_extensions", run, suite.ext["ops"],
                               "prebuilt ops load")]


def check_compiles(suite, gpus, runs):
    """After the families: nothing compiled on a GPU host; what CPU ranks compiled, as INFO."""
    out = []
    if gpus:
        out.append(empty_check("nocompile.torch_extensions_training", f"cuda x{gpus}",
                               suite.ext["cuda"], "GPU families"))
    if suite.jit_builds or any(d == "cpu" for _, d, _ in runs):
        out.append(jit_info(suite.jit_builds, f"cpu x{suite.args.ranks}"))
    return out
