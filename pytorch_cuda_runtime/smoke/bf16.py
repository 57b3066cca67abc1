"""One process: a bf16 autocast training loop on the tiny model (GPU, and CPU too)."""
from . import model as M


def run(ctx):
    import torch
    model = M.build().to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = M.batch(0, ctx.device)
    losses, dtypes = [], set()
    for _ in range(M.STEPS):
        with torch.autocast(device_type=ctx.device_type, dtype=torch.bfloat16):
            out = model(x)
        dtypes.add(str(out.dtype))
        # The loss in fp32, outside autocast, as mixed-precision recipes do.
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ctx.rec.check("bf16.autocast_dtype", dtypes == {"torch.bfloat16"}, "torch.bfloat16",
                  sorted(dtypes))
    # autocast casts per op; the weights and their updates stay fp32.
    kept = {str(p.dtype) for p in model.parameters()}
    ctx.rec.check("bf16.params_fp32", kept == {"torch.float32"}, "torch.float32", sorted(kept))
    M.check_loss(ctx.rec, "bf16", losses)
