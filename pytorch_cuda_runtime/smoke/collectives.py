"""Check 3: all_reduce, all_gather and reduce_scatter give exact values; bus bandwidth."""
import time

from ..preflight import report

N = 1024


def run(ctx):
    import torch
    import torch.distributed as dist
    ctx.init_torch_dist()
    dev, r, w = ctx.device, ctx.rank, ctx.world
    _all_reduce(ctx, torch, dist, dev, r, w)
    _all_gather(ctx, torch, dist, dev, r, w)
    _reduce_scatter(ctx, torch, dist, dev, r, w)
    _bus_bandwidth(ctx, torch, dist, dev, w)


def _all_reduce(ctx, torch, dist, dev, r, w):
    t = torch.full((N,), float(r + 1), device=dev)
    dist.all_reduce(t)
    want = w * (w + 1) / 2  # 1 + 2 + ... + w, exact in fp32
    ctx.rec.check("collectives.all_reduce", bool((t == want).all()), want, _seen(t))


def _all_gather(ctx, torch, dist, dev, r, w):
    out = [torch.empty(N, device=dev) for _ in range(w)]
    dist.all_gather(out, torch.full((N,), float(r), device=dev))
    got = [_seen(o) for o in out]
    ctx.rec.check("collectives.all_gather", got == [float(i) for i in range(w)],
                  [float(i) for i in range(w)], got)


def _reduce_scatter(ctx, torch, dist, dev, r, w):
    # Rank k sends chunk j = k*w + j; rank r receives sum_k (k*w + r).
    chunks = [torch.full((N,), float(r * w + j), device=dev) for j in range(w)]
    want = float(sum(k * w + r for k in range(w)))
    out, how = torch.empty(N, device=dev), "native"
    try:
        dist.reduce_scatter(out, chunks)
    except (RuntimeError, NotImplementedError) as e:
        if ctx.backend != "gloo":
            raise
        # Older gloo lacks reduce_scatter: same semantics via all_reduce (the NCCL
        # path is the real target; this keeps the check meaningful on CPU).
        how = f"emulated with all_reduce ({str(e).splitlines()[0][:60]})"
        full = torch.stack(chunks)
        dist.all_reduce(full)
        out = full[r]
    ctx.rec.check("collectives.reduce_scatter", bool((out == want).all()), want, _seen(out),
                  detail=how if how != "native" else "")


def _seen(t):
    """The single value a tensor holds, or a summary when it is not uniform."""
    lo, hi = t.min().item(), t.max().item()
    return lo if lo == hi else f"min {lo} max {hi}"


def _bus_bandwidth(ctx, torch, dist, dev, w):
    """nccl-tests convention (preflight/report.py): busbw = bytes/time * 2(w-1)/w for all_reduce."""
    nbytes = (256 if ctx.device_type == "cuda" else 8) << 20
    iters = 20 if ctx.device_type == "cuda" else 5
    t = torch.ones(nbytes // 4, device=dev)
    sync = torch.cuda.synchronize if ctx.device_type == "cuda" else (lambda: None)
    for _ in range(2):
        dist.all_reduce(t)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    sync()
    dt = (time.perf_counter() - t0) / iters
    algbw, busbw = report.bandwidths("all_reduce", nbytes, dt, w)
    if ctx.rank == 0:
        ctx.rec.info("collectives.bus_bandwidth", f"{busbw:.2f} GB/s",
                     f"all_reduce {nbytes >> 20} MiB x{iters}, algbw {algbw:.2f} GB/s, "
                     f"{dt * 1e3:.1f} ms/op")
