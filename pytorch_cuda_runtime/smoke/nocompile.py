"""Check 6: nothing was compiled at run time; the prebuilt DeepSpeed ops are installed.

Every child ran with TORCH_EXTENSIONS_DIR pointing at a fresh empty directory:
a JIT build (DeepSpeed op or torch cpp_extension) would have left files there.
"""
import os

from .. import manifest as mf
from .results import FAIL, PASS, record


def built_files(ext_dir):
    found = []
    for root, _, files in os.walk(ext_dir):
        found += [os.path.relpath(os.path.join(root, f), ext_dir) for f in files]
    return sorted(found)


def check(ext_dir, facts, manifest):
    files = built_files(ext_dir)
    out = [record("nocompile.torch_extensions", PASS if not files else FAIL,
                  expected="empty TORCH_EXTENSIONS_DIR", actual=files[:5] if files else "empty",
                  detail=f"{len(files)} files JIT-built at run time" if files else "")]
    return out + [_op(op, facts) for op in
                  manifest.get("prebuilt_ops") or mf.DEFAULT_PREBUILT_OPS]


def _op(op, facts):
    """DeepSpeed loads a prebuilt op only if installed_ops says so AND the run-time
    accelerator equals the one the wheel was built for; otherwise it JIT-builds."""
    installed = facts.get("installed_ops") or {}
    key = op if op in installed else f"deepspeed_{op}"  # shm_comm is 'deepspeed_shm_comm'
    built, now = facts.get("ds_build_accelerator"), facts.get("ds_runtime_accelerator")
    if not installed.get(key):
        actual = f"not installed ({key}={installed.get(key)!r})"
    elif built != now:
        actual = f"built for accelerator {built!r}, run-time accelerator {now!r}: would JIT"
    else:
        actual = None
    return record(f"nocompile.prebuilt_{op}", FAIL if actual else PASS,
                  expected=f"installed for {now!r}", actual=actual or f"installed ({built})",
                  detail=facts.get("deepspeed_error", "") if actual else "")
