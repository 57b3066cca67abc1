"""Slurm host lists (SLURM_JOB_NODELIST) expanded to host names, in Slurm's order.

    expand("node[01-04,07]")          -> node01 node02 node03 node04 node07
    expand("a[1-2],b3")               -> a1 a2 b3
    expand("rack[1-2]-node[01-02]")   -> rack1-node01 rack1-node02 rack2-node01 rack2-node02
    expand("n[8-10]"), ("n[099-101]") -> n8 n9 n10; n099 n100 n101 (the low bound's width pads)

The grammar is the one Slurm documents (slurm_hostlist_create(3), Slurm::Hostlist(3pm)):
names separated by commas or blanks; a bracket holds numbers and ranges `lo-hi` separated by
commas; several brackets in one name multiply. Empty items are skipped, as Slurm skips them.
Anything else (an open bracket, `[3-1]`, `[a-b]`, `[]`, the 3-D `bgl[123x456]`) is a
HostlistError. Checked against `scontrol show hostnames` of Slurm 22.05 in
tests/runtime/test_hostlist.py. Two differences, neither in a list Slurm itself writes: Slurm
refuses a suffix after a single bracket (`node[1-2]-ib`), which this accepts, and orders names
of three or more brackets its own way (their first name and their count are the same).

`scontrol show hostnames` is used where it is on PATH and answers cleanly: inside a container
it is not, and without a slurm.conf it fails; then this parser answers.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess

from .errors import PytorchCudaError

_ITEM = re.compile(r"([^\[\],\s]*)(?:\[([^\[\]]*)\])?")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(PytorchCudaError, ValueError):
    """The host list does not parse; the message names the list and the part that failed."""


def _numbers(text: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise HostlistError(f"host list {hostlist!r}: {part!r} is not a number or a range lo-hi")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"host list {hostlist!r}: range {part!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_item(item: str, hostlist: str) -> list[str]:
    pieces: list[list[str]] = []
    pos = 0
    while pos < len(item):
        m = _ITEM.match(item, pos)
        if m is None or m.end() == pos:
            raise HostlistError(f"host list {hostlist!r}: unbalanced bracket in {item!r}")
        pieces.append([m.group(1)])
        if m.group(2) is not None:
            pieces.append(_numbers(m.group(2), hostlist))
        pos = m.end()
    return ["".join(p) for p in itertools.product(*pieces)]


def _items(hostlist: str) -> list[str]:
    """Split on the commas and blanks outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(hostlist):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth not in (0, 1):
            raise HostlistError(f"host list {hostlist!r}: unbalanced bracket")
        if depth == 0 and (c == "," or c.isspace()):
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"host list {hostlist!r}: unbalanced bracket")
    items.append(hostlist[start:])
    return [i for i in items if i]


def expand(hostlist: str) -> list[str]:
    """The host names of a Slurm host list, with this module's parser only."""
    hosts = [h for item in _items(hostlist) for h in _expand_item(item, hostlist)]
    if not hosts:
        raise HostlistError(f"host list {hostlist!r} names no host")
    return hosts


def scontrol_expand(hostlist: str, timeout: float = 10.0) -> list[str] | None:
    """`scontrol show hostnames`'s answer, or None where it is absent or does not answer cleanly.

    Slurm 22.05's scontrol exits 0 on a bad list and prints `Invalid hostlist: ...`, so a clean
    answer is: exit 0, nothing on stderr, and only plain names on stdout.
    """
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        r = subprocess.run([scontrol, "show", "hostnames", hostlist], capture_output=True,
                           text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = r.stdout.split()
    if r.returncode != 0 or r.stderr.strip() or not hosts or any(
            "[" in h or "]" in h for h in hosts) or "Invalid hostlist" in r.stdout:
        return None
    return hosts


def hostnames(hostlist: str) -> list[str]:
    """The host names: this parser decides whether the list is valid (so a bad list reads the
    same everywhere); scontrol, where it answers, gives the names in Slurm's own order."""
    ours = expand(hostlist)
    return scontrol_expand(hostlist) or ours
