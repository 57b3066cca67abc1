"""The replayed Kubernetes job's SCRIPT: ZeRO-3 (deepspeed.initialize under torchrun, no ssh)
and then FSDP2 in one launch, with the smoke suite's own checks: the loss falls, each rank holds
its share, and rank 0's consolidated checkpoint equals the gathered weights exactly.

    pytorch-cuda-launch /job/train.py zero3 [fsdp2]

Each family's per-rank records go to <this dir>/results/<family>/rank<N>.json. CPU ranks on gloo,
kept on loopback (GLOO_SOCKET_IFNAME=lo): a cluster's script would leave the interface to gloo.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.update(PCR_DEVICE="cpu", PCR_TIMEOUT="240", PCR_EXPECT_WORLD=os.environ["WORLD_SIZE"],
                  PCR_NODE=f"node {os.environ['GROUP_RANK']}")  # torchrun: this pod's node rank

from pytorch_cuda_runtime.smoke import worker  # noqa: E402  (after the environment it reads)

code = 0
for family in sys.argv[1:]:
    os.environ["PCR_RUN"] = family
    os.environ["PCR_RESULTS_DIR"] = os.environ["PCR_WORK"] = os.path.join(HERE, "results", family)
    code = code or worker.main([family])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # as the smoke worker leaves: torch 2.7's gloo is not safe to tear down (worker.py)
