"""Make an OCI bundle (umoci unpack) fit for `srun --container` on several nodes.

    python3 -m pytorch_cuda_build.jobs.bundle BUNDLE [--shm-size 16Gi] [--bind DIR|SRC:DST[:ro]]...

patch() is the whole change, a pure function over config.json (measured with Slurm 22.05
and runc here, ../shared/ENVIRONMENT.md):
- the `network` namespace goes: the ranks of two nodes must reach each other over the
  node's own network (in a namespace of its own a container has only loopback);
- the `uts` namespace goes, and with it umoci's `hostname` (runc refuses to set one without
  it): torchrun and NCCL see the node's hostname, the one the rendezvous address names;
- /dev/shm becomes a tmpfs of the given size (umoci's default is runc's 64 MiB);
- the node's /etc/hosts and /etc/resolv.conf are bound at the same path, so that node names
  resolve; each --bind DIR at the same path (the submit directory), each --bind SRC:DST[:ro] at
  DST (a `job --mount`), read-only with :ro;
- the image's user, working directory and environment stay as umoci wrote them (the tasks'
  working directory comes from PYTORCH_CUDA_WORKDIR, which the sbatch script exports).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from ..errors import UsageError
from . import mounts, shm_mib

DROPPED = ("network", "uts")
HOST_FILES = ("/etc/hosts", "/etc/resolv.conf")


def bind(text: str) -> mounts.Mount:
    """A --bind: DIR (at the same path) or SRC:DST[:ro]; a UsageError where it is neither."""
    if ":" not in text:
        if not text.startswith("/"):
            raise UsageError(f"--bind takes an absolute directory or SRC:DST[:ro], not {text!r}")
        return mounts.Mount(str(Path(text)), str(Path(text)))
    mount = mounts.parse(text, "--bind")
    if mount.pvc:
        raise UsageError(f"--bind {text!r}: a bundle binds host directories, not a PersistentVolumeClaim")
    return mount


def patch(config: dict, shm_mib: int, binds: tuple[str, ...] = ()) -> dict:
    """config.json with the changes above, binds as --bind takes them; the input is left as it was."""
    wanted = [bind(b) for b in binds]
    out = copy.deepcopy(config)
    out.pop("hostname", None)  # runc refuses to set one without a UTS namespace of the container's own
    linux = out.setdefault("linux", {})
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns.get("type") not in DROPPED]
    ours = {"/dev/shm", *HOST_FILES, *(b.target for b in wanted)}
    kept = [m for m in out.get("mounts", []) if m.get("destination") not in ours]
    kept.append({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                 "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_mib}m"]})
    for b in (*(mounts.Mount(path, path, read_only=True) for path in HOST_FILES), *wanted):
        kept.append({"destination": b.target, "type": "bind", "source": b.source,
                     "options": ["rbind", "ro" if b.read_only else "rw"]})
    out["mounts"] = kept
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pytorch_cuda_build.jobs.bundle", description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="the directory umoci unpack wrote (holds config.json and rootfs/)")
    p.add_argument("--shm-size", default="16Gi", help="size of the /dev/shm tmpfs (default 16Gi)")
    p.add_argument("--bind", action="append", default=[], metavar="DIR|SRC:DST[:ro]",
                   help="absolute host directory bound at the same path, or SRC bound at DST (read-only with :ro); repeatable")
    args = p.parse_args(argv)
    config = args.bundle / "config.json"
    try:
        size = shm_mib(args.shm_size)
        for b in args.bind:
            bind(b)
        if not config.is_file():
            raise UsageError(f"{config} does not exist: BUNDLE is the directory `umoci unpack` wrote")
        patched = patch(json.loads(config.read_text()), size, tuple(args.bind))
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config.write_text(json.dumps(patched, indent=2) + "\n")
    print(f"{config}: network and uts namespaces dropped, /dev/shm {args.shm_size}, "
          f"{len(HOST_FILES) + len(args.bind)} bind mounts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
