"""The checkout's committed inputs: lock and render them (one writer at a time), say
where each row stands (lock current, image built here) or what its build would do, and
what advisories its locked packages have."""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Callable

from . import files, paths
from .engine import docker_env
from .errors import EnvironmentProblem
from .matrix import Image, Matrix
from .stages import gate, lock, render, security, tag


def relock(root: Path, m: Matrix, images: list[Image], upgrade: bool, ca: Callable[[], str | None], log: Callable[[str], None]) -> list[str] | None:
    """Re-resolve the stale rows (every row with upgrade) and render them; the pins that moved,
    one line each, or None when every lock was current. Without upgrade, a row whose
    linux/amd64 lock is current keeps it, and only its other platforms are resolved."""
    with files.writer_lock(root, paths.STATE_DIR):
        before = {i.name: lock.read(root, i).get("pins", {}) for i in images if (lock.image_dir(root, i) / "lock.json").exists()}
        stale = images if upgrade else [i for i in images if lock.problems(root, i)]
        if not stale:
            return None
        lock.write(root, m, stale, ca(), log=log, keep_current=not upgrade)
        moved = []
        for i in stale:
            old, new = before.get(i.name, {}), lock.read(root, i)["pins"]
            moved += [f"{i.name}: {name} {old.get(name, '-')} -> {new.get(name, '-')}"
                      for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
        render.write(root, m, stale, log=log)
    return moved


def check_security(root: Path, images: list[Image], snapshot: Path | None, ca: Callable[[], str | None],
                   record: bool = False) -> tuple[list[str], bool]:
    """`lock --check-security`: one line per advisory of a locked Python package and per
    Debian pin behind the security suite, then a summary; and whether anything was found.
    record: also write each image's images/<image>/security.json (the README table's counts)."""
    sources = security.Snapshot(snapshot) if snapshot else security.Online(ca())
    results = [security.check_lock(root, i, sources) for i in images]
    if record:
        when = {**sources.described(), "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        for image, r in zip(images, results):
            security.record_check(root, image, r, when)
    lines = [line for r in results for line in security.finding_lines(r)]
    python, critical = sum(len(r.advisories) for r in results), sum(a.severity == security.CRITICAL for r in results for a in r.advisories)
    debian, unchecked = sum(len(r.behind) for r in results), {u for r in results for u in r.unchecked}
    hit = sum(bool(r.advisories or r.behind) for r in results)
    summary = (f"{hit} of {len(images)} image(s) with findings: {python} Python advisor{'y' if python == 1 else 'ies'} ({critical} critical), "
               f"{debian} Debian pin(s) behind the security suite; {len(unchecked)} package version(s) unchecked (no answer from PyPI or the snapshot)")
    return lines + [summary], bool(lines)


def rerender(root: Path, m: Matrix, log: Callable[[str], None]) -> None:
    with files.writer_lock(root, paths.STATE_DIR):
        render.write(root, m, list(m.images), log=log)


def status(root: Path, m: Matrix) -> list[tuple[str, ...]]:
    """`list`: every row's pins, whether its lock is current and whether it is built here (? without a daemon)."""
    try:
        c = docker_env.client()
    except EnvironmentProblem:
        c = None
    rows: list[tuple[str, ...]] = [("IMAGE", "TORCH", "CUDA", "WHEEL CUDA", "CUDNN", "NCCL", "DEEPSPEED", "PY", "LOCK", "BUILT", "TAGS")]
    for i in m.images:
        lock_ok = "ok" if not lock.problems(root, i) else "STALE"
        built = "?" if c is None else ("yes" if tag.current(c, i)[i.refs()[0]] else "no")
        rows.append((i.name, i.torch, i.cuda, i.wheel_cuda, i.cudnn, i.nccl, i.deepspeed, i.python, lock_ok, built, " ".join(i.tags[1:])))
    return rows


def plan(root: Path, image: Image) -> str:
    """`--dry-run`: the row, its pins, platform, base, tags, lock and the Dockerfile it would build."""
    d = lock.build_dir(root, image)
    lines = [f"row:        torch {image.torch} for CUDA platform {image.cuda} (wheel CUDA {image.wheel_cuda}), {image.flavor}",
             f"pins:       cuDNN {image.cudnn}, NCCL {image.nccl}, DeepSpeed {image.deepspeed}, Python {image.python}"]
    if image.note:
        lines.append(f"note:       {image.note}")
    lines += [f"platform:   {platform_line(image)}",
              f"cpu ops:    -march={image.cpu_arch} (DeepSpeed's CPU ops and any op it compiles later)",
              f"tests:      {tests_line(image)}",
              f"base:       {render.base_ref(image)} ({base_line(image)})",
              f"tags:       {' '.join(tag.refs(image))}",
              f"lock:       {d / 'requirements.lock'} (sha256 {lock.read(root, image)['files_sha256'][:16]}...)",
              f"dockerfile: {d / 'Dockerfile'}\n"]
    return "\n".join(lines) + "\n" + (d / "Dockerfile").read_text()


def base_line(image: Image) -> str:
    """How the row's base is made: matrix.yaml's kind `debootstrap` names the Debian rootfs, which
    stage 3 builds here with mmdebstrap (stages/base.py), not with debootstrap."""
    if image.os.kind == "registry":
        return f"a registry image by digest: {image.os_name}"
    return f"built here with mmdebstrap from {image.os.mirror}, suite {image.os.suite}: {image.os_name}"


def platform_line(image: Image) -> str:
    host = docker_env.host_platform()
    if not docker_env.emulated(image.platform):
        return f"{image.platform}, native on this host"
    if docker_env.emulation_ready(image.platform):
        qemu = "QEMU is registered (binfmt_misc, flag F)"
    else:
        qemu = ("QEMU is not registered; the build registers it (root)" if os.geteuid() == 0
                else "QEMU is not registered, and the build will stop: as root, apt-get install qemu-user-static binfmt-support")
    return f"{image.platform}, emulated on this {host} host: {qemu}"


def tests_line(image: Image) -> str:
    if not gate.subset(image):
        return "the smoke suite and every structure check"
    return (f"emulated subset: smoke {gate.EMULATED_SMOKE}; structure checks -k '{gate.EMULATED_STRUCTURE}' "
            "(PYTORCH_CUDA_EMULATED_TESTS=full: everything)")
