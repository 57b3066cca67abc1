"""The image's launch contract: `pytorch-cuda-launch [--print] [-m] SCRIPT [ARGS...]`.

One command starts training the same way under every scheduler: it reads the scheduler's
environment, decides the node count, this node's place and the rendezvous, and execs
torchrun (`python -m torch.distributed.run`, so signals reach it) with no ssh. DeepSpeed
scripts run the same way (torchrun plus deepspeed.initialize): ZeRO needs no sshd.

Sources, tried in this order; the first that applies decides (sources.py):

  explicit     PYTORCH_CUDA_NODE_RANK is set: PYTORCH_CUDA_NNODES, PYTORCH_CUDA_NODE_RANK,
               PYTORCH_CUDA_MASTER_ADDR, PYTORCH_CUDA_MASTER_PORT (29500). Static rendezvous.
  kubeflow     PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE
               (PyTorchJob of training-operator v1.8/v1.9, TrainJob of Trainer v2.0/v2.1).
               Static rendezvous, as the operators intend.
  slurm        SLURM_JOB_NODELIST (SLURM_STEP_NODELIST in a step), SLURM_NNODES, SLURM_JOB_ID;
               SLURM_NODEID, SLURM_GPUS_ON_NODE where present. c10d rendezvous on the list's
               first host, port MASTER_PORT or 29500, id SLURM_JOB_ID; no node rank, so it works
               inside `srun --container`, where the per-task variables are absent.
  indexed-job  JOB_COMPLETION_INDEX (JobSet, Indexed Job): the node rank; the manifest sets
               PYTORCH_CUDA_NNODES and PYTORCH_CUDA_MASTER_ADDR (pod 0 behind the headless
               Service). Static rendezvous.
  single-node  nothing of the above: torchrun --standalone.

Ranks per node (nproc.py): PYTORCH_CUDA_NPROC_PER_NODE, else the scheduler's own count
(PET_NPROC_PER_NODE, SLURM_GPUS_ON_NODE), else one per local GPU, else one CPU rank.

The working directory: PYTORCH_CUDA_WORKDIR where set (an absolute directory; `build.py job`'s
sbatch script sets it to the submit directory), else the one the launcher started in. A relative
SCRIPT and relative paths in ARGS are taken from it; the ARGS are never rewritten.

The environment torchrun gets (environment.py): the image's PATH first (srun replaces it), a
writable HOME and writable caches, and none of the scheduler's RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT or PET_* (torchrun sets the ranks' own; PyTorchJob's RANK is a node index while its
WORLD_SIZE counts processes).

A missing or inconsistent variable is one line on stderr, `pytorch-cuda: error: ...`, and
exit 2, before any rank starts. Standard library only: it runs before torch is imported.
"""
from ..errors import PytorchCudaError


class LaunchError(PytorchCudaError):
    """The environment or the arguments cannot give a launch; the message is one line."""
