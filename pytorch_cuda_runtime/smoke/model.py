"""The tiny model and data shared by the ZeRO-3 and FSDP2 checks.

A few Linear layers keep a 2-rank CPU run fast; a fixed batch per rank makes the
loss fall reliably within a dozen Adam steps.
"""
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
    ok = all(l == l for l in losses) and losses[-1] < losses[0]
    rec.check(f"{family}.loss_falls", ok, "last < first",
              f"{losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")


def check_share(rec, family, local, total, world):
    """Each rank holds about 1/world of the parameters (padding allowed)."""
    share = local / total
    ok = abs(share - 1.0 / world) <= 0.02
    rec.check(f"{family}.param_share", ok, f"~1/{world}", f"{local}/{total} = {share:.3f}")
