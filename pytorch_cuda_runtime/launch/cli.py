"""pytorch-cuda-launch: parse, plan (environ in, Launch out), then print or exec torchrun.

    pytorch-cuda-launch [--print | --dry-run] [-m] SCRIPT [ARGS...]

--print writes the resolved launch (source, nodes, node rank or rendezvous, ranks per node, the
working directory, the environment changes, the exact argv) and starts nothing. -m runs SCRIPT
as a module, as `python -m` does. Everything after SCRIPT is the script's, passed on as it is.

PYTORCH_CUDA_WORKDIR, where set, is the directory torchrun and the ranks start in: the launcher
changes to it first, so a relative SCRIPT and relative paths in ARGS are taken from there. It is
how `build.py job` gives an OCI bundle's tasks the submit directory: the bundle's cwd is fixed
in its config.json, while the job's environment reaches the container.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import LaunchError, environment, nproc, sources
from .. import hostlist

USAGE = "usage: pytorch-cuda-launch [--print] [-m] SCRIPT [ARGS...]"
WORKDIR = "PYTORCH_CUDA_WORKDIR"
# How long the rendezvous waits for every node: c10d's join_timeout, the static store's timeout.
# torchrun's own 600 s is short for a node that is still pulling or unpacking a 6.5 GB image
# (pyxis imports it on each node's first use; a Kubernetes node pulls it).
RDZV_TIMEOUT = "PYTORCH_CUDA_RDZV_TIMEOUT"
DEFAULT_RDZV_TIMEOUT = 1800
# "1": torchrun prefixes every line of each rank with its global rank (--tee 3 and its prefix
# template), so one file of many ranks says who wrote what. The sbatch script sets it.
RANK_LABELS = "PYTORCH_CUDA_RANK_LABELS"
RANK_PREFIX = "[rank${rank}]: "


@dataclass(frozen=True)
class Machine:
    """What plan() asks of the machine; tests pass their own."""
    python: str = sys.executable
    uid: int = field(default_factory=os.getuid)
    passwd_home: str | None = None
    hostnames: Callable[[str], list[str]] = hostlist.hostnames
    gpus: Callable[[Mapping[str, str]], tuple[int, str]] = nproc.visible_gpus
    writable: Callable[[str], bool] = environment.writable
    is_file: Callable[[str], bool] = os.path.isfile
    is_dir: Callable[[str], bool] = os.path.isdir


@dataclass(frozen=True)
class Launch:
    topology: sources.Topology
    nproc: str
    nproc_why: str
    argv: list[str]
    env: dict[str, str]
    changes: list[str]
    dry_run: bool
    cwd: str | None = None  # PYTORCH_CUDA_WORKDIR; None: where the launcher was started


def parse(args: list[str]) -> tuple[bool, bool, str, list[str]]:
    """(dry_run, module, script, script_args)."""
    dry_run = module = False
    i = 0
    while i < len(args) and args[i].startswith("-"):
        opt, i = args[i], i + 1
        if opt in ("--print", "--dry-run"):
            dry_run = True
        elif opt in ("-m", "--module"):
            module = True
        elif opt == "--":
            break
        else:
            raise LaunchError(f"unknown option {opt!r}; {USAGE}")
    if i >= len(args) or not args[i].strip():
        raise LaunchError(f"no SCRIPT to run; {USAGE}")
    return dry_run, module, args[i], args[i + 1:]


def torchrun_argv(python: str, topo: sources.Topology, nproc_value: str, module: bool,
                  script: str, script_args: list[str], rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT,
                  labels: bool = False) -> list[str]:
    argv = [python, "-m", "torch.distributed.run"]
    if topo.rdzv_id is not None:
        argv += ["--nnodes", str(topo.nnodes), "--nproc_per_node", nproc_value, "--rdzv_backend", "c10d",
                 "--rdzv_endpoint", f"{topo.master_addr}:{topo.master_port}", "--rdzv_id", topo.rdzv_id,
                 "--rdzv_conf", f"join_timeout={rdzv_timeout}"]
    elif topo.master_addr is None:
        argv += ["--standalone", "--nproc_per_node", nproc_value]
    else:
        argv += ["--nnodes", str(topo.nnodes), "--nproc_per_node", nproc_value, "--node_rank", str(topo.node_rank),
                 "--master_addr", topo.master_addr, "--master_port", str(topo.master_port),
                 "--rdzv_conf", f"timeout={rdzv_timeout}"]
    if labels:
        argv += ["--tee", "3"]
    return argv + (["--module"] if module else []) + [script, *script_args]


def rdzv_timeout(env: Mapping[str, str]) -> int:
    """PYTORCH_CUDA_RDZV_TIMEOUT in whole seconds, else DEFAULT_RDZV_TIMEOUT."""
    text = env.get(RDZV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_RDZV_TIMEOUT
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"{RDZV_TIMEOUT}={text!r} is not a whole number of seconds (at least 1)")
    return int(text)


def workdir(env: Mapping[str, str], machine: Machine) -> str | None:
    """PYTORCH_CUDA_WORKDIR: an absolute path to a directory, or unset (or empty)."""
    cwd = env.get(WORKDIR, "")
    if not cwd:
        return None
    if not cwd.startswith("/"):
        raise LaunchError(f"{WORKDIR}={cwd!r} is not an absolute path")
    if not machine.is_dir(cwd):
        raise LaunchError(f"{WORKDIR}={cwd} is not a directory here (is it mounted into the container?)")
    return cwd


def plan(args: list[str], env: Mapping[str, str], machine: Machine | None = None) -> Launch:
    """The whole decision, with no side effect: LaunchError where the environment cannot launch."""
    machine = machine or Machine()
    dry_run, module, script, script_args = parse(args)
    cwd = workdir(env, machine)
    if not module and not machine.is_file(os.path.join(cwd or "", script)):
        raise LaunchError(f"SCRIPT {script!r}: no such file" + (f" in {cwd} ({WORKDIR})" if cwd and not script.startswith("/") else ""))
    topo = sources.detect(env, machine.hostnames)
    nproc_value, why = nproc.nproc_per_node(env, topo, lambda: machine.gpus(env))
    child, changes = environment.child_env(env, machine.uid, machine.passwd_home, machine.writable)
    if cwd and child.get("PWD") not in (None, cwd):
        child["PWD"] = cwd  # what a shell in a rank takes as its directory
    labels = env.get(RANK_LABELS) == "1"
    if labels:
        child["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX
        changes = [*changes, f"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={RANK_PREFIX} ({RANK_LABELS}=1: each line names its rank)"]
    argv = torchrun_argv(machine.python, topo, nproc_value, module, script, script_args, rdzv_timeout(env), labels)
    return Launch(topo, nproc_value, why, argv, child, changes, dry_run, cwd)


def render(launch: Launch) -> str:
    t = launch.topology
    if t.rdzv_id is not None:
        place = f"node rank: assigned by the c10d rendezvous\nrendezvous: c10d at {t.master_addr}:{t.master_port}, id {t.rdzv_id}"
    elif t.master_addr is None:
        place = "node rank: 0\nrendezvous: standalone (this node only)"
    else:
        place = f"node rank: {t.node_rank}\nrendezvous: static, master {t.master_addr}:{t.master_port}"
    lines = [f"source: {t.source}" + (f" ({', '.join(t.read)})" if t.read else ""),
             f"nnodes: {t.nnodes}", place, f"nproc_per_node: {launch.nproc} ({launch.nproc_why})"]
    if launch.cwd:
        lines.append(f"cwd: {launch.cwd} ({WORKDIR})")
    lines += [f"env: {c}" for c in launch.changes]
    lines.append(f"argv: {shlex.join(launch.argv)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    try:
        launch = plan(list(sys.argv[1:] if argv is None else argv), env,
                      Machine(uid=os.getuid(), passwd_home=environment.passwd_home(os.getuid())))
        if launch.dry_run:
            print(render(launch))
            return 0
        if importlib.util.find_spec("torch") is None:
            raise LaunchError(f"{launch.argv[0]} cannot import torch")
        home = launch.env["HOME"]
        try:
            os.makedirs(home, mode=0o700, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"cannot make HOME {home}: {e.strerror}") from None
        if not os.access(home, os.W_OK | os.X_OK):
            raise LaunchError(f"no writable HOME: {home} is not writable by uid {os.getuid()}")
        if launch.cwd:
            try:
                os.chdir(launch.cwd)
            except OSError as e:
                raise LaunchError(f"cannot change to {WORKDIR}={launch.cwd}: {e.strerror}") from None
    except LaunchError as e:
        print(f"pytorch-cuda: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.argv[0], launch.argv, launch.env)
    return 0  # not reached
