#!/usr/bin/env python3
"""pytorch-cuda-oci-gpus: name a Slurm step's GPUs to NVIDIA's container runtime, then run it.

A site installs this file on every node (standard library only, Python 3.6 or newer) and puts it
before the runtime in oci.conf's RunTimeRun:

    RunTimeRun="/usr/local/libexec/pytorch-cuda-oci-gpus nvidia-container-runtime ... run --bundle %b ID"

NVIDIA's runtime edits the spec on `create` only, never on `run`, and Slurm 22.05 waits forever
on RunTimeCreate (its container keeps the call's output open, measured here). So this turns the
`run` into the runtime's `create` (with the GPUs named, below) and `start`, and waits for the
container's process as its subreaper, which makes its exit status this program's: what `run`
would have returned. Signals it gets go on to that process.

Why it is needed: under `srun --container`, Slurm 22.05 sets a task's GPU variables
(CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS) only after the container exists, and the environment
the container gets is the job's, so a batch node's values reach every node's container. The
image sets NVIDIA_VISIBLE_DEVICES=all, so NVIDIA's runtime would give each container every GPU
of its node. So this reads the job's allocation on this node from `scontrol -d show job` (the
indexes Slurm itself puts in CUDA_VISIBLE_DEVICES for a task outside a container), writes them
as NVIDIA_VISIBLE_DEVICES into the bundle's config.json (`void` where the job has none here),
drops the variables that name another node's GPUs, binds /dev/infiniband where the node has it
(NCCL's InfiniBand and RoCE verbs devices), and then execs the runtime with its arguments as
given. Where the allocation cannot be read it exits 1 and starts nothing: no container gets GPUs
it was not given. Confinement stays the cgroup plugin's (ConstrainDevices=yes).

config.json in Slurm's spool is root's and may not be writable by the job's user: it is written
as a new file and renamed over the old one (NVIDIA's runtime then rewrites it in place).
"""
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import typing  # noqa: F401 (its type comments; stdlib only, as every import here)

NAME = "pytorch-cuda-oci-gpus"
STALE = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
FABRIC = "/dev/infiniband"
# One node's line of `scontrol -d show job`: "Nodes=gpu[01-02] CPU_IDs=0-63 Mem=0 GRES=gpu:a100:8(IDX:0-7)"
NODE_LINE = re.compile(r"^\s*Nodes=(\S+)\s.*?\bGRES=(\S*)", re.M)
GPU_IDX = re.compile(r"\bgpu(?::[^:(,]+)?:\d+\(IDX:([0-9,-]+)\)")


class Refused(Exception):
    """Why no container may start."""


def bundle_of(argv):
    # type: (list) -> str
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--bundle", "-b"):
            return value
    for arg in argv:
        if arg.startswith("--bundle="):
            return arg.split("=", 1)[1]
    raise Refused("no --bundle BUNDLE among the runtime's arguments (oci.conf: ... create --bundle %b ...)")


def indexes(text: str) -> list[int]:
    """"0-1,4" -> [0, 1, 4]."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def allocated(show_job, node, expand):
    # type: (str, str, typing.Callable[[str], list]) -> list
    """This node's GPU indexes in `scontrol -d show job` output; expand turns a host list into names."""
    for nodes, gres in NODE_LINE.findall(show_job):
        if node in expand(nodes):
            return sorted({i for found in GPU_IDX.findall(gres) for i in indexes(found)})
    raise Refused("node %s is not in the job's allocation (scontrol -d show job)" % node)


def _scontrol(args, env):
    # type: (list, dict) -> str
    try:
        proc = subprocess.run(["scontrol"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Refused("scontrol %s: %s" % (" ".join(args), e))
    if proc.returncode != 0:
        raise Refused("scontrol %s: %s" % (" ".join(args), proc.stderr.strip() or "exit %d" % proc.returncode))
    return proc.stdout


def edit(config, gpus, fabric):
    # type: (dict, list, typing.Optional[str]) -> dict
    """config.json naming exactly these GPUs, with the fabric's devices bound where given."""
    env = [e for e in config.get("process", {}).get("env", []) if e.split("=", 1)[0] not in STALE + ("NVIDIA_VISIBLE_DEVICES",)]
    env.append("NVIDIA_VISIBLE_DEVICES=" + (",".join(map(str, gpus)) or "void"))
    config.setdefault("process", {})["env"] = env
    if fabric and not any(m.get("destination") == fabric for m in config.get("mounts", [])):
        config.setdefault("mounts", []).append({"destination": fabric, "type": "bind", "source": fabric,
                                                "options": ["rbind", "nosuid", "noexec"]})
    return config


def write(path, config):
    # type: (str, dict) -> None
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".config.json.")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    os.rename(tmp, path)


def prepare(argv):
    # type: (list) -> str
    """Edit the bundle's config.json for this node's share of the job; a line for the log."""
    path = os.path.join(bundle_of(argv), "config.json")
    with open(path) as f:
        config = json.load(f)
    job_env = dict(e.split("=", 1) for e in config.get("process", {}).get("env", []) if "=" in e)
    job = os.environ.get("SLURM_JOB_ID") or job_env.get("SLURM_JOB_ID")
    if not job:
        raise Refused("no SLURM_JOB_ID in the runtime's environment or the bundle's")
    env = dict(os.environ)
    if "SLURM_CONF" not in env and "SLURM_CONF" in job_env:  # a cluster whose slurm.conf is not the default
        env["SLURM_CONF"] = job_env["SLURM_CONF"]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    gpus = allocated(_scontrol(["-d", "show", "job", job], env), node,
                     lambda nodes: _scontrol(["show", "hostnames", nodes], env).split())
    fabric = FABRIC if os.path.isdir(FABRIC) else None
    write(path, edit(config, gpus, fabric))
    return "job %s on %s: NVIDIA_VISIBLE_DEVICES=%s%s" % (job, node, ",".join(map(str, gpus)) or "void",
                                                          ", %s bound" % FABRIC if fabric else "")


PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def create_then_start(argv):
    # type: (list) -> int
    """`RUNTIME [GLOBAL...] run [OPTIONS] ID` as create, start and a wait; the container's exit status."""
    at = argv.index("run")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise Refused("prctl(PR_SET_CHILD_SUBREAPER): %s" % os.strerror(ctypes.get_errno()))
    with tempfile.TemporaryDirectory(prefix=NAME + "-") as tmp:
        pidfile = os.path.join(tmp, "pid")
        created = subprocess.call(argv[:at] + ["create", "--pid-file", pidfile] + argv[at + 1:])
        if created != 0:
            return created
        with open(pidfile) as f:
            pid = int(f.read().strip())
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    started = subprocess.call(argv[:at] + ["start", argv[-1]], stdout=subprocess.DEVNULL)
    if started != 0:
        os.kill(pid, signal.SIGKILL)
    while True:  # reap everything reparented here; the container's process decides
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if done == pid:
            return started or (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main(argv):
    # type: (list) -> None
    if "run" not in argv and "create" not in argv:
        sys.exit("usage: %s RUNTIME [GLOBAL OPTIONS] run|create --bundle BUNDLE ID" % NAME)
    try:
        print("%s: %s" % (NAME, prepare(argv)), file=sys.stderr)
        if "run" in argv:
            sys.exit(create_then_start(argv))
    except (Refused, OSError, ValueError) as e:
        sys.exit("%s: error: %s; no container started" % (NAME, e))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
