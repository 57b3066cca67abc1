"""`pytorch-cuda-preflight`: before a job trains, every node proves its driver, GPUs, memory and
fabric, and a slow node is named.

Started like training, once per node (srun's task, a pod), with the same launch contract. Three
phases, each bounded; any failure is one line per problem on stdout and stderr,
`pytorch-cuda-preflight: FAILED: node NODE: what it found; what the row needs`, and exit 1:

  1. node     (node.py) this node's driver against the row's floor (the manifest's driver_min),
              the GPUs the driver shows against those the job requested, their compute
              capability against the archs torch and the prebuilt DeepSpeed ops are built for,
              /dev/shm against the job's size, the locked-memory limit where RDMA is used and the
              InfiniBand/RDMA devices where the job asked for them. nvidia-smi answers within 10 s.
              Where the job requested GPUs, each GPU's health through NVML (health.py) and a bf16
              matmul on each (compute.py), within --gpu-timeout (60 s) together (gpupart.py).
  2. roll call (rollcall.py) every node reports phase 1 to the first node (a TCPStore at the
              rendezvous host, port MASTER_PORT + 1), which waits at most --join-timeout for all of
              them. A node that did not answer is named by every node that did; a node that cannot
              reach the first names it. A node's failed check fails every node, with its lines.
              The first node judges the GPUs' compute figures across the job (slow, wrong).
  3. fabric   (fabric.py, under `pytorch-cuda-launch`, port MASTER_PORT + 2) one rank per GPU (or
              the job's CPU ranks on gloo): all_reduce and all_gather over a range of sizes, printed
              as nccl-tests prints them, then each pair of ring neighbours measured alone; a node
              whose best link is under --slow-ratio (0.5) x the median node's is named. Every
              collective has --timeout (300 s), and the whole phase --timeout + 60 s.

So a job's preflight ends within --join-timeout + --timeout + about a minute: 16 minutes at the
defaults (600 s and 300 s); the GPU part runs before the roll call, within it. The report (report.py) is printed and written as JSON (--report).
Only the stand-in GPUs of the tests (standin.py) replace what nvidia-smi says, and the fake NVML
(fakenvml.py) what NVML says; both say so.
"""


from ..errors import PytorchCudaError


class PreflightError(PytorchCudaError):
    """A usage or environment problem before any check runs: one line, exit 2."""
