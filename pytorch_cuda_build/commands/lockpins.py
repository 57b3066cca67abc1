"""A uv-compiled requirements lock read as pins: each `name==version` block with its hashes and
the packages that need it (its `# via` lines), and the closure of some roots through them. What
gpu-bundle carries and what opswheel's build venv installs are both such closures."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pytorch_cuda_runtime import lockfile


@dataclass(frozen=True)
class Pin:
    """One `name==version` block of a requirements lock: its hashes and who needs it."""

    name: str
    version: str
    text: str  # the block as written, hashes included: pip reads it with --require-hashes
    parents: frozenset[str]


normalize = lockfile.canonical  # PEP 503, as every reader of the locks names packages


def parse_lock(text: str) -> dict[str, Pin]:
    """name -> Pin for every block of a uv-compiled lock, parents read from its `# via` lines."""
    pins = {}
    for block in re.split(r"\n(?=\S)", text.strip()):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", block)
        if not m:
            continue  # the header's comments
        comments = [ln.strip().lstrip("#").strip() for ln in block.splitlines() if ln.lstrip().startswith("#")]
        # `# via a` on one line, or `# via` and one `#   a` line per parent; `-r file` is a root.
        via = [w for c in comments for w in [c.removeprefix("via").strip()] if w and not w.startswith("-")]
        code = "\n".join(ln for ln in block.splitlines() if not ln.lstrip().startswith("#"))
        pins[normalize(m.group(1))] = Pin(normalize(m.group(1)), m.group(2), code.rstrip() + "\n",
                                          frozenset(normalize(v) for v in via))
    return pins


def closure(pins: dict[str, Pin], roots: tuple[str, ...], excluded: re.Pattern[str] | None) -> list[Pin]:
    """The pins reachable from roots through the lock's `# via` edges, never entering an
    excluded package: what torch alone needs, the machine has with its torch."""
    children: dict[str, set[str]] = {}
    for pin in pins.values():
        for parent in pin.parents:
            children.setdefault(parent, set()).add(pin.name)
    seen: set[str] = set()
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or (excluded and excluded.fullmatch(name)):
            continue
        seen.add(name)
        todo += sorted(children.get(name, ()))
    return [pins[n] for n in sorted(seen) if n in pins]
