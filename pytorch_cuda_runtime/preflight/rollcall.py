"""Phase 2: every node reports its phase-1 result to the first node, which answers all of them
with the verdict; bounded by --join-timeout, so that an unreachable node is named, never waited on.

A TCPStore (torch's, as torchrun's own rendezvous uses) on the rendezvous host at MASTER_PORT + 1:
each node sets `node/NAME` to its result, the first node waits for the others' keys until the
bound, then sets `verdict`: who answered, who did not, and every failed node's lines. Each node
acknowledges the verdict before the first node closes the store.

Who is who: a static rendezvous (Kubeflow, JobSet, Indexed Job) gives each node its rank; under
Slurm the node is its short hostname's place in the job's node list (the task variables are absent
inside `srun --container`), which Slurm sets as the node's hostname.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from . import PreflightError

ACK_WAIT_S = 15  # how long the first node keeps the store open for the others to read the verdict


@dataclass(frozen=True)
class Place:
    name: str  # this node, as the others name it
    first: bool  # hosts the store
    expected: tuple[str, ...]  # every node's name, in node order
    host: str
    port: int


def place(topo, me, hosts):
    """Where this node stands in the roll call. hosts: Slurm's node list, expanded."""
    if topo.node_rank is not None:  # static: ranks are given; name nodes by rank (and host where known)
        names = tuple(f"node {i}" for i in range(topo.nnodes))
        return Place(f"node {topo.node_rank}", topo.node_rank == 0, names, topo.master_addr, topo.master_port + 1)
    hosts = tuple(h.split(".")[0] for h in hosts)
    if me not in hosts:
        raise PreflightError(f"this node's hostname {me!r} is not in the job's node list ({', '.join(hosts)}): "
                             "the roll call names each node by its hostname")
    first = me == hosts[0]
    return Place(me, first, hosts, topo.master_addr, topo.master_port + 1)


def label(name: str) -> str:
    """'node NAME' for a host name; a static rendezvous's names already read 'node N'."""
    return name if name.startswith("node ") else f"node {name}"


def missing(expected: tuple[str, ...], answered: dict[str, Any]) -> list[str]:
    """The nodes that did not answer, in node order."""
    return [n for n in expected if n not in answered]


Judge = Callable[[dict[str, dict[str, Any]]], dict[str, Any]]


def verdict(expected: tuple[str, ...], results: dict[str, dict[str, Any]], waited_s: float,
            judge: Judge | None = None) -> dict[str, Any]:
    """The first node's verdict from the results it got: {name: {"lines", "warnings", "summary", "gpu"}};
    judge(results) adds what is judged across nodes (the GPUs' compute figures): its lines, warnings, record."""
    gone = missing(expected, results)
    answered = {n: results[n] for n in expected if n in results}
    lines = [f"{label(n)}: {line}" for n, r in answered.items() for line in r["lines"]]
    warnings = [f"{label(n)}: {line}" for n, r in answered.items() for line in r.get("warnings", [])]
    across = judge(answered) if judge else {"lines": [], "warnings": [], "record": None}
    if gone:
        lines.append(f"nodes that did not answer within {waited_s:.0f} s: {', '.join(gone)} "
                     f"({len(results)} of {len(expected)} answered: {', '.join(answered)})")
    return {"answered": list(answered), "missing": gone, "lines": lines + across["lines"],
            "warnings": warnings + across["warnings"], "gpus": across["record"],
            "summaries": [r["summary"] for r in answered.values()]}


def _key(name):
    return "node/" + name.replace(" ", "_")


def reach(host, port, timeout_s, connect=socket.create_connection):
    """Wait until host:port accepts a connection, within timeout_s (torch's own client retries past its
    timeout); the error that the last attempt gave, or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connect((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return None
        except OSError as e:
            if time.monotonic() >= deadline:
                return str(e) or type(e).__name__
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def call(p: Place, result: dict[str, Any], timeout_s: float, store_cls: Any = None,
         announce: Callable[[dict[str, Any]], None] = print, judge: Judge | None = None) -> dict[str, Any]:
    """Take part in the roll call; the verdict, or one whose lines say this node could not take part.
    announce(verdict) runs as soon as this node has it: before the first node waits for the others'
    acknowledgements, since a scheduler may end every task once one has exited."""
    t0 = time.monotonic()
    if not p.first:
        error = reach(p.host, p.port, timeout_s)
        if error is not None:
            return _alone(p, result, f"cannot reach the preflight's roll call at {p.host}:{p.port} within {timeout_s:.0f} s: "
                             f"the first node, {p.expected[0]}, did not answer ({error})")
    if store_cls is None:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the store's retries are not this tool's lines
        import torch.distributed as dist  # here, not at the top: phase 1 runs without torch
        store_cls = dist.TCPStore
    left = max(1.0, timeout_s - (time.monotonic() - t0))
    try:
        store = store_cls(p.host, p.port, None, p.first, timedelta(seconds=left), wait_for_workers=False)
    except Exception as e:  # torch raises RuntimeError or its DistStoreError; both mean "no store"
        return _alone(p, result, f"cannot {'open' if p.first else 'join'} the preflight's roll call at {p.host}:{p.port}: "
                         f"{str(e).splitlines()[0][:160]}")
    store.set(_key(p.name), json.dumps(result))
    if p.first:
        return _gather(store, p, t0, timeout_s, announce, judge)
    try:
        store.wait(["verdict"], timedelta(seconds=max(1.0, timeout_s - (time.monotonic() - t0)) + ACK_WAIT_S))
        out = json.loads(store.get("verdict"))
        store.set("ack/" + _key(p.name), "1")
        announce(out)
        return out
    except Exception as e:  # the first node went away or never answered in time
        return _alone(p, result, f"the first node, {p.expected[0]}, gave no verdict within {timeout_s:.0f} s "
                         f"({str(e).splitlines()[0][:160]})")


def _alone(p: Place, result: dict[str, Any], why: str) -> dict[str, Any]:
    """The verdict this node gives itself when it could not take part: its own lines, and why
    (announced by the caller)."""
    return {"answered": [], "missing": [], "summaries": [result["summary"]], "gpus": None,
            "lines": [f"{label(p.name)}: {line}" for line in [*result["lines"], why]],
            "warnings": [f"{label(p.name)}: {line}" for line in result.get("warnings", [])]}


def _gather(store: Any, p: Place, t0: float, timeout_s: float, announce: Callable[[dict[str, Any]], None],
            judge: Judge | None = None) -> dict[str, Any]:
    results = {}
    while True:
        for name in p.expected:
            if name not in results and store.check([_key(name)]):
                results[name] = json.loads(store.get(_key(name)))
        if len(results) == len(p.expected) or time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.5)
    out = verdict(p.expected, results, time.monotonic() - t0, judge)
    store.set("verdict", json.dumps(out))
    announce(out)
    others = ["ack/" + _key(n) for n in out["answered"] if n != p.name]
    deadline = time.monotonic() + ACK_WAIT_S
    while others and not store.check(others) and time.monotonic() < deadline:
        time.sleep(0.2)
    return out
