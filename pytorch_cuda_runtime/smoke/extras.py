"""Check: the train flavor's extras (manifest `extras`), on the CPU and on each GPU.

Runs as its own child process, `python -m pytorch_cuda_runtime.smoke.extras`, with
DS_ACCELERATOR=cuda (the accelerator the image's ops are built for) and an empty
TORCH_EXTENSIONS_DIR that must stay empty. Transformer Engine is imported first, before torch,
as a user's script would: its core library must find NCCL on its own (the image's LD_LIBRARY_PATH).

CPU half, on every host:
  extras.versions.<name>   the installed version is the one the lock pins
  extras.import.<name>     each extra imports (nothing is compiled); Liger's kernels too, except where an
                           older Triton needs a GPU driver to import them (skipped with the reason)
  extras.te.libraries      TE's libraries resolve from the image, except libcuda.so.1 (the driver),
                           which only libnccl_ep.so (TE's NCCL expert-parallel, loaded on demand) names
  extras.te.prebuilt       the loaded extension module is the one the builder stage compiled
  extras.torchao.ops       torchao's C++ ops load against this torch (a mismatch only warns)
GPU half, per feature, skipped with the reason where the GPU lacks it:
  extras.te.fp8_linear     a TE Linear forward and backward under FP8 (sm_89 and newer)
  extras.fa4.attention     FlashAttention 4 forward and backward against SDPA (sm_90, sm_100, sm_103)
  extras.liger.cross_entropy  Liger's fused cross-entropy loss and gradient against torch's
  extras.torchao.float8_step  a training step of torchao float8 linears (sm_89 and newer)
"""
import glob
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import warnings

from .. import manifest as mf
from .results import Recorder

IMPORTS = {"transformer-engine": "transformer_engine.pytorch", "flash-attn-4": "flash_attn.cute",
           "liger-kernel": "liger_kernel", "torchao": "torchao"}
# Modules that import Triton's active driver: with Triton 3.3 (torch 2.7) that needs libcuda.so.1,
# so without a GPU they are skipped with the reason; Triton 3.6 (torch 2.11) imports them anyway.
DRIVER_IMPORTS = {"liger-kernel": "liger_kernel.transformers"}
TE_FACTS = "/opt/pytorch-cuda/te-facts.json"
DRIVER = "libcuda.so.1"
# Lazily loaded parts of TE that may name the driver: NCCL's expert-parallel plug-in.
DRIVER_OK = ("libnccl_ep.so",)


def site_packages():
    import sysconfig
    return sysconfig.get_paths()["purelib"]


def library_dirs():
    """Where the image's CUDA libraries live: every nvidia/*/lib of the venv, and torch/lib."""
    sp = site_packages()
    return sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))) + [os.path.join(sp, "torch", "lib")]


def unresolved(path, dirs):
    """The libraries `ldd` cannot find for one shared object, given the image's library dirs."""
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(dirs))
    out = subprocess.run(["ldd", path], capture_output=True, text=True, env=env).stdout
    return sorted(set(re.findall(r"^\s*(\S+) => not found", out, re.M)))


def check_te_libraries(rec):
    import transformer_engine
    root = os.path.dirname(transformer_engine.__file__)
    sos = sorted(glob.glob(os.path.join(root, "**", "*.so*"), recursive=True))
    dirs = library_dirs()
    missing = {os.path.basename(p): unresolved(p, dirs) for p in sos}
    bad = {so: libs for so, libs in missing.items() if libs and (libs != [DRIVER] or not so.startswith(DRIVER_OK))}
    driver = sorted(so for so, libs in missing.items() if libs == [DRIVER])
    rec.check("extras.te.libraries", not bad and bool(sos), f"every library of {len(sos)} resolves but {DRIVER} (lazy parts)",
              bad or f"only {', '.join(driver) or 'none'} name(s) {DRIVER}")


def check_te_prebuilt(rec):
    import transformer_engine_torch as tex  # the compiled extension module
    try:
        with open(TE_FACTS, encoding="utf-8") as f:
            facts = json.load(f)
    except OSError as e:
        rec.add("extras.te.prebuilt", "FAIL", expected=TE_FACTS, actual=str(e))
        return
    loaded = os.path.relpath(os.path.realpath(tex.__file__), site_packages())
    rec.check("extras.te.prebuilt", loaded == facts.get("module"), facts.get("module"), loaded,
              detail=f"compiled at build time in {facts.get('compile_seconds')} s")


def check_torchao_ops(rec, torch):
    import torchao
    sos = sorted(glob.glob(os.path.join(os.path.dirname(torchao.__file__), "*.so")))
    if not sos:
        rec.add("extras.torchao.ops", "SKIPPED", detail="this platform's torchao wheel is pure Python (no C++ ops)")
        return
    errors = []
    for so in sos:
        try:
            torch.ops.load_library(so)
        except Exception as e:  # torchao itself only warns on a mismatch
            errors.append(f"{os.path.basename(so)}: {type(e).__name__}: {e}")
    ops = sorted(n for n in dir(torch.ops.torchao) if not n.startswith("_"))
    rec.check("extras.torchao.ops", not errors and bool(ops), f"{len(sos)} libraries load, ops registered",
              errors or f"{len(ops)} ops, e.g. {', '.join(ops[:3])}")


def import_needing_driver(rec, module, gpu):
    """Import a module that Triton may need a GPU driver for: without a GPU, Triton's own 'no active
    driver' error is a skip with the reason (older Triton raises it on import), any other a failure."""
    try:
        importlib.import_module(module)
        rec.add(f"extras.import.{module}", "PASS", actual=module)
    except RuntimeError as e:
        if gpu or "active drivers" not in str(e):
            rec.add(f"extras.import.{module}", "FAIL", expected=f"import {module}", actual=f"RuntimeError: {e}")
        else:
            rec.add(f"extras.import.{module}", "SKIPPED", detail=f"Triton finds no GPU driver ({e}): imported on GPU hosts")
    except Exception as e:
        rec.add(f"extras.import.{module}", "FAIL", expected=f"import {module}", actual=f"{type(e).__name__}: {e}")


def cpu_half(rec, manifest):
    pins = manifest.get("extras") or {}
    for name, why in (manifest.get("extras_not_carried") or {}).items():  # a gpu-bundle's manifest
        rec.add(f"extras.{name}", "SKIPPED", detail=f"not in this bundle: {why}; its checks run in the image")
    # TE first, before anything imports torch: the order a user's script may have.
    order = sorted(pins, key=lambda n: n != "transformer-engine")
    for name in order:
        try:
            importlib.import_module(IMPORTS[name])
            rec.add(f"extras.import.{name}", "PASS", actual=IMPORTS[name])
        except Exception as e:
            rec.add(f"extras.import.{name}", "FAIL", expected=f"import {IMPORTS.get(name)}", actual=f"{type(e).__name__}: {e}")
    import torch
    for name, module in DRIVER_IMPORTS.items():
        if name in pins:
            import_needing_driver(rec, module, torch.cuda.is_available())
    for name, version in pins.items():
        try:
            got = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            got = None
        rec.check(f"extras.versions.{name}", mf.versions_match(version, got), version, got)
    if "transformer-engine" in pins:
        for check in (check_te_libraries, check_te_prebuilt):
            try:
                check(rec)
            except Exception as e:
                rec.add(f"extras.te.{check.__name__.removeprefix('check_te_')}", "FAIL", actual=f"{type(e).__name__}: {e}")
    if "torchao" in pins:
        check_torchao_ops(rec, torch)
    return torch


def _close(a, b, tol):
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
    return err < tol, f"{err:.2e}"


def te_fp8_linear(torch, dev):
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    autocast = getattr(te, "autocast", None)
    ctx = autocast(enabled=True, recipe=recipe.DelayedScaling()) if autocast else te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling())
    with ctx:
        y = layer(x)
    y.float().square().mean().backward()
    ref = torch.nn.functional.linear(x.detach().float(), layer.weight.detach().float(), layer.bias.detach().float())
    ok, err = _close(y.detach(), ref, 0.15)  # FP8 (E4M3) keeps about 2 significant digits
    return ok and x.grad is not None and torch.isfinite(x.grad).all().item(), f"rel err vs fp32 {err}, grad finite"


def fa4_attention(torch, dev):
    from flash_attn.cute import flash_attn_func
    q, k, v = (torch.randn(2, 256, 4, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q2, k2, v2)), is_causal=True).transpose(1, 2)
    ref.float().square().mean().backward()
    ok_out, err = _close(out.detach(), ref.detach(), 2e-2)
    ok_grad, gerr = _close(grads[0], q2.grad, 5e-2)
    return ok_out and ok_grad, f"out rel err {err}, dq rel err {gerr}"


def liger_cross_entropy(torch, dev):
    from liger_kernel.transformers import LigerCrossEntropyLoss
    logits = torch.randn(128, 1024, device=dev, requires_grad=True)
    target = torch.randint(0, 1024, (128,), device=dev)
    loss = LigerCrossEntropyLoss()(logits, target)
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits, target)
    ref.backward()
    ok, err = _close(loss.detach(), ref.detach(), 1e-4)
    ok_grad, gerr = _close(logits.grad, ref_logits.grad, 1e-3)
    return ok and ok_grad, f"loss rel err {err}, grad rel err {gerr}"


def torchao_float8_step(torch, dev):
    from torchao.float8 import convert_to_float8_training
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(dev, torch.bfloat16)
    convert_to_float8_training(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    kinds = sorted({type(m).__name__ for m in model.modules() if "Float8" in type(m).__name__})
    return bool(kinds) and torch.isfinite(loss).item(), f"loss {loss.item():.3f}, modules {kinds}"


# name, check, extra it needs, the capabilities it runs on (None: any), why others are skipped
GPU_CHECKS = [
    ("extras.te.fp8_linear", te_fp8_linear, "transformer-engine", lambda c: c >= (8, 9), "FP8 needs sm_89 or newer"),
    ("extras.fa4.attention", fa4_attention, "flash-attn-4", lambda c: c[0] in (9, 10), "FA4's kernels are for sm_90 and sm_100/103"),
    ("extras.liger.cross_entropy", liger_cross_entropy, "liger-kernel", lambda c: True, ""),
    ("extras.torchao.float8_step", torchao_float8_step, "torchao", lambda c: c >= (8, 9), "float8 needs sm_89 or newer"),
]


def gpu_half(rec, torch, manifest):
    pins = manifest.get("extras") or {}
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        dev = torch.device("cuda", i)
        for name, check, extra, runs_on, why in GPU_CHECKS:
            where = f"{name}[cuda:{i}]"
            if extra not in pins:
                continue
            if not runs_on(cap):
                rec.add(where, "SKIPPED", detail=f"sm_{cap[0]}{cap[1]}: {why}")
                continue
            try:
                with torch.cuda.device(i):
                    ok, how = check(torch, dev)
                rec.check(where, ok, "matches the reference", how, detail=torch.cuda.get_device_name(i))
            except Exception as e:
                rec.add(where, "FAIL", actual=f"{type(e).__name__}: {e}"[:500])


def main():
    rec = Recorder(os.environ.get("PCR_RESULTS_DIR"), os.environ.get("PCR_RUN", ""), 0)
    manifest = mf.load()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch = cpu_half(rec, manifest)
    mismatch = [str(w.message) for w in seen if "torchao" in str(w.message).lower() and "skip" in str(w.message).lower()]
    if mismatch:
        rec.add("extras.torchao.compatible", "FAIL", actual=mismatch[0][:300])
    if torch.cuda.is_available():
        gpu_half(rec, torch, manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
