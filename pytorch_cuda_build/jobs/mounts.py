"""`job --mount SOURCE:TARGET[:ro]`: the user's code and data in every task of a job.

    SOURCE  Kubernetes: pvc:CLAIM (a PersistentVolumeClaim) or an absolute host path (a hostPath
            volume of type Directory); Slurm: an absolute path on a filesystem every node mounts.
    TARGET  the absolute path inside the container.
    ro      read-only.

Each runtime mounts it its own way: Kubernetes a volume and a volumeMount; Slurm's oci runtime a
bind in the bundle's config.json (the oci script's --make-bundle, ocibundle.py); pyxis `--container-mounts`;
Apptainer `--bind`. The paths go into double-quoted shell words and into the SRC:DST[:ro] lists
of pyxis and Apptainer (comma-separated), so they hold no blank, quote, backslash, $, : or comma.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from ..errors import BadValue

PVC = "pvc"
PATH = re.compile(r"/[^\s\"'`\\$:,]*")
CLAIM = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain: a PersistentVolumeClaim's name
FORM = "SOURCE:TARGET[:ro], SOURCE pvc:CLAIM or an absolute path (e.g. /shared/code:/code or pvc:datasets:/data:ro)"
# What a TARGET may not be, lie inside or hide: what the job and the container runtime mount
# already, and the image's own software. The most specific first.
TAKEN = {
    "/dev/shm": "which the job mounts (--shm-size)",
    "/dev": "which the container runtime mounts",
    "/proc": "which the container runtime mounts",
    "/sys": "which the container runtime mounts",
    "/etc/hosts": "which the runtime mounts from the node",
    "/etc/resolv.conf": "which the runtime mounts from the node",
    "/etc/hostname": "which the runtime mounts from the node",
    "/usr": "which holds the image's programs, the launch contract among them",
    "/opt/venv": "which holds the image's Python and torch",
}


@dataclass(frozen=True)
class Mount:
    source: str  # the claim's name for a PVC, else an absolute host path
    target: str
    read_only: bool = False
    pvc: bool = False

    def __str__(self) -> str:
        """The --mount form."""
        return (f"{PVC}:" if self.pvc else "") + self.bind()

    def bind(self) -> str:
        """SRC:DST[:ro], as pyxis and Apptainer take a bind."""
        return f"{self.source}:{self.target}" + (":ro" if self.read_only else "")


def _path_problem(path: str) -> str | None:
    if not path.startswith("/"):
        return "is relative"
    if not PATH.fullmatch(path):
        return "holds a blank, quote, backslash, $, : or comma"
    if posixpath.normpath(path) != path:
        return f"is not in normal form ({posixpath.normpath(path)})"
    return None


def _taken(target: str) -> str | None:
    """What a TARGET would sit on, in, or hide, and why that is refused; None where it is free."""
    for path, why in TAKEN.items():
        if target == path:
            return f"is {path}, {why}"
        if target.startswith(path + "/"):
            return f"is inside {path}, {why}"
        if path.startswith(target.rstrip("/") + "/"):
            return f"would hide {path}, {why}"
    return None


def parse(text: str, flag: str = "--mount") -> Mount:
    """A --mount value (or a bundle's --bind, flag naming it), or BadValue naming what is wrong."""
    parts = text.split(":")
    kind = None
    if parts[0] == PVC or (len(parts) >= 3 and parts[0] and not parts[0].startswith("/") and not parts[1].startswith("/")):
        kind, parts = parts[0], parts[1:]  # KIND:SOURCE:TARGET[:ro]
    read_only = len(parts) == 3
    if read_only and parts[2] != "ro":
        raise BadValue(f"{flag} {text!r}: {parts[2]!r} is no option of a mount; the one option is ro", name=flag)
    if len(parts) not in (2, 3) or not all(parts):
        raise BadValue(f"{flag} takes {FORM}, not {text!r}", name=flag)
    source, target = parts[:2]
    if kind is not None and kind != PVC:
        raise BadValue(f"{flag} {text!r}: unknown SOURCE kind {kind + ':'!r}; SOURCE is pvc:CLAIM (Kubernetes) or an absolute path", name=flag)
    if kind == PVC and not CLAIM.fullmatch(source):
        raise BadValue(f"{flag} {text!r}: CLAIM {source!r} is not a PersistentVolumeClaim's name (a lowercase DNS name)", name=flag)
    problem = None if kind == PVC else _path_problem(source)
    if problem:
        raise BadValue(f"{flag} {text!r}: SOURCE {source!r} {problem}; SOURCE is an absolute path"
                         f"{'' if flag != '--mount' else ' (a host or shared directory) or pvc:CLAIM'}", name=flag)
    problem = _path_problem(target)
    if problem:
        raise BadValue(f"{flag} {text!r}: TARGET {target!r} {problem}; TARGET is an absolute path in the container, such as /data", name=flag)
    problem = _taken(target)
    if problem:
        raise BadValue(f"{flag} {text!r}: TARGET {target} {problem}; pick another TARGET, such as /data", name=flag)
    return Mount(source, target, read_only, pvc=kind == PVC)


def parse_all(texts: list[str]) -> tuple[Mount, ...]:
    """Every --mount, each TARGET once."""
    mounts: dict[str, str] = {}
    out = []
    for text in texts:
        mount = parse(text)
        if mount.target in mounts:
            raise BadValue(f"--mount {mounts[mount.target]!r} and --mount {text!r} both mount on {mount.target}: one TARGET, one mount", name="--mount")
        mounts[mount.target] = text
        out.append(mount)
    return tuple(out)
