"""pytorch-cuda-preflight: one node's process; phase 1 here, the roll call, then the fabric's ranks.

    pytorch-cuda-preflight [--gpus-per-node N] [--shm-size SIZE] [--rdma] [--join-timeout S]
                           [--timeout S] [--slow-ratio R] [--report PATH] [-- COMMAND [ARGS...]]

After `--`, COMMAND is exec'd once the preflight has passed (a Kubernetes pod's training
command); without it the preflight exits 0. Exit 1: a check failed, a node did not answer, the
fabric was slow or wrong, or a bound was reached; every such line starts
`pytorch-cuda-preflight: FAILED:` and names its node. Exit 2: the arguments, the manifest or the
scheduler's environment cannot give a preflight.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from .. import hostlist
from .. import manifest as mf
from ..launch import LaunchError, sources
from ..launch.cli import WORKDIR
from . import PreflightError, fabric, node, report, rollcall

PROG = "pytorch-cuda-preflight"
JOIN_TIMEOUT = ("PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT", 600)  # a node still pulling or unpacking its image
TIMEOUT = ("PYTORCH_CUDA_PREFLIGHT_TIMEOUT", 300)  # every collective of the fabric phase
PHASE_GRACE_S = 60  # torchrun's start and the ranks' torch import, beyond the fabric's own bound
DEFAULT_REPORT = "pytorch-cuda-preflight.json"
# The variable each source reads its port from: the fabric phase takes MASTER_PORT + 2, so that
# neither the roll call's store (+ 1) nor the training's rendezvous (+ 0) meets a port still closing.
PORT_VARIABLE = {"slurm": "MASTER_PORT", "kubeflow": "PET_MASTER_PORT", "indexed-job": "PYTORCH_CUDA_MASTER_PORT",
                 "explicit": "PYTORCH_CUDA_MASTER_PORT"}


def seconds(text):
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def size_bytes(text):
    m = re.fullmatch(r"([1-9]\d*)(Mi|Gi|M|G)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 16Gi or 512Mi")
    return int(m[1]) << (30 if m[2].startswith("G") else 20)


def ratio(text):
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ratio between 0 and 1")
    return value


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PreflightError(message)


def parse(argv, env):
    argv, then = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="N", help="GPUs the job requested on each node (0: none)")
    p.add_argument("--shm-size", type=size_bytes, default=node.banner.SHM_MIN_BYTES, metavar="SIZE",
                   help="the /dev/shm the job needs, e.g. 16Gi (default 1Gi)")
    p.add_argument("--rdma", action="store_true", help="the job asked for RDMA devices: require them, and their memlock")
    for name, (var, default) in (("--join-timeout", JOIN_TIMEOUT), ("--timeout", TIMEOUT)):
        p.add_argument(name, type=seconds, default=seconds(env.get(var) or default), metavar="S",
                       help=f"seconds (default ${var}, else {default})")
    p.add_argument("--slow-ratio", type=ratio, default=report.SLOW_RATIO, metavar="R",
                   help=f"a node whose best neighbour link is under R x the median node's is slow (default {report.SLOW_RATIO})")
    p.add_argument("--report", default=env.get("PYTORCH_CUDA_PREFLIGHT_REPORT") or DEFAULT_REPORT, metavar="PATH",
                   help=f"the JSON report, relative to the working directory (default {DEFAULT_REPORT})")
    args = p.parse_args(argv)
    if args.gpus_per_node < 0:
        raise PreflightError(f"--gpus-per-node {args.gpus_per_node} is negative")
    args.then = then
    return args


def say(line):
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def failed(lines):
    for line in lines:
        say(f"FAILED: {line}")
    say("FAILED: training not started")
    return 1


def announce(verdict):
    """The roll call's verdict, said as soon as this node has it."""
    if verdict["lines"]:
        failed(verdict["lines"])
    else:
        say(f"{len(verdict['answered'])} node(s) answered and passed their checks: {', '.join(verdict['answered'])}")


def roll_call(topo, env, me, result, timeout_s):
    if topo.nnodes == 1:
        verdict = rollcall.verdict((me,), {me: result}, 0)
        announce(verdict)
        return verdict
    hosts = hostlist.hostnames(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")) if topo.node_rank is None else ()
    verdict = rollcall.call(rollcall.place(topo, me, hosts), result, timeout_s, announce=announce)
    if not verdict["answered"]:  # this node could not take part: its own verdict, not yet said
        announce(verdict)
    return verdict


def fabric_phase(args, topo, env, verdict):
    """The ranks under the launch contract; the verdict they left, or lines saying why there is none."""
    me = node.hostname()
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-preflight-") as tmp:
        left, nodes = os.path.join(tmp, "verdict.json"), os.path.join(tmp, "nodes.json")
        with open(nodes, "w", encoding="utf-8") as f:
            json.dump(verdict["summaries"], f)
        # Only rank 0 prints (the table): no rank labels before its lines.
        child = {**env, fabric.VERDICT: left, fabric.NODES: nodes, "PYTORCH_CUDA_RDZV_TIMEOUT": str(int(args.timeout)),
                 "PYTORCH_CUDA_RANK_LABELS": "0"}
        if topo.source in PORT_VARIABLE:
            child[PORT_VARIABLE[topo.source]] = str(topo.master_port + 2)
        workdir = env.get(WORKDIR) or os.getcwd()
        argv = [sys.executable, "-m", "pytorch_cuda_runtime.launch", "-m", "pytorch_cuda_runtime.preflight.fabric",
                "--timeout", str(args.timeout), "--slow-ratio", str(args.slow_ratio),
                "--report", os.path.join(workdir, args.report)]
        proc = subprocess.Popen(argv, env=child, start_new_session=True)
        bound = args.timeout + PHASE_GRACE_S
        try:
            rc = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            stop(proc)
            return {"passed": False, "lines": [f"node {me}: the fabric test did not end within {bound:.0f} s and was "
                                               "stopped: a node or its network stopped answering"]}
        except BaseException:
            stop(proc)
            raise
        try:
            with open(left, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"passed": False, "lines": [f"node {me}: the fabric test ended (exit {rc}) without a verdict: "
                                               "the lines above say why"]}


def stop(proc, grace=10):
    """The launcher's whole process group: torchrun and its ranks."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv=None, env=None):
    env = dict(os.environ if env is None else env)
    try:
        args = parse(list(sys.argv[1:] if argv is None else argv), env)
        try:
            manifest = mf.load()
        except (OSError, ValueError) as e:
            raise PreflightError(f"the image's manifest is unreadable ({e}): the row's needs are unknown") from None
        try:
            topo = sources.detect(env, hostlist.hostnames)
        except LaunchError as e:
            raise PreflightError(str(e)) from None
        needs = node.Needs(args.gpus_per_node, args.shm_size, args.rdma, manifest)
        facts = node.gather(env)
        result = {"lines": node.check(facts, needs), "summary": node.summary(facts, needs)}
        say(result["summary"])
        say((f"{topo.nnodes} nodes ({topo.source}): the roll call within {args.join_timeout:.0f} s, then" if topo.nnodes > 1
             else "one node:") + f" the fabric within {args.timeout + PHASE_GRACE_S:.0f} s")
        verdict = roll_call(topo, env, facts.node, result, args.join_timeout)
    except PreflightError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if verdict["lines"]:
        return 1  # announced
    measured = fabric_phase(args, topo, env, verdict)
    if not measured["passed"]:
        return failed(measured["lines"])
    say("passed" + (f"; starting {args.then[0]}" if args.then else ""))
    if args.then:
        sys.stdout.flush()
        os.execvp(args.then[0], args.then)
    return 0
