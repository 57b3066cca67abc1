"""The fabric's figures, pure: nccl-tests' bandwidths and table, the slow-node judgement, the JSON.

Bandwidths as nccl-tests defines them (its doc/PERFORMANCE.md): algbw = size / time; busbw, the
figure comparable to the hardware's link speed whatever the rank count n, is
  all_reduce  busbw = algbw * 2(n-1)/n
  all_gather  busbw = algbw * (n-1)/n   (size: the gathered output, n x each rank's part)
time is the slowest rank's mean over the timed iterations: a collective ends when its last rank does.

The slow node: each pair of ring neighbours (node i and i+1, all their ranks) runs an all_reduce
alone; a node's figure is its best link's busbw, since a link is as slow as its slower end and a
healthy node keeps one healthy neighbour while the slow node has none. A node under SLOW_RATIO x
the median node's figure is named. 0.5: on a healthy, uniform fabric nodes differ by a few
percent to some tens of percent (clocks, placement, other traffic); a port at half rate, a link
retrained down, or a node falling back from RDMA to TCP costs half or far more. With two nodes
there is one link, and which end is slow cannot be told: the link is measured and no node named.
"""
from __future__ import annotations

import statistics

SLOW_RATIO = 0.5
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
REDOP = {"all_reduce": "sum", "all_gather": "none"}
TYPE_BYTES = {"float": 4}


def bandwidths(op, size, seconds, n):
    """(algbw, busbw) in GB/s (1e9 bytes/s) for `size` bytes in `seconds` over n ranks."""
    algbw = size / seconds / 1e9
    return algbw, algbw * FACTORS[op](n)


def row(op, size, seconds, n, wrong=0, dtype="float"):
    algbw, busbw = bandwidths(op, size, seconds, n)
    return {"size": size, "count": size // TYPE_BYTES[dtype], "type": dtype, "redop": REDOP[op], "root": -1,
            "time_us": seconds * 1e6, "algbw": algbw, "busbw": busbw, "wrong": wrong}


def table(op, rows, n, nodes, backend, iters, warmup):
    """The sweep as nccl-tests prints its out-of-place half."""
    head = [f"# {op}: {n} ranks on {nodes} node{'s' if nodes != 1 else ''} ({backend}), {iters} timed iterations "
            f"after {warmup} warm-up, time of the slowest rank",
            f"#{'size':>12}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}",
            f"#{'(B)':>12}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}"]
    body = [f" {r['size']:>12}  {r['count']:>12}  {r['type']:>8}  {r['redop']:>6}  {r['root']:>6}  {r['time_us']:>8.1f}  "
            f"{r['algbw']:>7.2f}  {r['busbw']:>7.2f}  {r['wrong']:>6}" for r in rows]
    formula = "algbw * 2(n-1)/n" if op == "all_reduce" else "algbw * (n-1)/n"
    avg = statistics.fmean(r["busbw"] for r in rows) if rows else 0.0
    return head + body + [f"# Avg bus bandwidth    : {avg:.3f}", f"# busbw = {formula}, n = {n} ranks (nccl-tests' PERFORMANCE.md)"]


def node_names(hosts):
    """Each node's host name, with its node number added where two nodes share one (containers on one host)."""
    return [h if hosts.count(h) == 1 else f"{h}#{i}" for i, h in enumerate(hosts)]


def ring_pairs(nodes):
    """Each node with the next, around the ring: [(0, 1), (1, 2), ..., (n-1, 0)]; one pair for two nodes."""
    n = len(nodes)
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def judge(nodes, links, ratio=SLOW_RATIO):
    """links: {(i, j): busbw}. Each node's best link, the median, and the nodes under ratio x median."""
    best = {nodes[i]: max(bw for pair, bw in links.items() if i in pair) for i in range(len(nodes))
            if any(i in pair for pair in links)}
    if len(nodes) < 3 or not best:
        note = ("one node: no link between nodes to measure" if len(nodes) < 2 else
                "two nodes: one link, whose slow end cannot be told; no node is named (3 or more nodes are compared)")
        return {"best": best, "median": None, "threshold": None, "slow": [], "ratio": ratio, "note": note}
    median = statistics.median(best.values())
    slow = [n for n in nodes if best.get(n, 0.0) < ratio * median]
    return {"best": best, "median": median, "threshold": ratio * median, "slow": slow, "ratio": ratio, "note": ""}


def slow_lines(nodes, links, verdict):
    """One failure line per slow node: its links, the median, the threshold."""
    out = []
    for name in verdict["slow"]:
        i = nodes.index(name)
        own = ", ".join(f"{nodes[a]}<->{nodes[b]} {bw:.3f}" for (a, b), bw in links.items() if i in (a, b))
        out.append(f"node {name}: slow: its best link to a ring neighbour carries {verdict['best'][name]:.3f} GB/s bus "
                   f"bandwidth, under {verdict['ratio']} x the median node's {verdict['median']:.3f} GB/s (links, GB/s: {own})")
    return out


def neighbour_table(nodes, links, verdict, size, iters):
    lines = [f"# neighbours: all_reduce of {size} B between each pair of ring neighbours alone (all their ranks), "
             f"{iters} timed iterations", f"#{'link':>32}  {'busbw (GB/s)':>12}"]
    lines += [f" {nodes[a] + ' <-> ' + nodes[b]:>32}  {bw:>12.3f}" for (a, b), bw in links.items()]
    lines.append(f"#{'node':>32}  {'best link':>12}  {'x median':>8}")
    for name in (nodes if links else []):
        best = verdict["best"].get(name)
        share = f"{best / verdict['median']:.2f}" if best is not None and verdict["median"] else "-"
        mark = "  SLOW" if name in verdict["slow"] else ""
        lines.append(f" {name:>32}  {best if best is not None else float('nan'):>12.3f}  {share:>8}{mark}")
    lines.append(f"# {verdict['note']}" if verdict["note"] else
                 f"# slow: a node whose best link is under {verdict['ratio']} x the median node's "
                 f"({verdict['threshold']:.3f} GB/s)")
    return lines
