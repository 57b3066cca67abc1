"""`build.py job`'s options, declared once (spec.py), and the Job they describe."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .. import rules, spec
from ..errors import BadValue
from ..rules import Checks
from ..spec import flag, many, opt
from . import KINDS, LAUNCH, NAME_MAX, PREFLIGHT, QOS, RUNTIMES, ImageRef, deadline_seconds, default_name, memory_mib, parse_image, quantity, shm_mib
from .mounts import Mount, parse, parse_all

# The forms of job's values. A path in the sbatch script is written in double quotes, so that
# $SLURM_SUBMIT_DIR expands: no quote, backslash, backquote, other $ or blank in it.
LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # a DNS-1123 label (jobs.NAME)
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
RDMA = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?=[1-9]\d*"
IFNAME = r"[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*"
SHARED_PATH = r"(/|\$SLURM_SUBMIT_DIR/|\$\{SLURM_SUBMIT_DIR\}/)[^\s\"'`\\$]*"
SCRIPT = r"[\w./+@%:,=-]+"
SHARED = "that every node sees (or one under $SLURM_SUBMIT_DIR/), without quotes, blanks or other $"


def _workdir(name: str, value: str) -> None:
    if not (re.fullmatch(SHARED_PATH, value) and ":" not in value and os.path.normpath(value) == value):
        raise BadValue(f"{name} takes an absolute directory in the container (or one under $SLURM_SUBMIT_DIR/), in normal form, "
                       f"without quotes, blanks, : or other $, not {value!r}", name=name)

EPILOG = """\
code and data:
  Slurm: submit from the directory that holds SCRIPT, on a filesystem every node mounts. The
  submit directory is bound at the same path and is the working directory; --mount binds more
  shared directories (the oci runtime's bundle step in the script's header binds them).
    python3 build.py job --torch 2.7 --scheduler slurm --nodes 2 --gpus-per-node 8 \\
      --mount /shared/datasets:/data:ro --output . -- train.py --deepspeed ds.json --data /data
  Kubernetes: --mount pvc:CLAIM:TARGET (a PersistentVolumeClaim) or HOSTDIR:TARGET (a hostPath,
  which ignores fsGroup: uid 1000 or group 1000 must be able to read it on every node). The first
  mount's TARGET is the working directory, so put the code first.
    python3 build.py job --torch 2.7 --scheduler kubernetes --kind jobset --nodes 2 \\
      --mount pvc:code:/code:ro --mount pvc:datasets:/data:ro --output job.yaml \\
      -- train.py --deepspeed ds.json
  Relative paths in SCRIPT and ARGS are taken from the working directory (--workdir to pick it);
  the ARGS reach the script as written."""


@dataclass(frozen=True)
class JobOptions(spec.Row):
    NAME: ClassVar[str] = "job"
    HELP: ClassVar[str] = ("write a multi-node job that runs SCRIPT through the image's launch contract: an sbatch "
                           "script (--scheduler slurm) or manifests (--scheduler kubernetes), image pinned by digest")
    PARSER: ClassVar[dict[str, Any]] = {
        "description": "After `--`, SCRIPT [ARGS] as `pytorch-cuda-launch` takes them, e.g.\n"
                       "`job --torch 2.7 --scheduler slurm --nodes 2 --gpus-per-node 8 -- train.py --lr 1e-4`.",
        "epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("cluster_runtime", "rdma", "a TrainJob cannot add IPC_LOCK to a ClusterTrainingRuntime's container (Trainer v2.1's "
                                    "podTemplateOverrides carry no capabilities); without --cluster-runtime the job brings its own runtime"),
        ("cluster_runtime", "deadline", "Trainer v2.1's TrainJob has no deadline and its podTemplateOverrides carry none: the "
                                        "ClusterTrainingRuntime's own Job template decides; without --cluster-runtime the job brings its own runtime"))
    ONLY_WITH: ClassVar[tuple[tuple[str, str, tuple[str, ...], str], ...]] = (
        ("kind", "scheduler", ("kubernetes",), "it picks a Kubernetes resource; Slurm runs an sbatch script"),
        ("runtime", "scheduler", ("slurm",), "a Kubernetes node's own container runtime runs the pods"),
        *[(dest, "scheduler", ("slurm",), "it is a Slurm runtime's image") for dest in ("bundle", "sif")],
        ("bundle", "runtime", ("oci",), "only Slurm's OCI support runs a bundle"),
        ("sif", "runtime", ("apptainer",), "only Apptainer runs a .sif"),
        ("rdma", "scheduler", ("kubernetes",), "it requests a Kubernetes device resource; under Slurm NCCL finds InfiniBand itself"),
        ("namespace", "scheduler", ("kubernetes",), "Slurm has no namespaces"),
        ("cluster_runtime", "kind", ("trainjob",), "only a TrainJob refers to a training runtime"),
        ("cpus_per_node", "scheduler", ("kubernetes",), "it sets a Kubernetes pod's CPU request; the sbatch script takes whole nodes "
                                                        "(--exclusive)"),
        ("memory_per_node", "scheduler", ("kubernetes",), "it sets a Kubernetes pod's memory request; under Slurm, sbatch's --mem "
                                                          "on its command line does"),
        ("qos", "scheduler", ("kubernetes",), "it picks a Kubernetes pod's QoS class; the sbatch script takes whole nodes (--exclusive)"),
        ("deadline", "scheduler", ("kubernetes",), "it sets a Kubernetes job's activeDeadlineSeconds; under Slurm, sbatch's --time "
                                                   "on its command line does"),
        ("image_pull_secret", "scheduler", ("kubernetes",), "it names a Kubernetes Secret; under Slurm each runtime "
                                                            "pulls with its own credentials (enroot, Apptainer, skopeo)"))

    scheduler: str | None = opt(None, "what runs the job", required=True, choices=("slurm", "kubernetes"))
    nodes: int | None = opt(None, "nodes (pods), one launch per node", required=True, type=spec.positive_int)
    gpus_per_node: int = opt(0, "GPUs each node requests, one rank each (default 0: none requested, the contract decides)",
                             type=spec.whole, metavar="N")
    image: str | None = opt(None, "the image by digest (default: the row's build-results/<image>/published.json, from publish --push)",
                            metavar="REPO@sha256:...",
                            check=rules.parsed_by(parse_image))
    name: str | None = opt(None, "job (and Kubernetes object) name, a DNS label of at most 40 characters (default: pytorch-cuda-<torch>)",
                           check=rules.form(f"(?=.{{1,{NAME_MAX}}}$){LABEL}",
                                            f"a lowercase DNS label (a-z, 0-9, -) of at most {NAME_MAX} characters"))
    shm_size: str = opt("16Gi", "/dev/shm for each node, e.g. 16Gi or 512Mi (default 16Gi)", metavar="SIZE",
                         check=rules.parsed_by(shm_mib))
    network: str = opt("auto", "auto (default): NCCL uses InfiniBand where present; socket: TCP only (NCCL_IB_DISABLE=1)",
                       choices=("auto", "socket"))
    socket_ifname: str | None = opt(None, "NCCL_SOCKET_IFNAME, e.g. eth0 or ^docker,lo (default: NCCL picks)", metavar="IFNAME",
                                check=rules.form(IFNAME, "NCCL_SOCKET_IFNAME's form (eth0, ^docker,lo, =ib0)"))
    mount: tuple[str, ...] = many("the user's code or data at TARGET in every task; repeatable. SOURCE: Kubernetes pvc:CLAIM or an "
                                  "absolute host path (hostPath, type Directory); Slurm an absolute path on the shared filesystem",
                                  metavar="SOURCE:TARGET[:ro]")
    workdir: str | None = opt(None, "the tasks' working directory, where relative paths in SCRIPT and ARGS are taken from "
                                    "(default: Slurm the submit directory; Kubernetes the first --mount's TARGET, else the image's /workspace)",
                              metavar="DIR", check=_workdir)
    output: Path | None = opt(None, "file to write, or a directory for <name>.sbatch / <name>.yaml (default: stdout)", type=Path,
                              metavar="FILE|DIR", check=rules.writable_file_or_folder)
    runtime: str | None = opt(None, "slurm: oci (default; srun --container), pyxis (enroot) or apptainer", choices=RUNTIMES)
    bundle: str | None = opt(None, "slurm oci: the OCI bundle on a shared filesystem (default: $SLURM_SUBMIT_DIR/bundles/USER/<image>-<12 hex of the digest>)",
                             metavar="DIR", check=rules.form(SHARED_PATH, f"an absolute path {SHARED}"))
    sif: str | None = opt(None, "slurm apptainer: a .sif to run instead of docker://IMAGE", metavar="FILE",
                          check=rules.form(rf"(?=.*\.sif\Z){SHARED_PATH}", f"an absolute path to a .sif file {SHARED}"))
    kind: str | None = opt(None, "kubernetes: trainjob, pytorchjob, jobset or indexed-job", choices=KINDS)
    rdma: tuple[str, ...] = many("kubernetes: an RDMA device resource per node, e.g. rdma/ib=1 (adds IPC_LOCK); repeatable",
                                 metavar="RESOURCE=COUNT",
                                 check=rules.form(RDMA, "RESOURCE=COUNT, a device resource and a count of at least 1 (e.g. rdma/ib=1)"))
    namespace: str | None = opt(None, "kubernetes: the namespace (default: none written, kubectl's current)",
                                check=rules.form(f"(?=.{{1,63}}$){LABEL}", "a Kubernetes namespace (a lowercase DNS label)"))
    cluster_runtime: str | None = opt(None, "trainjob: use this installed ClusterTrainingRuntime (e.g. torch-distributed) instead of "
                                            "writing a TrainingRuntime", metavar="NAME",
                                      check=rules.form(DNS_SUBDOMAIN, "a ClusterTrainingRuntime's name (a lowercase DNS name)"))
    cpus_per_node: int | None = opt(None, "kubernetes: CPUs each pod requests (default: none)", type=spec.positive_int, metavar="N")
    memory_per_node: str | None = opt(None, "kubernetes: memory each pod requests, /dev/shm and working memory together, e.g. 64Gi; "
                                            "more than --shm-size (default: --shm-size's, /dev/shm alone)", metavar="SIZE",
                                      check=rules.parsed_by(memory_mib))
    qos: str = opt("burstable", "kubernetes: burstable (default: requests, and limits only for GPUs and RDMA) or guaranteed "
                                "(cpu and memory limits equal to the requests; needs --cpus-per-node and --memory-per-node)",
                   choices=QOS, later=True)
    image_pull_secret: tuple[str, ...] = many("kubernetes: a Secret in the job's namespace that the pods pull the image with; repeatable",
                                              metavar="NAME",
                                              check=rules.form(DNS_SUBDOMAIN, "a Secret's name (a lowercase DNS name: a-z, 0-9, - and .)"))
    deadline: str | None = opt(None, "kubernetes: the job's activeDeadlineSeconds, e.g. 24h, 90m, 1h30m, 2d or seconds "
                                     "(default: none); not with --cluster-runtime", metavar="DURATION",
                               check=rules.parsed_by(deadline_seconds))
    preflight: bool = flag("run pytorch-cuda-preflight on every node first (driver, GPUs, /dev/shm, RDMA, the fabric measured, a "
                           "slow node named) and start training only if it passed; bounded (docs/clusters.md#preflight)")
    script: tuple[str, ...] = opt((), "after --: SCRIPT [ARGS...], run by pytorch-cuda-launch in the image", kind="many", metavar="SCRIPT")

    def setting(self, name: str) -> Any:
        if name == "runtime" and self.runtime is None and self.scheduler == "slurm":
            return "oci"  # Slurm's default runtime
        return super().setting(name)

    def rules(self, c: Checks) -> None:
        c.run("mount", lambda: parse_all(list(self.mount)))
        self._script(c)
        if self.scheduler == "kubernetes" and self.kind is None:
            c.fail(("scheduler", "kind"), "--scheduler kubernetes needs --kind: one of trainjob, pytorchjob, jobset, indexed-job")
        if self.memory_per_node is not None and c.ok("memory_per_node", "shm_size") \
                and memory_mib(self.memory_per_node) <= shm_mib(self.shm_size):
            c.fail(("memory_per_node", "shm_size"), f"--memory-per-node {self.memory_per_node} must be larger than --shm-size "
                   f"{self.shm_size}: a memory-backed /dev/shm counts against the pod's memory, which must also hold the "
                   "processes' working memory")
        if self.qos == "guaranteed" and not (self.cpus_per_node and self.memory_per_node):
            c.fail(("qos", "cpus_per_node", "memory_per_node"), "--qos guaranteed needs --cpus-per-node and --memory-per-node: "
                   "Guaranteed sets the limits equal to the requests, and the job guesses neither")
        if self.scheduler == "slurm":
            if c.ok("mount"):
                claim = next((text for text in self.mount if parse(text).pvc), None)
                if claim is not None:
                    c.fail(("mount", "scheduler"), f"--mount {claim!r} needs --scheduler kubernetes: pvc:CLAIM is a Kubernetes "
                           "PersistentVolumeClaim; under Slurm SOURCE is an absolute path on a filesystem every node mounts")
        elif self.workdir is not None and "$" in self.workdir and c.ok("workdir"):
            c.fail(("workdir", "scheduler"), f"--workdir {self.workdir!r} needs --scheduler slurm: $SLURM_SUBMIT_DIR is Slurm's; "
                                             "under Kubernetes it is an absolute directory in the container")

    def _script(self, c: Checks) -> None:
        """SCRIPT [ARGS]: the script (or -m MODULE) is a path the sbatch script may put in double
        quotes; the ARGS are shell-quoted and go as they are."""
        command = self.script
        if not command:
            return c.fail("script", "job needs SCRIPT [ARGS] after --, e.g. `-- train.py --epochs 3` (a path in the image, "
                                    "or -m MODULE)")
        script = command[1] if command[0] == "-m" and len(command) > 1 else command[0]
        if not re.fullmatch(SCRIPT, script) or script.startswith("-"):
            c.fail("script", f"SCRIPT takes a script path (or -m MODULE) of letters, digits and ./+@%:,=-, not {script!r}")


@dataclass(frozen=True)
class Job(JobOptions):
    """A validated `job` command, everything a renderer needs: its options as settled (the name, the
    Slurm runtime), the row, the image by digest and the command line that writes it."""

    scheduler: str = dataclasses.field(kw_only=True)
    nodes: int = dataclasses.field(kw_only=True)
    name: str = ""  # --name, else pytorch-cuda-<torch>
    runtime: str = ""  # slurm: oci, pyxis, apptainer (--runtime, else oci); kubernetes: ""
    row_name: str = dataclasses.field(kw_only=True)  # the matrix row's image name, e.g. 2.7.1-cuda12.1-runtime
    ref: ImageRef = dataclasses.field(kw_only=True)  # the image, pinned by digest
    argv: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)  # the `build.py job` arguments, for the GENERATED header

    @property
    def shm_mib(self) -> int:
        return shm_mib(self.shm_size)

    @property
    def mounts(self) -> tuple[Mount, ...]:  # --mount, in the order given
        return parse_all(list(self.mount))

    @property
    def rdma_counts(self) -> list[tuple[str, int]]:  # kubernetes: each --rdma's resource and count
        return [(text.split("=")[0], int(text.split("=")[1])) for text in self.rdma]

    @property
    def memory_mib(self) -> int | None:  # kubernetes: --memory-per-node, /dev/shm included; None: /dev/shm's size is requested
        return memory_mib(self.memory_per_node) if self.memory_per_node else None

    @property
    def deadline_s(self) -> int | None:  # kubernetes: the job's activeDeadlineSeconds; None: no deadline
        return deadline_seconds(self.deadline) if self.deadline else None

    def nccl_env(self) -> dict[str, str]:
        """NCCL's environment. NCCL finds InfiniBand (and RoCE) itself; only a socket-only choice
        turns it off, and an interface is named only where the user names one."""
        env = {}
        if self.network == "socket":
            env["NCCL_IB_DISABLE"] = "1"
        if self.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = self.socket_ifname
        return env

    def launch_env(self) -> dict[str, str]:
        """The launch contract's ranks per node: one per requested GPU; with none requested the
        contract decides (one CPU rank where the node shows no GPU)."""
        return {"PYTORCH_CUDA_NPROC_PER_NODE": str(self.gpus_per_node)} if self.gpus_per_node else {}

    def preflight_args(self) -> list[str]:
        """pytorch-cuda-preflight's options: what this job asked of each node."""
        return ["--gpus-per-node", str(self.gpus_per_node), "--shm-size", quantity(self.shm_mib), *(["--rdma"] if self.rdma else [])]

    def entry(self) -> list[str]:
        """A pod's command: the launch contract, after the preflight where --preflight asks for it
        (the preflight execs it once every node has passed)."""
        launch = [LAUNCH, *self.script]
        return [PREFLIGHT, *self.preflight_args(), "--", *launch] if self.preflight else launch

    def header(self) -> list[str]:
        """The GENERATED lines both renderers open with (as comments)."""
        return [f"GENERATED by `python3 build.py {shlex.join(self.argv)}`" if self.argv else "GENERATED by `python3 build.py job`",
                "Change the command line and render again rather than editing this file.",
                f"Image: {self.row_name}, pinned by digest: {self.ref}"]

    def suffix(self) -> str:
        return ".sbatch" if self.scheduler == "slurm" else ".yaml"

    def target(self, output: Path | None) -> Path | None:
        """Where the text goes: None for stdout, OUTPUT/<name><suffix> for a directory."""
        if output is None:
            return None
        return output / f"{self.name}{self.suffix()}" if output.is_dir() else output


def job(o: JobOptions, row: str, image: ImageRef) -> Job:
    """The Job that validated options describe; its argv is their canonical form, for the header."""
    assert o.torch is not None and o.scheduler is not None and o.nodes is not None  # required: the parser refused a run without
    settled = dataclasses.replace(o, runtime=(o.runtime or "oci") if o.scheduler == "slurm" else None,
                                  mount=tuple(str(m) for m in parse_all(list(o.mount))))
    # The header's command: every option that differs from its default, in the spec's order, with
    # what validation settled (the Slurm runtime, each mount's canonical form); never --matrix or --output.
    argv = spec.argv(dataclasses.replace(settled, matrix=None, output=None))
    return spec.extend(Job, settled, name=o.name or default_name(o.torch), runtime=settled.runtime or "", row_name=row, ref=image,
                       argv=tuple(argv))
