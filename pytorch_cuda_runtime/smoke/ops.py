"""Child step: every prebuilt DeepSpeed op of the manifest loads without a compiler.

Run with DS_ACCELERATOR set to the accelerator the wheel's ops were built for (the
manifest's ops_accelerator, `cuda`) and a fresh empty TORCH_EXTENSIONS_DIR, on a GPU
host and on a CPU-only one alike: loading a CUDA extension needs its libraries, not
a GPU. DeepSpeed uses a prebuilt op only when installed_ops says so AND the run-time
accelerator equals the build's; otherwise it JIT-compiles, which leaves files in
TORCH_EXTENSIONS_DIR (checked by the orchestrator afterwards).

`python -m pytorch_cuda_runtime.smoke.ops OP[,OP...]`

With `--jit` (and DS_ACCELERATOR=cpu) it instead builds the CPU ops the CPU families
will need, once, into their shared TORCH_EXTENSIONS_DIR, each timed, so that no
family spends minutes of its own timeout compiling.
"""
import os
import sys
import time
import traceback

from .results import FAIL, INFO, PASS, Recorder

# Manifest op name -> DeepSpeed builder class (what create_op_builder() takes).
BUILDERS = {
    "async_io": "AsyncIOBuilder", "cpu_adagrad": "CPUAdagradBuilder", "cpu_adam": "CPUAdamBuilder",
    "cpu_lion": "CPULionBuilder", "evoformer_attn": "EvoformerAttnBuilder",
    "fp_quantizer": "FPQuantizerBuilder", "fused_adam": "FusedAdamBuilder",
    "fused_lamb": "FusedLambBuilder", "fused_lion": "FusedLionBuilder", "gds": "GDSBuilder",
    "inference_core_ops": "InferenceCoreBuilder", "pin_memory": "PinMemoryBuilder",
    "quantizer": "QuantizerBuilder", "ragged_device_ops": "RaggedOpsBuilder",
    "ragged_ops": "RaggedUtilsBuilder", "random_ltd": "RandomLTDBuilder",
    "shm_comm": "ShareMemCommBuilder", "spatial_inference": "SpatialInferenceBuilder",
    "stochastic_transformer": "StochasticTransformerBuilder", "transformer": "TransformerBuilder",
    "transformer_inference": "InferenceBuilder",
}


def builder_class(op):
    """'fused_adam' -> 'FusedAdamBuilder'; unknown names by DeepSpeed's own convention."""
    return BUILDERS.get(op) or "".join(w.capitalize() for w in op.split("_")) + "Builder"


def installed_key(op, installed):
    """installed_ops names shm_comm 'deepspeed_shm_comm'."""
    return op if op in installed or f"deepspeed_{op}" not in installed else f"deepspeed_{op}"


def why_not_prebuilt(op, installed, built_for, runtime, wanted):
    """None when DeepSpeed will import the prebuilt op, else the reason it would JIT-compile."""
    key = installed_key(op, installed)
    if runtime != wanted:
        return f"run-time accelerator {runtime!r}, not {wanted!r}"
    if built_for != runtime:
        return f"wheel's ops built for accelerator {built_for!r}, run-time {runtime!r}: would JIT"
    if not installed.get(key):
        return f"not prebuilt (installed_ops[{key!r}]={installed.get(key)!r}): would JIT"
    return None


def accelerator_record(built_for, runtime, wanted, torch_cuda):
    """One line for the whole step: does the wheel match the accelerator we ask for?"""
    ok = built_for == runtime == wanted
    hint = "" if ok or torch_cuda or wanted != "cuda" else "; this torch has no CUDA"
    return ("nocompile.ops_accelerator", PASS if ok else FAIL, f"{wanted!r} (manifest)",
            f"built for {built_for!r}, run-time {runtime!r}", hint.lstrip("; "))


def load_op(op, wanted, rec):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    check = f"nocompile.prebuilt_{op}"
    runtime = get_accelerator()._name
    reason = why_not_prebuilt(op, installed_ops, accelerator_name, runtime, wanted)
    if reason:  # do not call load(): it would start a JIT build of minutes
        return rec.add(check, FAIL, f"prebuilt for {wanted!r}", reason)
    builder = get_accelerator().create_op_builder(builder_class(op))
    if builder is None:
        return rec.add(check, FAIL, builder_class(op), f"no such builder for {runtime!r}")
    try:
        module = builder.load()
    except Exception as e:
        return rec.add(check, FAIL, "load() imports the prebuilt op", f"{type(e).__name__}: {e}"[:300])
    rec.add(check, PASS, actual=f"loaded {getattr(module, '__name__', module)}")


def jit_build(op, rec):
    """INFO, never FAIL: DS_ACCELERATOR=cpu JIT-compiles by design (the wheel's ops are
    for cuda); a failed build shows up again as the failing family's own error."""
    from deepspeed.accelerator import get_accelerator
    t0 = time.monotonic()
    try:
        get_accelerator().create_op_builder(builder_class(op)).load()
        # Built now, or found up to date (the image's baked CPU ops): cpu_jit_builds tells which.
        actual = f"ready in {time.monotonic() - t0:.1f} s"
    except Exception as e:
        actual = f"build failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    rec.add(f"nocompile.cpu_jit_{op}", INFO, actual=actual,
            detail=f"DS_ACCELERATOR={get_accelerator()._name}")


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    jit = "--jit" in args
    ops = [o for a in args if a != "--jit" for o in a.split(",") if o]
    if jit:
        rec = Recorder(os.environ.get("PCR_RESULTS_DIR"), os.environ.get("PCR_RUN", ""), 0)
        for op in ops:
            jit_build(op, rec)
        return 0
    wanted = os.environ.get("DS_ACCELERATOR", "")
    rec = Recorder(os.environ.get("PCR_RESULTS_DIR"), os.environ.get("PCR_RUN", ""), 0)
    try:
        import torch
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name
        runtime = get_accelerator()._name
    except Exception as e:  # every op then fails with the same cause
        for op in ops:
            rec.add(f"nocompile.prebuilt_{op}", FAIL, actual=f"DeepSpeed unusable: {e!r}"[:300])
        traceback.print_exc()
        return 1
    check, status, expected, actual, detail = accelerator_record(
        accelerator_name, runtime, wanted, torch.version.cuda)
    rec.add(check, status, expected, actual, detail)
    for op in ops:
        load_op(op, wanted, rec)
    return 0 if all(r["status"] != FAIL for r in rec.records) else 1


if __name__ == "__main__":
    sys.exit(main())
