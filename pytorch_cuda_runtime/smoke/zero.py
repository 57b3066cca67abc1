"""DeepSpeed ZeRO stages 1, 2 and 3 train, partition, checkpoint and consolidate exactly.

One code path, parametrised by VARIANTS: the stage, optimizer offload to the CPU
(DeepSpeedCPUAdam, the cpu_adam op), which Adam DeepSpeed builds from the config
(its default, FusedAdam, or torch's), and for zero3_launcher a start through the
`deepspeed` launcher with consolidation through the zero_to_fp32 command.
"""
import glob
import os
import shutil
import subprocess
import sys
from typing import Any

from . import model as M

TAG = "final"
# The 0.17.6 race (see _check_gathered) needs some bytes in flight to show: measured here
# with unpatched 0.17.6 on 2 gloo ranks, 8 Linear(512, 512) read half-gathered in ~1
# round of 8 (6 params of the tiny model: 0 of 20), so 60 rounds miss it ~1 run in 2000.
GATHER_ROUNDS = 20
WIDE_ROUNDS, WIDE_WIDTH, WIDE_LAYERS = 60, 512, 8

# adam: "default" is DeepSpeed's own choice for {"type": "Adam"} (FusedAdam; DeepSpeedCPUAdam
# when offloaded), "torch" adds "torch_adam": true. Both configs users write must work.
VARIANTS = {
    "zero1": {"stage": 1, "offload": False, "adam": "default"},
    "zero1_offload": {"stage": 1, "offload": True, "adam": "default"},
    "zero2": {"stage": 2, "offload": False, "adam": "default"},
    "zero2_offload": {"stage": 2, "offload": True, "adam": "default"},
    "zero3": {"stage": 3, "offload": False, "adam": "torch"},
    "zero3_offload": {"stage": 3, "offload": True, "adam": "default"},
    "zero3_launcher": {"stage": 3, "offload": False, "adam": "torch", "cli": True},
}


def ds_config(world, stage, offload, adam="default"):
    """Raw DeepSpeed accepts no "auto": every size is an integer."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # shard even the tiny biases
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    opt: dict[str, Any] = {"type": "Adam", "params": {"lr": 1e-2}}
    if adam == "torch":
        opt["params"]["torch_adam"] = True
    return {"train_batch_size": M.BATCH * world, "train_micro_batch_size_per_gpu": M.BATCH,
            "gradient_accumulation_steps": 1, "optimizer": opt, "zero_optimization": zero,
            "steps_per_print": 1000, "wall_clock_breakdown": False}


def expected_optimizer(offload, adam):
    """The optimizer classes DeepSpeed may build for this config. {"type": "Adam"} means
    AdamW unless "adam_w_mode": false, so torch_adam gives torch's AdamW."""
    if offload:
        return ("DeepSpeedCPUAdam",)
    return ("AdamW", "Adam") if adam == "torch" else ("FusedAdam",)


def run(ctx, family):
    import deepspeed
    import torch
    import torch.distributed as dist
    v = VARIANTS[family]
    deepspeed.init_distributed(dist_backend=ctx.backend, timeout=ctx.timeout)
    ctx.check_world(dist.get_world_size())
    cfg = ds_config(ctx.world, v["stage"], v["offload"], v["adam"])
    engine, _, _, _ = deepspeed.initialize(model=M.build(), config=cfg, model_parameters=None)
    want = expected_optimizer(v["offload"], v["adam"])
    name = type(engine.optimizer.optimizer).__name__
    # Name kept from the ZeRO-3-only suite: reports and tests look for `<family>.cpu_adam`.
    check = "cpu_adam" if v["offload"] else "optimizer"
    ctx.rec.check(f"{family}.{check}", name in want, " or ".join(want), name)
    _train(ctx, family, engine, torch)
    if v["stage"] == 3:
        reference = _check_stage3(ctx, family, engine, deepspeed, dist, torch)
        _check_wide_gather(ctx, family, cfg, deepspeed, dist, torch)
    else:
        reference = _check_stage12(ctx, family, engine, dist, torch)
    ckpt = os.path.join(ctx.work, f"{family}_ckpt")
    engine.save_checkpoint(ckpt, tag=TAG)
    dist.barrier()
    if ctx.rank == 0:
        plain = M.build()
        plain.load_state_dict((_consolidate_cli if v.get("cli") else _consolidate_api)(ckpt),
                              strict=True)
        M.compare_state(ctx.rec, f"{family}.consolidated", reference, plain.state_dict())
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


def _check_stage3(ctx, family, engine, deepspeed, dist, torch):
    params = list(engine.module.parameters())
    M.check_share(ctx.rec, family, sum(p.ds_tensor.numel() for p in params),
                  sum(p.ds_numel for p in params), ctx.world)
    reference = _assemble_shards(engine.module, dist, torch)
    _check_gathered(ctx, f"{family}.gathered_parameters", engine.module, reference,
                    GATHER_ROUNDS, deepspeed, torch)
    return reference


def _check_wide_gather(ctx, family, cfg, deepspeed, dist, torch):
    """The same check on a model wide enough for the race to show (built by zero.Init,
    the way large models are, so it is partitioned from the start)."""
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        wide = torch.nn.Sequential(*[torch.nn.Linear(WIDE_WIDTH, WIDE_WIDTH)
                                     for _ in range(WIDE_LAYERS)])
    _check_gathered(ctx, f"{family}.gathered_parameters_wide", wide,
                    _assemble_shards(wide, dist, torch), WIDE_ROUNDS, deepspeed, torch)


def _check_stage12(ctx, family, engine, dist, torch):
    """Stages 1/2 keep full parameters on every rank and split the optimizer's fp32
    master weights and Adam moments: each rank's part is about 1/world."""
    module = engine.module
    total = sum(p.numel() for p in module.parameters())
    master = engine.optimizer.single_partition_of_fp32_groups
    M.check_share(ctx.rec, family, sum(p.numel() for p in master), total, ctx.world,
                  what="optimizer_share")
    moments = [engine.optimizer.optimizer.state[p].get("exp_avg") for p in master]
    held = sum(m.numel() for m in moments if m is not None)
    ctx.rec.check(f"{family}.adam_state_partitioned", held == sum(p.numel() for p in master),
                  "exp_avg sized like this rank's partition", f"{held} of {total} elements")
    M.check_replicated(ctx.rec, family, module, dist, torch)
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


def _assemble_shards(module, dist, torch):
    """Every full parameter, put together from the shards the ranks hold, with plain
    blocking all_gathers: the reference the checkpoint and GatheredParameters must equal."""
    full = {}
    for name, p in module.named_parameters():
        shard = p.ds_tensor.detach().reshape(-1).clone()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        full[name] = torch.cat(parts)[:p.ds_numel].view(p.ds_shape).cpu()
    return full


def _check_gathered(ctx, check, module, reference, rounds, deepspeed, torch):
    """GatheredParameters over ALL parameters at once, read at once, several rounds.

    DeepSpeed 0.17.6's `_allgather_params_coalesced` waited only on the last of its
    async all_gathers (fixed by DeepSpeed PR #8539, patched in our image build). CUDA
    streams hid it; gloo's worker threads did not, so a parameter was now and then
    read half-gathered. An unpatched DeepSpeed fails this on CPU ranks.
    """
    params = list(module.parameters())
    bad = []
    for i in range(rounds):
        with deepspeed.zero.GatheredParameters(params):
            got = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
        differ = [n for n in reference if not torch.equal(got[n], reference[n])]
        if differ:
            bad.append(f"round {i}: {','.join(differ)}")
    ctx.rec.check(check, not bad, f"{rounds} gathers of {len(params)} params equal the shards",
                  f"{len(bad)} rounds differ: " + "; ".join(bad[:3]) if bad
                  else f"{rounds} x {len(params)} params equal")


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
