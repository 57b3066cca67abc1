"""`build.py job`'s options, declared once (spec.py), and the Job they describe."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .. import spec
from ..spec import flag, many, opt
from . import ImageRef, Job, deadline_seconds, default_name, kubernetes, memory_mib, shm_mib, slurm
from .mounts import parse_all

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
                            metavar="REPO@sha256:...")
    name: str | None = opt(None, "job (and Kubernetes object) name, a DNS label of at most 40 characters (default: pytorch-cuda-<torch>)")
    shm_size: str = opt("16Gi", "/dev/shm for each node, e.g. 16Gi or 512Mi (default 16Gi)", metavar="SIZE")
    network: str = opt("auto", "auto (default): NCCL uses InfiniBand where present; socket: TCP only (NCCL_IB_DISABLE=1)",
                       choices=("auto", "socket"))
    socket_ifname: str | None = opt(None, "NCCL_SOCKET_IFNAME, e.g. eth0 or ^docker,lo (default: NCCL picks)", metavar="IFNAME")
    mount: tuple[str, ...] = many("the user's code or data at TARGET in every task; repeatable. SOURCE: Kubernetes pvc:CLAIM or an "
                                  "absolute host path (hostPath, type Directory); Slurm an absolute path on the shared filesystem",
                                  metavar="SOURCE:TARGET[:ro]")
    workdir: str | None = opt(None, "the tasks' working directory, where relative paths in SCRIPT and ARGS are taken from "
                                    "(default: Slurm the submit directory; Kubernetes the first --mount's TARGET, else the image's /workspace)",
                              metavar="DIR")
    output: Path | None = opt(None, "file to write, or a directory for <name>.sbatch / <name>.yaml (default: stdout)", type=Path,
                              metavar="FILE|DIR")
    runtime: str | None = opt(None, "slurm: oci (default; srun --container), pyxis (enroot) or apptainer", choices=slurm.RUNTIMES)
    bundle: str | None = opt(None, "slurm oci: the OCI bundle on a shared filesystem (default: $SLURM_SUBMIT_DIR/bundles/<image>-<digest>)",
                             metavar="DIR")
    sif: str | None = opt(None, "slurm apptainer: a .sif to run instead of docker://IMAGE", metavar="FILE")
    kind: str | None = opt(None, "kubernetes: trainjob, pytorchjob, jobset or indexed-job", choices=kubernetes.KINDS)
    rdma: tuple[str, ...] = many("kubernetes: an RDMA device resource per node, e.g. rdma/ib=1 (adds IPC_LOCK); repeatable",
                                 metavar="RESOURCE=COUNT")
    namespace: str | None = opt(None, "kubernetes: the namespace (default: none written, kubectl's current)")
    cluster_runtime: str | None = opt(None, "trainjob: use this installed ClusterTrainingRuntime (e.g. torch-distributed) instead of "
                                            "writing a TrainingRuntime", metavar="NAME")
    cpus_per_node: int | None = opt(None, "kubernetes: CPUs each pod requests (default: none)", type=spec.positive_int, metavar="N")
    memory_per_node: str | None = opt(None, "kubernetes: memory each pod requests, /dev/shm and working memory together, e.g. 64Gi; "
                                            "more than --shm-size (default: --shm-size's, /dev/shm alone)", metavar="SIZE")
    qos: str = opt("burstable", "kubernetes: burstable (default: requests, and limits only for GPUs and RDMA) or guaranteed "
                                "(cpu and memory limits equal to the requests; needs --cpus-per-node and --memory-per-node)",
                   choices=kubernetes.QOS, later=True)
    image_pull_secret: tuple[str, ...] = many("kubernetes: a Secret in the job's namespace that the pods pull the image with; repeatable",
                                              metavar="NAME")
    deadline: str | None = opt(None, "kubernetes: the job's activeDeadlineSeconds, e.g. 24h, 90m, 1h30m, 2d or seconds "
                                     "(default: none); not with --cluster-runtime", metavar="DURATION")
    preflight: bool = flag("run pytorch-cuda-preflight on every node first (driver, GPUs, /dev/shm, RDMA, the fabric measured, a "
                           "slow node named) and start training only if it passed; bounded (docs/clusters.md#preflight)")
    script: tuple[str, ...] = opt((), "after --: SCRIPT [ARGS...], run by pytorch-cuda-launch in the image", kind="many", metavar="SCRIPT")


def job(o: JobOptions, row: str, image: ImageRef) -> Job:
    """The Job that validated options describe; its argv is their canonical form, for the header."""
    assert o.torch is not None and o.scheduler is not None and o.nodes is not None  # required: the parser refused a run without
    slurm_job = o.scheduler == "slurm"
    mounts = parse_all(list(o.mount))
    # The header's command: every option that differs from its default, in the spec's order, with
    # what validation settled (the Slurm runtime, each mount's canonical form); never --output.
    argv = spec.argv(dataclasses.replace(o, matrix=None, output=None, runtime=(o.runtime or "oci") if slurm_job else None,
                                         mount=tuple(str(m) for m in mounts)))
    return Job(scheduler=o.scheduler, name=o.name or default_name(o.torch), row=row, image=image, nodes=o.nodes,
               gpus_per_node=o.gpus_per_node, command=tuple(o.script), shm_mib=shm_mib(o.shm_size), network=o.network,
               socket_ifname=o.socket_ifname, argv=tuple(argv), runtime=(o.runtime or "oci") if slurm_job else "",
               bundle=o.bundle, sif=o.sif, kind=o.kind, rdma=tuple((r.split("=")[0], int(r.split("=")[1])) for r in o.rdma),
               namespace=o.namespace, cluster_runtime=o.cluster_runtime, mounts=mounts, workdir=o.workdir,
               cpus=o.cpus_per_node, memory_mib=memory_mib(o.memory_per_node) if o.memory_per_node else None,
               qos=o.qos, pull_secrets=tuple(o.image_pull_secret),
               deadline_s=deadline_seconds(o.deadline) if o.deadline else None, preflight=o.preflight)
