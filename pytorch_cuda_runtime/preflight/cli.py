"""pytorch-cuda-preflight: one node's process; phase 1 here, the roll call, then the fabric's ranks.

    pytorch-cuda-preflight [--gpus-per-node N] [--shm-size SIZE] [--rdma] [--join-timeout S]
                           [--timeout S] [--slow-ratio R] [--gpu-timeout S] [--gpu-slow-ratio R]
                           [--peak-ratio R] [--matmul-size N] [--warn CHECK[,CHECK]]
                           [--report PATH] [-- COMMAND [ARGS...]]

Each option but --gpus-per-node and --rdma may come from its variable instead
(PYTORCH_CUDA_PREFLIGHT_<OPTION>, e.g. PYTORCH_CUDA_PREFLIGHT_GPU_TIMEOUT); an option given wins.
Every one is checked, and the report's path found writable, before any check runs.

After `--`, COMMAND is exec'd once the preflight has passed (a Kubernetes pod's training
command); without it the preflight exits 0. Exit 1: a check failed, a node did not answer, the
fabric was slow or wrong, or a bound was reached; every such line starts
`pytorch-cuda-preflight: FAILED:` and names its node (and a GPU's, its index and serial). A check
named in --warn gives `pytorch-cuda-preflight: warning:` lines instead. Exit 2: the arguments,
their variables, the report's path, the manifest or the scheduler's environment cannot give a
preflight: one line, nothing run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from .. import banner, hostlist
from .. import manifest as mf
from ..launch import LaunchError, sources
from ..launch.cli import WORKDIR
from . import PreflightError, compute, fabric, gpupart, health, node, report, rollcall

PROG = "pytorch-cuda-preflight"
PHASE_GRACE_S = 60  # torchrun's start and the ranks' torch import, beyond the fabric's own bound
DEFAULT_REPORT = "pytorch-cuda-preflight.json"
MAX_MATMUL = 32768  # three 32768^2 bf16 matrices and the checksum's int64 copies: about 22 GiB on one GPU
# The variable each source reads its port from: the fabric phase takes MASTER_PORT + 2, so that
# neither the roll call's store (+ 1) nor the training's rendezvous (+ 0) meets a port still closing.
PORT_VARIABLE = {"slurm": "MASTER_PORT", "kubeflow": "PET_MASTER_PORT", "indexed-job": "PYTORCH_CUDA_MASTER_PORT",
                 "explicit": "PYTORCH_CUDA_MASTER_PORT"}


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def seconds(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def size_bytes(text: str) -> int:
    m = re.fullmatch(r"([1-9]\d*)(Mi|Gi|M|G)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 16Gi or 512Mi")
    return int(m[1]) << (30 if m[2].startswith("G") else 20)


def ratio(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ratio between 0 and 1")
    return value


def matmul_size(text: str) -> int:
    if not re.fullmatch(r"[1-9]\d*", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of rows")
    if int(text) > MAX_MATMUL:
        raise argparse.ArgumentTypeError(f"{text} is over {MAX_MATMUL} rows (three such bf16 matrices and the checksum's "
                                         "copies must fit one GPU)")
    return int(text)


def checks(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(health.CHECKS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(health.CHECKS)}")
    return names


@dataclass(frozen=True)
class Setting:
    """An option whose value may come from the environment: each is checked the same way from either."""
    option: str
    variable: str | None
    default: Any
    convert: Callable[[str], Any]
    metavar: str
    help: str


SETTINGS = (
    Setting("--shm-size", "PYTORCH_CUDA_PREFLIGHT_SHM_SIZE", banner.SHM_MIN_BYTES, size_bytes, "SIZE",
            "the /dev/shm the job needs, e.g. 16Gi (default 1Gi)"),
    Setting("--join-timeout", "PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT", 600.0, seconds, "S",
            "seconds the roll call waits for every node (default 600: a node still pulling or unpacking its image)"),
    Setting("--timeout", "PYTORCH_CUDA_PREFLIGHT_TIMEOUT", 300.0, seconds, "S",
            "seconds for every collective of the fabric phase (default 300)"),
    Setting("--slow-ratio", "PYTORCH_CUDA_PREFLIGHT_SLOW_RATIO", report.SLOW_RATIO, ratio, "R",
            f"a node whose best neighbour link is under R x the median node's is slow (default {report.SLOW_RATIO})"),
    Setting("--gpu-timeout", "PYTORCH_CUDA_PREFLIGHT_GPU_TIMEOUT", compute.GPU_TIMEOUT_S, seconds, "S",
            f"seconds for a node's GPU part, health and compute check together (default {compute.GPU_TIMEOUT_S:g})"),
    Setting("--gpu-slow-ratio", "PYTORCH_CUDA_PREFLIGHT_GPU_SLOW_RATIO", compute.SLOW_RATIO, ratio, "R",
            f"a GPU under R x the job's median GPU of its product is slow (default {compute.SLOW_RATIO})"),
    Setting("--peak-ratio", "PYTORCH_CUDA_PREFLIGHT_PEAK_RATIO", compute.PEAK_RATIO, ratio, "R",
            f"a GPU under R x its product's dense bf16 peak fails (default {compute.PEAK_RATIO})"),
    Setting("--matmul-size", "PYTORCH_CUDA_PREFLIGHT_MATMUL_SIZE", compute.SIZE, matmul_size, "N",
            f"rows of the compute check's square bf16 matrices (default {compute.SIZE})"),
    Setting("--warn", "PYTORCH_CUDA_PREFLIGHT_WARN", frozenset(), checks, "CHECK[,CHECK]",
            f"checks that only warn, the preflight going on: {', '.join(health.CHECKS)}"),
    Setting("--report", "PYTORCH_CUDA_PREFLIGHT_REPORT", DEFAULT_REPORT, str, "PATH",
            f"the JSON report, relative to the working directory (default {DEFAULT_REPORT})"),
)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PreflightError(message)


def parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Every option and its variable checked, and the report's path writable, before anything runs."""
    argv, then = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="N", help="GPUs the job requested on each node (0: none)")
    p.add_argument("--rdma", action="store_true", help="the job asked for RDMA devices: require them, and their memlock")
    for s in SETTINGS:
        p.add_argument(s.option, type=s.convert, default=None, metavar=s.metavar,
                       help=s.help + (f"; else ${s.variable}" if s.variable else ""))
    args = p.parse_args(argv)
    named_report = args.report is not None or bool(env.get("PYTORCH_CUDA_PREFLIGHT_REPORT", "").strip())
    for s in SETTINGS:
        dest = s.option.lstrip("-").replace("-", "_")
        if getattr(args, dest) is None:
            setattr(args, dest, from_env(env, s))
    if args.gpus_per_node < 0:
        raise PreflightError(f"--gpus-per-node {args.gpus_per_node} is negative")
    why = unwritable(os.path.join(env.get(WORKDIR) or os.getcwd(), args.report))
    if why and named_report:
        raise PreflightError(f"the report {args.report} cannot be written: {why} (name another with --report or "
                             "$PYTORCH_CUDA_PREFLIGHT_REPORT)")
    # The default name in a read-only working directory (a code mount): the checks still run, and say so.
    args.report_warning = f"the report {args.report} will not be written: {why} (name one with --report)" if why else None
    args.then = then
    return args


def from_env(env: dict[str, str], s: Setting) -> Any:
    text = env.get(s.variable or "", "")
    if not text.strip():
        return s.default
    try:
        return s.convert(text.strip())
    except argparse.ArgumentTypeError as e:
        raise PreflightError(f"${s.variable} (for {s.option}): {e}") from None


def unwritable(path: str) -> str | None:
    """Why the report cannot be written at path, or None: checked before any check runs."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return f"{path} is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def failed(lines: list[str]) -> int:
    for line in lines:
        say(f"FAILED: {line}")
    say("FAILED: training not started")
    return 1


def announce(verdict: dict[str, Any]) -> None:
    """The roll call's verdict, said as soon as this node has it."""
    for line in verdict.get("warnings", []):
        say(f"warning: {line}")
    if verdict["lines"]:
        failed(verdict["lines"])
    else:
        say(f"{len(verdict['answered'])} node(s) answered and passed their checks: {', '.join(verdict['answered'])}")


def roll_call(topo: Any, env: dict[str, str], me: str, result: dict[str, Any], timeout_s: float,
              judge: rollcall.Judge | None = None) -> tuple[dict[str, Any], bool]:
    """The verdict, and whether this node is the first (it prints the GPU table and a failed run's report)."""
    if topo.nnodes == 1:
        verdict = rollcall.verdict((me,), {me: result}, 0, judge)
        announce(verdict)
        return verdict, True
    hosts = hostlist.hostnames(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")) if topo.node_rank is None else ()
    place = rollcall.place(topo, me, hosts)
    verdict = rollcall.call(place, result, timeout_s, announce=announce, judge=judge)
    if not verdict["answered"]:  # this node could not take part: its own verdict, not yet said
        announce(verdict)
    return verdict, place.first


def gpu_options(args: argparse.Namespace) -> gpupart.Options:
    return gpupart.Options(timeout_s=args.gpu_timeout, size=args.matmul_size, slow_ratio=args.gpu_slow_ratio,
                           peak_ratio=args.peak_ratio, warn=args.warn)


def gpu_line(me: str, part: dict[str, Any]) -> str:
    """One line of what the GPU part did on this node."""
    if part.get("skipped"):
        return f"node {me}: GPU part skipped: {part['skipped']}"
    h, c = part.get("health") or {}, part.get("compute") or {}
    read = f"health skipped ({h['skipped']})" if h.get("skipped") else f"health of {len(h.get('gpus', []))} GPU(s) via {h.get('source')}"
    measured = (f"compute check skipped ({c['skipped']})" if c.get("skipped") else
                f"compute check failed ({c['error']})" if c.get("error") else
                f"bf16 matmul on {len(c.get('gpus', []))} GPU(s) ({c.get('source')})")
    return f"node {me}: {read}; {measured}"


def gpu_table(verdict: dict[str, Any]) -> None:
    record = verdict.get("gpus")
    if record and (record["rows"] or record["notes"]):
        print("\n".join(compute.table(record["rows"], record["notes"], record["size"], record["seed"])), flush=True)


def leave_report(path: str, verdict: dict[str, Any]) -> None:
    """A failed roll call's report (the fabric writes a passed one): whole or not at all."""
    record = {"passed": False, "lines": verdict["lines"], "warnings": verdict.get("warnings", []),
              "node_checks": verdict["summaries"], "gpus": verdict.get("gpus")}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
        say(f"report {os.path.abspath(path)}")
    except OSError as e:
        say(f"warning: cannot write the report {path}: {e.strerror}")


def fabric_phase(args: argparse.Namespace, topo: Any, env: dict[str, str], verdict: dict[str, Any]) -> dict[str, Any]:
    """The ranks under the launch contract; the verdict they left, or lines saying why there is none."""
    me = node.hostname()
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-preflight-") as tmp:
        left, nodes = os.path.join(tmp, "verdict.json"), os.path.join(tmp, "nodes.json")
        with open(nodes, "w", encoding="utf-8") as f:
            json.dump({"node_checks": verdict["summaries"], "gpus": verdict.get("gpus"),
                       "warnings": verdict.get("warnings", [])}, f)
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


def stop(proc: subprocess.Popen[Any], grace: float = 10) -> None:
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


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
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
        if args.report_warning:
            say(f"warning: {args.report_warning}")
        needs = node.Needs(args.gpus_per_node, args.shm_size, args.rdma, manifest)
        facts = node.gather(env)
        opts = gpu_options(args)
        part = gpupart.run(env, facts.node, bool(facts.gpus), args.gpus_per_node, opts)
        fails, warns = gpupart.node_lines(part, opts.warn)
        result = {"lines": node.check(facts, needs) + fails, "warnings": warns, "summary": node.summary(facts, needs),
                  "gpu": part}
        say(result["summary"])
        say(gpu_line(facts.node, part))
        say((f"{topo.nnodes} nodes ({topo.source}): the roll call within {args.join_timeout:.0f} s, then" if topo.nnodes > 1
             else "one node:") + f" the fabric within {args.timeout + PHASE_GRACE_S:.0f} s")
        verdict, first = roll_call(topo, env, facts.node, result, args.join_timeout,
                                   judge=lambda results: gpupart.job_verdict(results, opts))
    except PreflightError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if first:
        gpu_table(verdict)
    if verdict["lines"]:
        if first:
            leave_report(os.path.join(env.get(WORKDIR) or os.getcwd(), args.report), verdict)
        return 1  # announced
    measured = fabric_phase(args, topo, env, verdict)
    if not measured["passed"]:
        return failed(measured["lines"])
    say("passed" + (f"; starting {args.then[0]}" if args.then else ""))
    if args.then:
        sys.stdout.flush()
        os.execvp(args.then[0], args.then)
    return 0
