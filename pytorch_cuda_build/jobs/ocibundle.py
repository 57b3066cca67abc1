"""Make an `umoci unpack --rootless` bundle fit for `srun --container` on several nodes.

Standard library only, with no import from this project: the sbatch script carries this file's
code (`bash NAME.sbatch --make-bundle` runs it with the node's python3), so a user needs neither
this checkout nor Docker to make a bundle. Usage: python3 - BUNDLE SHM_MIB [SRC:DST:ro|rw]...

The change to config.json (measured with Slurm 22.05 and runc 1.1.5, ../shared/ENVIRONMENT.md):
- the `network` namespace goes: the ranks of two nodes reach each other over the node's own
  network (in a namespace of its own a container has only loopback);
- the `uts` namespace goes, and with it umoci's `hostname` (runc refuses to set one without it):
  torchrun and NCCL see the node's hostname, the one the rendezvous address names;
- the process runs as uid 0 and gid 0 of the bundle's user namespace, which umoci's mapping makes
  the bundle's maker on the host: the only ids that mapping has (the image's user 1000 is not
  in it, and runc refuses to start a process as an unmapped id);
- no terminal (srun gives the task pipes);
- /dev/shm becomes a tmpfs of SHM_MIB (umoci's default is runc's 64 MiB);
- the node's /etc/hosts and /etc/resolv.conf are bound read-only, so that node names resolve, and
  each SRC at DST, read-only with `ro`.
The image's working directory and environment stay as umoci wrote them.
"""
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Tuple

DROPPED = ("network", "uts")
HOST_FILES = ("/etc/hosts", "/etc/resolv.conf")


def patch(config: Dict[str, Any], shm_mib: int, binds: List[Tuple[str, str, bool]]) -> Dict[str, Any]:
    """config.json with the changes above; binds are (SRC, DST, read_only). The input is left as it was."""
    out = json.loads(json.dumps(config))
    if not out.get("linux", {}).get("uidMappings"):
        raise ValueError("config.json maps no uid: make the bundle with `umoci unpack --rootless`")
    out.pop("hostname", None)
    linux = out["linux"]
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns.get("type") not in DROPPED]
    process = out.setdefault("process", {})
    process["user"] = {"uid": 0, "gid": 0}
    process["terminal"] = False
    wanted = [(path, path, True) for path in HOST_FILES] + list(binds)
    ours = {"/dev/shm"} | {dst for _, dst, _ in wanted}
    mounts = [m for m in out.get("mounts", []) if m.get("destination") not in ours]
    mounts.append({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                   "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=%dm" % shm_mib]})
    for src, dst, read_only in wanted:
        mounts.append({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro" if read_only else "rw"]})
    out["mounts"] = mounts
    return out


def parse_bind(text: str) -> Tuple[str, str, bool]:
    """SRC:DST:ro or SRC:DST:rw, both absolute."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not (parts[0].startswith("/") and parts[1].startswith("/") and parts[2] in ("ro", "rw")):
        raise ValueError("a bind is SRC:DST:ro|rw with absolute paths, not %r" % text)
    return parts[0], parts[1], parts[2] == "ro"


def write(path: str, config: Dict[str, Any]) -> None:
    """Whole or not at all: a temporary file beside it, then a rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".config.json.")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.rename(tmp, path)


def main(argv: List[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python3 - BUNDLE SHM_MIB [SRC:DST:ro|rw]...")
    path = os.path.join(argv[0], "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        patched = patch(config, int(argv[1]), [parse_bind(b) for b in argv[2:]])
    except (OSError, ValueError) as e:
        raise SystemExit("error: %s: %s" % (path, e))
    write(path, patched)


if __name__ == "__main__":
    main(sys.argv[1:])
