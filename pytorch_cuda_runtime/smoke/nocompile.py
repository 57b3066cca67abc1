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

from .results import FAIL, INFO, PASS, record


def built_files(ext_dir):
    found = []
    for root, _, files in os.walk(ext_dir):
        found += [os.path.relpath(os.path.join(root, f), ext_dir) for f in files]
    return sorted(found)


def built_ops(ext_dir):
    """{op directory: True when it holds a loadable library, False for a failed build}."""
    out = {}
    for name in sorted(os.listdir(ext_dir)) if os.path.isdir(ext_dir) else []:
        path = os.path.join(ext_dir, name)
        if os.path.isdir(path):
            out[name] = any(f.endswith(".so") for _, _, fs in os.walk(path) for f in fs)
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
    """[(op, built, step, seconds)] for op directories a step added or completed."""
    return [(op, ok, step, seconds) for op, ok in after.items()
            if op not in before or (ok and not before[op])]


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
