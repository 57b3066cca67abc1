"""The tiny model, data and shared checks of the training families.

A few Linear layers keep a 2-rank CPU run fast; a fixed batch per rank makes the
loss fall reliably within a dozen Adam steps.
"""
import math

STEPS = 12
BATCH = 8
IN = 32
HIDDEN = 64


def build():
    import torch
    from torch import nn
    torch.manual_seed(0)  # same init on every rank and in the plain reference model
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, 1))


def batch(rank, device):
    import torch
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    y = 0.1 * x.sum(dim=1, keepdim=True)
    return x.to(device), y.to(device)


def compare_state(rec, check, reference, loaded_sd):
    """Exact match of every tensor; reports the worst offender when not."""
    import torch
    keys_ok = sorted(reference) == sorted(loaded_sd)
    if not rec.check(f"{check}.keys", keys_ok, sorted(reference), sorted(loaded_sd)):
        return False
    bad = [(k, (reference[k].float() - loaded_sd[k].float()).abs().max().item())
           for k in reference if not torch.equal(reference[k].cpu(), loaded_sd[k].cpu())]
    return rec.check(f"{check}.exact", not bad, "all tensors equal",
                     f"{len(bad)} differ, worst {max(bad, key=lambda b: b[1])}" if bad
                     else f"{len(reference)} tensors equal")


def check_loss(rec, family, losses):
    ok = all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    rec.check(f"{family}.loss_falls", ok, "last < first",
              f"{losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")


def check_share(rec, family, local, total, world, what="param_share"):
    """Each rank holds about 1/world of the elements (padding allowed)."""
    share = local / total
    ok = abs(share - 1.0 / world) <= 0.02
    rec.check(f"{family}.{what}", ok, f"~1/{world}", f"{local}/{total} = {share:.3f}")


def check_replicated(rec, family, module, dist, torch):
    """Every rank holds the same full parameters, bit for bit, after training on
    different batches: the gradients were averaged and every rank stepped alike."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    differ = [i for i, t in enumerate(parts) if not torch.equal(t, parts[0])]
    rec.check(f"{family}.params_replicated", not differ, "all ranks equal to rank 0",
              f"ranks {differ} differ" if differ else f"{flat.numel()} params x {len(parts)} ranks")
