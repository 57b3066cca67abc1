"""Where a node learns its place: one reader per scheduler, tried in a fixed order.

What each scheduler sets, read from its own source:

- Kubeflow training-operator v1.8.1 / v1.9.2, PyTorchJob (pkg/controller.v1/pytorch/envvar.go,
  master.go, elastic.go): with a Master replica, MASTER_ADDR = PET_MASTER_ADDR =
  `<job>-master-0`, MASTER_PORT = PET_MASTER_PORT = the master's `pytorchjob-port`,
  PET_NODE_RANK = RANK = 0 on the master and index+1 on worker `index`, WORLD_SIZE =
  replicas x nprocPerNode (1 where nprocPerNode is not a number), PET_NNODES = replicas,
  PET_NPROC_PER_NODE = spec.nprocPerNode (defaults to "auto"; also "cpu", "gpu" or a number).
  With an elasticPolicy PET_NNODES is a range `min:max` and PET_RDZV_* are set instead.
- Kubeflow Trainer v2.0.0 / v2.1.0, TrainJob (pkg/runtime/framework/plugins/torch/torch.go,
  pkg/constants/constants.go): only PET_NNODES, PET_NPROC_PER_NODE ("auto", "cpu", "gpu" or a
  number), PET_NODE_RANK (the pod's Job completion index), PET_MASTER_ADDR =
  `<trainjob>-node-0-0.<trainjob>`, PET_MASTER_PORT = 29500.
- JobSet v0.12.0 (pkg/controllers/jobset_controller.go) sets no variables: pod 0 of job 0 is
  `<jobset>-<replicatedjob>-0-0.<subdomain>` (the subdomain defaults to the JobSet's name), and
  Kubernetes sets JOB_COMPLETION_INDEX, which counts within one Job. So JobSet and plain
  Indexed Jobs (`<job>-0.<service>`) use this contract's own PYTORCH_CUDA_NNODES and
  PYTORCH_CUDA_MASTER_ADDR, set by the manifest, with one Job of N pods.
- Slurm 22.05 inside `srun --container`: SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_STEP_NODELIST,
  SLURM_NNODES, SLURM_STEP_NUM_NODES and SLURM_NTASKS are present; SLURM_NODEID, SLURM_PROCID,
  SLURM_LOCALID and SLURMD_NODENAME are not (measured here, ../shared/ENVIRONMENT.md).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import LaunchError
from ..hostlist import HostlistError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """The job's shape as one node sees it.

    node_rank None: the c10d rendezvous at master_addr:master_port assigns it (rdzv_id set).
    master_addr None: a single node, torchrun --standalone.
    """
    source: str
    nnodes: int
    node_rank: int | None
    master_addr: str | None
    master_port: int
    rdzv_id: str | None = None
    nproc: str | None = None
    nproc_from: str | None = None
    read: tuple[str, ...] = ()


def _get(env: Mapping[str, str], name: str) -> str | None:
    """A variable's value, None where it is unset or blank."""
    value = env.get(name)
    return value.strip() if value is not None and value.strip() else None


def _whole(env: Mapping[str, str], name: str, minimum: int, default: int | None = None) -> int:
    raw = _get(env, name)
    if raw is None:
        if default is not None:
            return default
        raise LaunchError(f"{name} is not set")
    if not re.fullmatch(r"\d+", raw) or int(raw) < minimum:
        what = "a positive whole number" if minimum > 0 else "a whole number"
        raise LaunchError(f"{name}={raw!r} is not {what}")
    return int(raw)


def _port(env: Mapping[str, str], name: str) -> int:
    port = _whole(env, name, 1, DEFAULT_PORT)
    if port > 65535:
        raise LaunchError(f"{name}={port} is not a port (1-65535)")
    return port


def _static(source: str, env: Mapping[str, str], nnodes_var: str, rank_var: str, addr_var: str,
            port_var: str, nproc_var: str | None = None) -> Topology:
    """A static rendezvous: the node count, this node's rank and a master, all given."""
    nnodes = _whole(env, nnodes_var, 1)
    rank = _whole(env, rank_var, 0, 0 if nnodes == 1 else None)
    if rank >= nnodes:
        raise LaunchError(f"{rank_var}={rank} is not below {nnodes_var}={nnodes}")
    addr = _get(env, addr_var)
    if addr is None and nnodes > 1:
        raise LaunchError(f"{addr_var} is not set: {nnodes} nodes need a master address")
    if addr is not None and re.search(r"\s", addr):
        raise LaunchError(f"{addr_var}={addr!r} is not a host name")
    port = _port(env, port_var)
    nproc = _get(env, nproc_var) if nproc_var else None
    names = [nnodes_var, rank_var, addr_var, port_var] + ([nproc_var] if nproc_var else [])
    return Topology(source, nnodes, rank, addr, port, None, nproc, nproc_var if nproc else None,
                    tuple(f"{n}={env[n]}" for n in names if n in env))


def explicit(env: Mapping[str, str]) -> Topology:
    return _static("explicit", env, "PYTORCH_CUDA_NNODES", "PYTORCH_CUDA_NODE_RANK",
                   "PYTORCH_CUDA_MASTER_ADDR", "PYTORCH_CUDA_MASTER_PORT")


def kubeflow(env: Mapping[str, str]) -> Topology:
    nnodes = _get(env, "PET_NNODES")
    if nnodes is not None and ":" in nnodes:
        raise LaunchError(f"PET_NNODES={nnodes!r} is an elastic range (a PyTorchJob elasticPolicy): "
                          "pytorch-cuda-launch runs a fixed number of nodes")
    return _static("kubeflow", env, "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
                   "PET_MASTER_PORT", "PET_NPROC_PER_NODE")


def indexed_job(env: Mapping[str, str]) -> Topology:
    if _get(env, "PYTORCH_CUDA_NNODES") is None:
        raise LaunchError("JOB_COMPLETION_INDEX is set (a JobSet or Indexed Job) but PYTORCH_CUDA_NNODES "
                          "is not: the manifest sets it, and PYTORCH_CUDA_MASTER_ADDR")
    return _static("indexed-job", env, "PYTORCH_CUDA_NNODES", "JOB_COMPLETION_INDEX",
                   "PYTORCH_CUDA_MASTER_ADDR", "PYTORCH_CUDA_MASTER_PORT")


def slurm(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> Topology:
    """One task per node; a step's own list where srun gives one (a step may use fewer nodes)."""
    list_var, count_var = (("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES") if _get(env, "SLURM_STEP_NODELIST")
                           else ("SLURM_JOB_NODELIST", "SLURM_NNODES"))
    if _get(env, count_var) is None:
        count_var = "SLURM_NNODES"
    hostlist = _get(env, list_var)
    if hostlist is None:
        raise LaunchError(f"{list_var} is not set")
    try:
        hosts = hostnames(hostlist)
    except HostlistError as e:
        raise LaunchError(f"{list_var}: {e}") from None
    nnodes = _whole(env, count_var, 1, len(hosts))
    if nnodes != len(hosts):
        raise LaunchError(f"{count_var}={nnodes} but {list_var}={hostlist} names {len(hosts)} hosts")
    job = _get(env, "SLURM_JOB_ID")
    if job is None:
        raise LaunchError("SLURM_JOB_ID is not set: it is the rendezvous id")
    tasks_var = "SLURM_STEP_NUM_TASKS" if _get(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if _get(env, tasks_var) is not None and _whole(env, tasks_var, 1) != nnodes:
        raise LaunchError(f"{tasks_var}={env[tasks_var].strip()} over {nnodes} nodes: pytorch-cuda-launch "
                          "wants one task per node (srun --ntasks-per-node=1); torchrun starts the ranks")
    if _get(env, "SLURM_NODEID") is not None and _whole(env, "SLURM_NODEID", 0) >= nnodes:
        raise LaunchError(f"SLURM_NODEID={env['SLURM_NODEID'].strip()} is not below {count_var}={nnodes}")
    nproc, nproc_from = None, None
    if _get(env, "SLURM_GPUS_ON_NODE") is not None:
        nproc, nproc_from = str(_whole(env, "SLURM_GPUS_ON_NODE", 0)), "SLURM_GPUS_ON_NODE"
    names = (list_var, count_var, "SLURM_JOB_ID", tasks_var, "SLURM_NODEID", "SLURM_GPUS_ON_NODE", "MASTER_PORT")
    return Topology("slurm", nnodes, None, hosts[0], _port(env, "MASTER_PORT"), job, nproc, nproc_from,
                    tuple(f"{n}={env[n]}" for n in names if n in env))


def detect(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> Topology:
    """The first source that applies, in the documented order."""
    if _get(env, "PYTORCH_CUDA_NODE_RANK") is not None:
        return explicit(env)
    if any(_get(env, n) is not None for n in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR")):
        return kubeflow(env)
    if _get(env, "SLURM_JOB_NODELIST") or _get(env, "SLURM_STEP_NODELIST") or _get(env, "SLURM_JOB_ID"):
        return slurm(env, hostnames)
    if _get(env, "JOB_COMPLETION_INDEX") is not None:
        return indexed_job(env)
    if _get(env, "PYTORCH_CUDA_NNODES") is not None and _whole(env, "PYTORCH_CUDA_NNODES", 1) > 1:
        raise LaunchError("PYTORCH_CUDA_NNODES is set but nothing gives this node's rank: set "
                          "PYTORCH_CUDA_NODE_RANK, or run as an Indexed Job (JOB_COMPLETION_INDEX)")
    return Topology("single-node", 1, 0, None, DEFAULT_PORT)
