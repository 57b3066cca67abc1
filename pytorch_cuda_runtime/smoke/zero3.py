"""Check 4: DeepSpeed ZeRO-3 trains, shards, checkpoints and consolidates exactly.

Three variants share this code: plain (torch Adam), optimizer offloaded to the CPU
(DeepSpeedCPUAdam, i.e. the prebuilt cpu_adam op), and launched through the
`deepspeed` launcher with consolidation through the zero_to_fp32 command.
"""
import glob
import os
import shutil
import subprocess
import sys

from . import model as M

TAG = "final"


def ds_config(world, offload):
    """Raw DeepSpeed accepts no "auto": every size is an integer."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    opt = {"type": "Adam", "params": {"lr": 1e-2}}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        opt["params"]["torch_adam"] = True  # FusedAdam would need a JIT build
    return {"train_batch_size": M.BATCH * world, "train_micro_batch_size_per_gpu": M.BATCH,
            "gradient_accumulation_steps": 1, "optimizer": opt, "zero_optimization": zero,
            "steps_per_print": 1000, "wall_clock_breakdown": False}


def run_plain(ctx):
    _run(ctx, "zero3", offload=False, consolidate=_consolidate_api)


def run_offload(ctx):
    _run(ctx, "zero3_offload", offload=True, consolidate=_consolidate_api)


def run_launcher(ctx):
    _run(ctx, "zero3_launcher", offload=False, consolidate=_consolidate_cli)


def _run(ctx, family, offload, consolidate):
    import deepspeed
    import torch
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend=ctx.backend, timeout=ctx.timeout)
    ctx.check_world(dist.get_world_size())
    engine, _, _, _ = deepspeed.initialize(model=M.build(), config=ds_config(ctx.world, offload),
                                           model_parameters=None)
    if offload:
        name = type(engine.optimizer.optimizer).__name__
        ctx.rec.check(f"{family}.cpu_adam", name == "DeepSpeedCPUAdam", "DeepSpeedCPUAdam", name)
    _train(ctx, family, engine, torch)
    params = list(engine.module.parameters())
    M.check_share(ctx.rec, family, sum(p.ds_tensor.numel() for p in params),
                  sum(p.ds_numel for p in params), ctx.world)
    ckpt = os.path.join(ctx.work, f"{family}_ckpt")
    engine.save_checkpoint(ckpt, tag=TAG)
    gathered = _assemble_shards(engine.module, dist, torch)
    dist.barrier()
    if ctx.rank == 0:
        plain = M.build()
        plain.load_state_dict(consolidate(ckpt), strict=True)
        M.compare_state(ctx.rec, f"{family}.consolidated", gathered, plain.state_dict())
    dist.barrier()


def _train(ctx, family, engine, torch):
    x, y = M.batch(ctx.rank, engine.device)
    losses = []
    for _ in range(M.STEPS):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    M.check_loss(ctx.rec, family, losses)


def _assemble_shards(module, dist, torch):
    """Every full parameter, put together from the shards the ranks hold, with plain
    blocking all_gathers: the reference the consolidated checkpoint must equal.

    Not deepspeed.zero.GatheredParameters: in DeepSpeed 0.17.6 (our torch <= 2.7
    rows) `_allgather_params_coalesced` waits only on the last of its async
    all_gathers. CUDA streams make that safe, gloo's worker threads do not, so on
    CPU ranks a parameter was now and then read half-gathered (fixed in 0.19.8).
    """
    full = {}
    for name, p in module.named_parameters():
        shard = p.ds_tensor.detach().reshape(-1).clone()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        full[name] = torch.cat(parts)[:p.ds_numel].view(p.ds_shape).cpu()
    return full


def _consolidate_api(ckpt):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=TAG)


def _consolidate_cli(ckpt):
    """The image's `zero_to_fp32` command when on PATH, else DeepSpeed's module."""
    import torch
    out = ckpt + "_fp32"
    cmd = [shutil.which("zero_to_fp32") or sys.executable]
    if cmd[0] == sys.executable:
        cmd += ["-m", "deepspeed.utils.zero_to_fp32"]
    subprocess.run(cmd + [ckpt, out, "-t", TAG], check=True, timeout=300,
                   stdout=sys.stdout, stderr=sys.stderr)
    files = sorted(glob.glob(os.path.join(out, "*.bin"))) or [out]  # dir (new) or file (old)
    sd = {}
    for f in files:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd
