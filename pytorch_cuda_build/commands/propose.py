"""`matrix --propose`: rows for torch releases the matrix lacks, read from the index.

The versions come from the index's JSON simple API (PEP 691/700); each candidate's CUDA,
cuDNN and NCCL pins come from resolving it exactly as `lock` does, so a proposed row
passes `lock` unchanged. Nothing is written: a person reviews and commits the row.
"""
from __future__ import annotations

import dataclasses
import json
import re
import ssl
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Callable

from packaging.version import InvalidVersion, Version

from ..errors import ResolveError
from ..matrix import Image, Matrix
from ..resolve import pypi as resolve_pypi


def stable(version: str) -> Version | None:
    """A final X.Y.Z release (no pre, post, dev or local part), else None: what a row may pin."""
    try:
        v = Version(version)
    except InvalidVersion:  # the index lists what it likes; such a version is no candidate
        return None
    return v if len(v.release) == 3 and not (v.epoch or v.is_prerelease or v.is_postrelease or v.local) else None


def index_versions(index: str, project: str, ca_bundle: str | None) -> list[str]:
    url = f"{index.rstrip('/')}/{project}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    ctx = ssl.create_default_context(cafile=ca_bundle) if ca_bundle and url.startswith("https") else None
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            data = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ResolveError(f"cannot list {project} releases at {url}: {getattr(e, 'reason', e)}") from None
    if "versions" not in data:
        raise ResolveError(f"{url} does not serve the PEP 700 JSON API (no 'versions'); cannot propose rows")
    return released_by(data, resolve_pypi.frozen_at())


def released_by(data: dict, when: str | None) -> list[str]:
    """The versions with a file uploaded at or before `when` (PEP 700 upload-time); all without it.
    A frozen index (PYTORCH_CUDA_EXCLUDE_NEWER) must not propose what it cannot resolve."""
    if not when:
        return data["versions"]
    limit = _instant(when)
    seen = set()
    for f in data.get("files", []):
        stamp = f.get("upload-time")
        m = re.match(rf"^{re.escape(data.get('name', 'torch'))}-([^-]+)-", f.get("filename", "").replace("_", "-"), re.I)
        if stamp and m and _instant(stamp) <= limit:
            seen.add(m.group(1))
    return [v for v in data["versions"] if v in seen]


def _instant(text: str) -> datetime:
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def new_releases(m: Matrix, versions: list[str]) -> list[str]:
    """The newest patch of every minor newer than the matrix, and newer patches of its minors."""
    have: dict[tuple[int, ...], Version] = {}
    for h in filter(None, (stable(i.torch) for i in m.images)):
        have[h.release[:2]] = max(have.get(h.release[:2], h), h)
    oldest = min(have) if have else (0, 0)
    newest: dict[tuple[int, ...], tuple[Version, str]] = {}
    for text in versions:
        v = stable(text)
        if v and v.release[:2] >= oldest and (v.release[:2] not in newest or v > newest[v.release[:2]][0]):
            newest[v.release[:2]] = (v, text)
    return [text for minor, (v, text) in sorted(newest.items()) if minor not in have or v > have[minor]]


def candidates(m: Matrix, ca_bundle: str | None, log: Callable[[str], None]) -> list[dict]:
    template = max((i for i in m.images if stable(i.torch)), key=lambda i: Version(i.torch))
    out = []
    for v in new_releases(m, index_versions(template.index, "torch", ca_bundle)):
        log(f"resolving torch {v} with deepspeed {template.deepspeed} from {template.index}")
        probe: Image = dataclasses.replace(template, torch=v, default=False, note=None)
        facts = resolve_pypi.wheel_facts(resolve_pypi.compile_lock(probe, ca_bundle))
        out.append({"torch": v, "cuda": facts.torch_cuda, "wheel_cuda": facts.torch_cuda, "cudnn": facts.cudnn,
                    "nccl": facts.nccl, "deepspeed": template.deepspeed,
                    "platform_known": facts.torch_cuda in m.platforms, "index": template.index})
    return out


def render(rows: list[dict]) -> str:
    if not rows:
        return "# no torch release on the index is missing from the matrix\n"
    text = "# Candidate rows, resolved from the wheels' metadata; review, add under rows:, then lock and render.\n"
    for r in rows:
        if not r["platform_known"]:
            text += f"# CUDA {r['cuda']} is not under platforms: yet; add it with its driver_min first\n"
        text += (f"  - torch: {r['torch']}\n    cuda: \"{r['cuda']}\"\n    wheel_cuda: \"{r['wheel_cuda']}\"\n"
                 f"    cudnn: {r['cudnn']}\n    nccl: {r['nccl']}\n    deepspeed: {r['deepspeed']}\n")
    return text
