"""A Job as its scheduler's text: the sbatch script (slurm.py) or the manifests (kubernetes.py)."""
from __future__ import annotations

from . import kubernetes, slurm
from .options import Job


def render(job: Job) -> str:
    return slurm.render(job) if job.scheduler == "slurm" else kubernetes.render(job)
