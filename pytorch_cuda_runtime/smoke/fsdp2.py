"""Check 5: FSDP2 (fully_shard) trains, shards, saves a DCP checkpoint that
dcp_to_torch_save consolidates into exactly the gathered weights."""
import os

from . import model as M


def import_fully_shard():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def run(ctx):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    ctx.init_torch_dist()
    fully_shard = import_fully_shard()
    mesh = init_device_mesh(ctx.device_type, (ctx.world,))
    model = M.build().to(ctx.device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(ctx, model, torch)
    params = list(model.parameters())
    M.check_share(ctx.rec, "fsdp2", sum(p.to_local().numel() for p in params),
                  sum(p.numel() for p in params), ctx.world)
    full = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    ckpt = os.path.join(ctx.work, "fsdp2_dcp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    dist.barrier()
    if ctx.rank == 0:
        _consolidate_and_compare(ctx, ckpt, full, torch)


def _train(ctx, model, torch):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = M.batch(ctx.rank, ctx.device)
    losses = []
    for _ in range(M.STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    M.check_loss(ctx.rec, "fsdp2", losses)


def _consolidate_and_compare(ctx, ckpt, full, torch):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = ckpt + ".pt"
    dcp_to_torch_save(ckpt, out)
    sd = torch.load(out, map_location="cpu", weights_only=True)["model"]
    plain = M.build()
    plain.load_state_dict(sd, strict=True)
    M.compare_state(ctx.rec, "fsdp2.consolidated", full, plain.state_dict())
