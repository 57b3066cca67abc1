"""Phase 3, one process per rank under `pytorch-cuda-launch`: the fabric measured.

NCCL where torch sees a GPU (one rank per GPU), else gloo on the job's CPU ranks: the same code.
Every collective runs under the process group's timeout (--timeout), so a rank that stops
answering ends the phase instead of hanging it. Every rank reaches the same verdict (times and
counts are reduced across ranks); rank 0 prints the tables and writes the JSON report, and each
node's local rank 0 leaves the verdict where the node's preflight process reads it
(PYTORCH_CUDA_PREFLIGHT_VERDICT).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from . import report

VERDICT = "PYTORCH_CUDA_PREFLIGHT_VERDICT"  # the node process's file for this node's copy of the verdict
NODES = "PYTORCH_CUDA_PREFLIGHT_NODES"  # the roll call's node summaries, GPU part and warnings, for the report
GPU = {"min": 1 << 20, "max": 1 << 30, "factor": 4, "iters": 20, "warmup": 5, "pair": 256 << 20, "pair_iters": 10}
CPU = {"min": 1 << 10, "max": 4 << 20, "factor": 4, "iters": 5, "warmup": 1, "pair": 4 << 20, "pair_iters": 3}


def parse(argv):
    p = argparse.ArgumentParser(prog="pytorch_cuda_runtime.preflight.fabric")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--slow-ratio", type=float, default=report.SLOW_RATIO)
    p.add_argument("--report", default="")
    return p.parse_args(argv)


def sizes(lo, hi, factor):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


class Ranks:
    """The process group and what the measures need of it."""

    def __init__(self, timeout_s):
        import torch  # here: only the ranks import torch, after the node's checks
        import torch.distributed as dist  # here, with torch
        self.torch, self.dist = torch, dist
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.backend = "nccl" if self.cuda else "gloo"
        dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")
        me = (int(os.environ.get("GROUP_RANK", "0")), socket.gethostname().split(".")[0])
        seen: list[Any] = [None] * self.world
        dist.all_gather_object(seen, me)
        order = sorted({g for g, _ in seen})
        self.nodes = report.node_names([next(h for g2, h in seen if g2 == g) for g in order])
        self.node_ranks = [[r for r, (g2, _) in enumerate(seen) if g2 == g] for g in order]

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def slowest(self, seconds, group=None):
        t = self.torch.tensor([seconds], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def timed(self, op, iters, warmup, group=None):
        for _ in range(warmup):
            op()
        self.sync()
        self.dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        self.sync()
        return self.slowest((time.perf_counter() - t0) / iters, group)

    def total(self, count, group=None):
        t = self.torch.tensor([count], dtype=self.torch.int64, device=self.device)
        self.dist.all_reduce(t, group=group)
        return int(t.item())


def all_reduce(rk, size, iters, warmup):
    torch, dist, n = rk.torch, rk.dist, rk.world
    x = torch.ones(size // 4, device=rk.device)
    dist.all_reduce(x)
    wrong = rk.total(int((x != n).sum().item()))
    x.zero_()  # zeros stay zeros: the timed iterations cannot overflow
    return report.row("all_reduce", size, rk.timed(lambda: dist.all_reduce(x), iters, warmup), n, wrong)


def all_gather(rk, size, iters, warmup):
    torch, dist, n = rk.torch, rk.dist, rk.world
    part = max(1, size // 4 // n)
    inp = torch.full((part,), float(rk.rank), device=rk.device)
    out = torch.empty(part * n, device=rk.device)
    dist.all_gather_into_tensor(out, inp)
    want = torch.arange(n, device=rk.device, dtype=out.dtype).repeat_interleave(part)
    wrong = rk.total(int((out != want).sum().item()))
    return report.row("all_gather", part * n * 4, rk.timed(lambda: dist.all_gather_into_tensor(out, inp), iters, warmup), n, wrong)


def neighbours(rk, size, iters):
    """{(i, j): busbw} for each ring pair, measured one pair at a time; the other ranks wait at a barrier."""
    links = {}
    pairs = report.ring_pairs(rk.nodes)
    groups = [rk.dist.new_group(ranks=sorted(rk.node_ranks[a] + rk.node_ranks[b])) for a, b in pairs]
    for (a, b), group in zip(pairs, groups):
        members = rk.node_ranks[a] + rk.node_ranks[b]
        if rk.rank in members:
            x = rk.torch.zeros(size // 4, device=rk.device)
            seconds = rk.timed(lambda: rk.dist.all_reduce(x, group=group), iters, 1, group)
            links[(a, b)] = report.bandwidths("all_reduce", size, seconds, len(members))[1]
        rk.dist.barrier()
    merged: list[Any] = [None] * rk.world
    rk.dist.all_gather_object(merged, links)
    return dict(sorted((pair, bw) for part in merged for pair, bw in part.items()))


def measure(rk, args):
    p = GPU if rk.cuda else CPU
    out = {"backend": rk.backend, "device": "cuda" if rk.cuda else "cpu", "ranks": rk.world, "nodes": rk.nodes,
           "iters": p["iters"], "warmup": p["warmup"]}
    for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather)):
        out[name] = [fn(rk, s, p["iters"], p["warmup"]) for s in sizes(p["min"], p["max"], p["factor"])]
    links = neighbours(rk, p["pair"], p["pair_iters"])
    verdict = report.judge(rk.nodes, links, args.slow_ratio)
    out["neighbours"] = {"size": p["pair"], "iters": p["pair_iters"],
                         "links": [{"nodes": [rk.nodes[a], rk.nodes[b]], "busbw": bw} for (a, b), bw in links.items()],
                         **verdict}
    wrong = [f"{op} gave {r['wrong']} wrong elements at {r['size']} B" for op in ("all_reduce", "all_gather")
             for r in out[op] if r["wrong"]]
    out["lines"] = [f"node {rk.nodes[0]}: rank 0: {w}" for w in wrong] + report.slow_lines(rk.nodes, links, verdict)
    return out, links, verdict


def show(rk, out, links, verdict):
    n = rk.world
    for op in ("all_reduce", "all_gather"):
        print("\n".join(report.table(op, out[op], n, len(rk.nodes), f"{rk.backend}, {out['device']}", out["iters"], out["warmup"])))
    print("\n".join(report.neighbour_table(rk.nodes, links, verdict, out["neighbours"]["size"], out["neighbours"]["iters"])),
          flush=True)


def write_report(path: str, out: dict[str, Any]) -> None:
    """The JSON report, whole or not at all (a temporary name, then renamed); a warning where it cannot be written."""
    try:
        with open(os.environ[NODES], encoding="utf-8") as f:
            out = {**out, **json.load(f)}  # node_checks, gpus, warnings: the roll call's
    except (KeyError, OSError, ValueError):
        pass
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"pytorch-cuda-preflight: report {os.path.abspath(path)}", flush=True)
    except OSError as e:
        print(f"pytorch-cuda-preflight: warning: cannot write the report {path}: {e.strerror}", file=sys.stderr, flush=True)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    rk = Ranks(args.timeout)
    out, links, verdict = measure(rk, args)  # the same on every rank: times and counts are reduced across ranks
    passed = not out["lines"]
    if rk.rank == 0:
        show(rk, out, links, verdict)
        if args.report:
            write_report(args.report, {**out, "passed": passed})
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and os.environ.get(VERDICT):
        with open(os.environ[VERDICT], "w", encoding="utf-8") as f:
            json.dump({"passed": passed, "lines": out["lines"], "slow": verdict["slow"]}, f)
    rk.dist.barrier()
    # Where the node's process reads the verdict, a failed one is its to say: exit 0, so that
    # torchrun does not add a traceback of "failed" ranks to the lines that say why.
    return 0 if passed or os.environ.get(VERDICT) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every rank has passed the last barrier and the verdict is written: leave without the process
    # group's teardown, which was seen once to hang a rank of the first node (2 nodes x 2 gloo
    # ranks) until the phase's bound, while the other node's agent waited at torchrun's exit barrier.
    os._exit(code)
