"""The Slurm path, for real: the sbatch script `build.py job` writes, submitted to a two-node
Slurm 22.05 cluster on this machine (tests/slurm.py), runs the default row's image through
Slurm's own OCI support (`srun --container` with runc) on both nodes.

The bundle is made as the script's header says: `skopeo copy` of the built image into an OCI
layout, `umoci unpack`, then `python3 -m pytorch_cuda_build.jobs.bundle`. The image is local
and unpublished, so the script is rendered for `pytorch-cuda@<its image ID>` (for the oci runtime
the reference is only named in the header) with `--bundle` pointing at that bundle.

The job is tests/data/k8s_replay/train.py, in the submit directory, named as the relative
`train.py`: the script exports PYTORCH_CUDA_WORKDIR (the submit directory), and the launch
contract changes to it inside the bundle, whose own cwd is the image's. ZeRO-3 through torchrun and
deepspeed.initialize, then FSDP2, one CPU rank per node on gloo over the nodes' own network (no
ssh, no per-task Slurm variables inside the container: the launch contract's c10d rendezvous on
the first node assigns the ranks). The smoke suite's checks decide: the loss falls, each rank
holds its share, rank 0's consolidated checkpoint equals the gathered weights exactly.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, owned_by_image_user, require, run_cli, shown
from slurm import SlurmCluster, missing_tools

pytestmark = [pytest.mark.docker, pytest.mark.slow]

IMAGE = "pytorch-cuda:v2.7"
SCRIPT = Path(__file__).resolve().parent.parent / "data" / "k8s_replay" / "train.py"
FAMILIES = ("zero3", "fsdp2")
CONSOLIDATED = {"zero3": "zero3.consolidated", "fsdp2": "fsdp2.consolidated"}
JOB_TIMEOUT = 600  # both families on 2 nodes x 1 CPU rank take about a minute here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require(os.geteuid() == 0, "a Slurm cluster of network namespaces needs root")
    gone = missing_tools()
    require(not gone, f"{', '.join(gone)} missing: engine.sh --with-registry (build.py selftest) installs them")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def submit(tmp_path_factory) -> Path:
    """The submit directory, shared by both nodes (one host here) and bound into the bundle."""
    d = tmp_path_factory.mktemp("submit")
    shutil.copy(SCRIPT, d / "train.py")
    return owned_by_image_user(d)


def _timed(cmd: list[str], timeout: int) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, shown(proc)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def bundle(default_oci_layout, submit, tmp_path_factory) -> Path:
    """The default row's image as an OCI bundle, made the way the script's header says (the
    skopeo copy is the session's, shared with the Podman test)."""
    layout, tag = default_oci_layout
    out = tmp_path_factory.mktemp("bundle") / "bundle"
    t0 = time.monotonic()
    proc = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tag}", str(out)], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, shown(proc)
    print(f"bundle: umoci unpack {time.monotonic() - t0:.0f} s")
    proc = subprocess.run([sys.executable, "-m", "pytorch_cuda_build.jobs.bundle", str(out), "--shm-size", "1Gi",
                           "--bind", str(submit)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, shown(proc)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def image_reference() -> str:
    proc = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", IMAGE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, shown(proc)
    return f"pytorch-cuda@{proc.stdout.strip()}"


def test_both_nodes_run_in_the_bundle_with_their_own_hostnames(cluster, bundle):
    """The bundle as jobs.bundle patched it: no network or uts namespace of its own, so each
    container sees its node's name and address; the image's user."""
    proc = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", f"--container={bundle}", "sh", "-c",
                           "echo $(cat /proc/sys/kernel/hostname) $(id -u) $(cat /sys/class/net/eth0/address)"],
                          capture_output=True, text=True, env=cluster.env(), timeout=300)
    assert proc.returncode == 0, shown(proc) + cluster.logs()
    lines = sorted(proc.stdout.split("\n")[:-1])
    assert [ln.split()[:2] for ln in lines] == [[n, "1000"] for n in cluster.names], proc.stdout
    assert len({ln.split()[2] for ln in lines}) == 2, "both containers on one network device"


def test_the_generated_sbatch_script_trains_zero3_then_fsdp2_on_two_nodes(cluster, bundle, submit):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--runtime", "oci", "--nodes", "2",
                   "--image", image_reference(), "--bundle", str(bundle), "--name", "slurmtest", "--output", str(submit),
                   "--", "train.py", *FAMILIES)
    assert proc.returncode == 0, shown(proc)
    script = submit / "slurmtest.sbatch"
    text = script.read_text()
    assert f'BUNDLE="{bundle}"' in text and 'export PYTORCH_CUDA_WORKDIR="${SLURM_SUBMIT_DIR}"' in text
    assert "pytorch-cuda-launch train.py zero3 fsdp2" in text  # as written: the working directory finds it
    # What a user's environment adds: CPU ranks on gloo over the nodes' own interface.
    job = cluster.sbatch(script, submit, {"DS_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": "eth0"})
    t0 = time.monotonic()
    state = cluster.wait(job, JOB_TIMEOUT)
    out = submit / f"slurmtest-{job}.out"
    log = out.read_text(errors="replace")[-6000:] if out.exists() else "(no output file)"
    print(f"job {job}: {state} after {time.monotonic() - t0:.0f} s")
    assert state == "COMPLETED", f"{state}\n{log}\n{cluster.logs()}"
    for family in FAMILIES:
        recs = [r for f in sorted((submit / "results" / family).glob("rank*.json")) for r in json.loads(f.read_text())]
        failed = [r for r in recs if r["status"] == "FAIL"]
        assert recs and not failed, json.dumps(failed or recs, indent=1)[-4000:]
        assert {r["rank"] for r in recs} == {0, 1}
        # torchrun's GROUP_RANK: the rendezvous gave each node its own rank, one CPU rank each
        nodes = {r["rank"]: r["actual"] for r in recs if r["check"] == f"{family}.node"}
        assert nodes == {0: "node 0", 1: "node 1"}, nodes
        passed = {(r["check"], r["rank"]) for r in recs if r["status"] == "PASS"}
        for rank in (0, 1):
            for check in ("world_size", "loss_falls", "param_share"):
                assert (f"{family}.{check}", rank) in passed, (family, check, rank, log)
        assert (f"{CONSOLIDATED[family]}.exact", 0) in passed, "rank 0 consolidated the checkpoint and compared it"


def test_a_job_without_the_bundle_fails_in_one_slurm_line(cluster, submit, tmp_path):
    """The script names a bundle that is not there: srun cannot launch a task, and the job fails."""
    absent = tmp_path / "no-bundle"
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--runtime", "oci", "--nodes", "2",
                   "--image", image_reference(), "--bundle", str(absent), "--name", "nobundle", "--output", str(submit),
                   "--", "train.py", "zero3")
    assert proc.returncode == 0, shown(proc)
    job = cluster.sbatch(submit / "nobundle.sbatch", submit, {"DS_ACCELERATOR": "cpu"})
    assert cluster.wait(job, 120) == "FAILED"
    out = (submit / f"nobundle-{job}.out").read_text()
    assert "Task launch" in out and "No such file or directory" in out, out  # srun's words for the absent bundle


# Rank 1 leaves after the rendezvous; rank 0 would wait in its sleep for the job's whole time limit.
FAILS_AFTER_RENDEZVOUS = """import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print(f"JOINED {dist.get_rank()}", flush=True)
if dist.get_rank() == 1:
    sys.exit(1)
time.sleep(600)
"""
# The bound the docs state (clusters.md, "When a rank fails"): the failing node's torchrun exits at
# once (no restarts), and srun --kill-on-bad-exit then ends the other node's task.
FAILED_JOB_BOUND_S = 120


def test_a_rank_that_fails_after_the_rendezvous_ends_the_whole_job_within_the_bound(cluster, bundle, submit):
    (submit / "fail_rank1.py").write_text(FAILS_AFTER_RENDEZVOUS)
    owned_by_image_user(submit)
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--runtime", "oci", "--nodes", "2",
                   "--image", image_reference(), "--bundle", str(bundle), "--name", "failrank", "--output", str(submit),
                   "--", "fail_rank1.py")
    assert proc.returncode == 0, shown(proc)
    t0 = time.monotonic()
    job = cluster.sbatch(submit / "failrank.sbatch", submit, {"GLOO_SOCKET_IFNAME": "eth0"})
    state = cluster.wait(job, 300)
    took = time.monotonic() - t0
    out = (submit / f"failrank-{job}.out").read_text(errors="replace")
    print(f"job {job}: {state} after {took:.0f} s (submission to end)")
    assert state == "FAILED", f"{state}\n{out[-4000:]}\n{cluster.logs()}"
    assert took < FAILED_JOB_BOUND_S, f"the job took {took:.0f} s to end\n{out[-4000:]}"
    # Each line names its node's task (srun --label) and its rank (the launch contract's labels).
    joined = sorted(ln.strip() for ln in out.splitlines() if "JOINED" in ln)
    assert len(joined) == 2 and {ln.split(":", 1)[0] for ln in joined} == {"0", "1"}, out[-4000:]
    assert any("[rank0]: JOINED 0" in ln for ln in joined) and any("[rank1]: JOINED 1" in ln for ln in joined), out[-4000:]
