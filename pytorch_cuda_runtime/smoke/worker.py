"""Entry point of every family's process: `python -m pytorch_cuda_runtime.smoke.worker FAMILY`.

Launched by torchrun or the deepspeed launcher (both set RANK/WORLD_SIZE/LOCAL_RANK),
or directly for the one-process families (rank 0 of 1).
The orchestrator passes the rest through PCR_* environment variables. The same code
runs on GPUs (NCCL) and on CPU ranks (gloo): only the device differs.
"""
import argparse
import datetime
import faulthandler
import os
import sys
import traceback
import warnings

from .results import Recorder

# torch >= 2.13 warns on every all_gather_into_tensor (also used inside FSDP2/DeepSpeed).
warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")


class Ctx:
    """What a family needs to know about its rank and run."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device_type = os.environ.get("PCR_DEVICE", "cpu")
        self.timeout = datetime.timedelta(seconds=float(os.environ.get("PCR_TIMEOUT", "300")))
        self.work = os.environ.get("PCR_WORK", "/tmp")
        self.expect_world = int(os.environ.get("PCR_EXPECT_WORLD", self.world))
        self.family = ""
        self.rec = Recorder(os.environ.get("PCR_RESULTS_DIR"), os.environ.get("PCR_RUN", ""),
                            self.rank)

    @property
    def backend(self):
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def device(self):
        import torch
        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def init_torch_dist(self):
        """Init with a timeout so a missing peer fails instead of hanging."""
        import torch.distributed as dist
        if not dist.is_initialized():
            kw = {"device_id": self.device} if self.device_type == "cuda" else {}
            try:
                dist.init_process_group(self.backend, timeout=self.timeout, **kw)
            except TypeError:  # device_id is newer than some torch rows
                dist.init_process_group(self.backend, timeout=self.timeout)
        self.check_world(dist.get_world_size())

    def check_world(self, world):
        self.rec.check(f"{self.family}.world_size", world == self.expect_world, self.expect_world, world)


def _family(name):
    from . import bf16, collectives, ddp, fsdp2, measure, torch_compile, zero
    if name in zero.VARIANTS:
        return lambda ctx: zero.run(ctx, name)
    return {"collectives": collectives.run, "ddp": ddp.run, "fsdp2": fsdp2.run,
            "bf16": bf16.run, "compile": torch_compile.run, "measure": measure.run}[name]


def main(argv=None):
    # parse_known_args: the deepspeed launcher appends --local_rank=N.
    p = argparse.ArgumentParser()
    p.add_argument("family")
    args, _ = p.parse_known_args(argv)
    ctx = Ctx()
    ctx.family = args.family
    if os.environ.get("PCR_NODE"):  # multi-node runs: which machine (container) this rank ran on
        ctx.rec.info(f"{args.family}.node", os.environ["PCR_NODE"])
    # A hang is killed by the orchestrator; dump every thread's stack first, for the log.
    faulthandler.dump_traceback_later(max(ctx.timeout.total_seconds() - 5, 1), exit=False)
    try:
        _family(args.family)(ctx)
    except Exception as e:
        ctx.rec.add(f"{args.family}.error", "FAIL", actual=f"{type(e).__name__}: {e}",
                    detail=traceback.format_exc(limit=3).splitlines()[-3].strip())
        traceback.print_exc()
        return 1
    _wait_for_peers()
    return 0 if all(r["status"] != "FAIL" for r in ctx.rec.records) else 1


def _wait_for_peers():
    """Every rank reaches here before any exits, so none closes a connection a peer still uses."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    # Leave without tearing the process group down. With torch 2.7's gloo neither way down
    # is safe on a loaded host: at interpreter shutdown a worker thread is destroyed still
    # joinable and the rank dies of SIGABRT ("terminate called without an active
    # exception", ~1 run in 40), and destroy_process_group() hung in ~1 run in 10. The
    # records are on disk already (written after every check), so nothing is lost.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
