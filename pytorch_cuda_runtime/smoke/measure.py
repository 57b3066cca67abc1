"""One process on GPU 0: a short sanity measure, recorded as INFO and never asserted.

  measure.matmul_bf16   TFLOP/s of a large square bf16 product (cuBLAS), beside the device's
                        published dense bf16 peak where gpupeaks.py knows the device: a figure far
                        below the peak points at the stack under torch (driver, cuBLAS, clocks)
  measure.tokens        tokens/s of the smoke model's training step (model.py), eager and under
                        torch.compile; a token is one row of the batch (the model is a per-token MLP)

A GPU's figures vary with clocks, power and what else runs: they say whether the stack is
healthy, not how fast a real model trains. Without a GPU every record is SKIPPED.
"""
import time

from .. import gpupeaks
from . import model as M

N = 8192  # 2 * N**3 = 1.1 TFLOP per product: long enough to leave launch overheads behind
REPEATS = 20
TOKENS = 65536  # rows per step: enough to keep a GPU busy with the smoke model's widths
STEPS = 20


def peak(name):
    """(TFLOP/s, the product) of the device's dense bf16 peak (gpupeaks.py, each with its source), else (None, None)."""
    return gpupeaks.peak(name)


def matmul_tflops(torch, device):
    a = torch.randn(N, N, device=device, dtype=torch.bfloat16)
    b = torch.randn(N, N, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS picks its kernel and the clocks rise
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return 2 * N**3 * REPEATS / seconds / 1e12


def tokens_per_second(torch, device, compiled):
    model = M.build().to(device)
    step_model = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, M.IN, generator=g).to(device)
    y = 0.1 * x.sum(dim=1, keepdim=True)

    def step():
        loss = torch.nn.functional.mse_loss(step_model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # compiles here, outside the timed steps
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return TOKENS * STEPS / (time.perf_counter() - t0)


def run(ctx):
    if ctx.device_type != "cuda":
        for check in ("measure.matmul_bf16", "measure.tokens_eager", "measure.tokens_compiled"):
            ctx.rec.add(check, "SKIPPED", detail="a GPU measure: no GPU in this run")
        return
    import torch
    device = ctx.device
    name = torch.cuda.get_device_name(device)
    tflops = matmul_tflops(torch, device)
    top, matched = peak(name)
    beside = (f"{100 * tflops / top:.0f}% of the {top:g} TFLOP/s dense bf16 peak published for {matched}" if top
              else f"no published peak recorded here for {name}")
    ctx.rec.info("measure.matmul_bf16", f"{tflops:.1f} TFLOP/s", f"{N}x{N} bf16 @ {N}x{N}, {REPEATS} products on {name}; "
                 f"{beside}; recorded, never asserted")
    for compiled in (False, True):
        rate = tokens_per_second(torch, device, compiled)
        ctx.rec.info(f"measure.tokens_{'compiled' if compiled else 'eager'}", f"{rate:,.0f} tokens/s",
                     f"the smoke model's training step, {TOKENS} tokens a step, {STEPS} steps"
                     f"{', torch.compile (Inductor, Triton)' if compiled else ', eager'}; recorded, never asserted")
