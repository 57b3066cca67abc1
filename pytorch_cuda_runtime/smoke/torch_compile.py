"""One process: torch.compile (Inductor: C++ on the CPU, Triton on a GPU) equals eager.

The orchestrator points TORCHINDUCTOR_CACHE_DIR (and Triton's) at a fresh directory,
so the code is really generated here, not taken from an earlier run's cache.
"""
import os
import time

from . import model as M

RTOL = 1e-4


def run(ctx):
    import torch
    model = M.build().to(ctx.device).eval()
    x, _ = M.batch(0, ctx.device)
    sync = torch.cuda.synchronize if ctx.device_type == "cuda" else (lambda: None)
    with torch.no_grad():
        eager = model(x)
        t0 = time.perf_counter()
        compiled = torch.compile(model)  # default backend: inductor
        got = compiled(x)
        sync()
        seconds = time.perf_counter() - t0
    ctx.rec.info("compile.compile_seconds", f"{seconds:.1f} s",
                 f"first call, inductor on {ctx.device_type}")
    err = (got - eager).abs().max().item()
    tol = RTOL * max(eager.abs().max().item(), 1.0)
    ctx.rec.check("compile.matches_eager", err <= tol, f"max abs err <= {tol:.1e}", f"{err:.1e}")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    made = sum(len(f) for _, _, f in os.walk(cache)) if cache else 0
    ctx.rec.check("compile.generated_code", made > 0, f"files in {cache}", f"{made} files")
