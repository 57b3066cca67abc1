"""DistributedDataParallel through torchrun: loss falls, every rank ends with the same weights."""
from . import model as M


def run(ctx):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    ctx.init_torch_dist()
    model = M.build().to(ctx.device)
    # device_ids only for a GPU: for CPU modules DDP requires None.
    ddp = DistributedDataParallel(model, device_ids=[ctx.local_rank]
                                  if ctx.device_type == "cuda" else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    x, y = M.batch(ctx.rank, ctx.device)  # a different batch per rank: equal weights prove averaging
    losses = []
    for _ in range(M.STEPS):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    M.check_loss(ctx.rec, "ddp", losses)
    M.check_replicated(ctx.rec, "ddp", model, dist, torch)
