"""Training across two nodes, for real: two containers of the built default row act as two
machines, and a job spans both, the way the README's multi-node recipe runs it on a cluster.

- `deepspeed --hostfile` launches through pdsh over ssh (each node in `sshd` mode):
  ZeRO-3, one rank per node, on the CPU (gloo);
- `torchrun --nnodes 2` with c10d rendezvous: FSDP2.

Both run the smoke suite's own workers, so the bar is the smoke suite's: the loss falls, each
rank holds its share, and the consolidated checkpoint equals the gathered weights exactly.
Everything stays on loopback: host networking, one sshd port per node, host aliases node1 and
node2 mapped to 127.0.0.1 (`--add-host`, ssh config), GLOO_SOCKET_IFNAME=lo. /workspace is one
host directory mounted in both, as a shared filesystem is on a cluster.
"""
from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest

from helpers import default_image, free_port, logs, owned_by_image_user, serving, shown, ssh_keypair, wait_until, write_as_image_user

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.both_cores]

NODES = ("node1", "node2")
# What every rank needs on every node: the CPU accelerator, gloo on loopback, and the smoke
# worker's settings. deepspeed's pdsh runner exports .deepspeed_env's lines on each node.
RANK_ENV = {"DS_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PCR_DEVICE": "cpu",
            "PCR_EXPECT_WORLD": "2", "PCR_TIMEOUT": "300"}


@pytest.fixture(scope="module")
def cluster(docker_client, default_build, tmp_path_factory):
    """Two nodes in sshd mode, sharing /workspace and the user's ~/.ssh (key, config, known_hosts)."""
    image = default_image()
    root = tmp_path_factory.mktemp("cluster")
    ssh_dir = root / "ssh"
    _, pub = ssh_keypair(ssh_dir)
    ports = {n: free_port() for n in NODES}
    (ssh_dir / "config").write_text("".join(f"Host {n}\n    Port {p}\n" for n, p in ports.items()) + (
        "Host *\n    IdentityFile ~/.ssh/id_ed25519\n    StrictHostKeyChecking accept-new\n"
        "    UserKnownHostsFile ~/.ssh/known_hosts\n    BatchMode yes\n"))
    (ssh_dir / "known_hosts").touch()
    for f in ssh_dir.iterdir():
        f.chmod(0o600)
    owned_by_image_user(ssh_dir)  # last: after it, only root (or sudo) may change these files
    ws = owned_by_image_user(root / "workspace")
    hosts = [a for n in NODES for a in ("--add-host", f"{n}:127.0.0.1")]
    with serving(image, ["sshd"], (*hosts, "-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={ports['node1']}",
                                   "-e", "SSH_LISTEN=127.0.0.1", "-e", "PCR_NODE=node1", "--shm-size", "1g",
                                   "-v", f"{ssh_dir}:/home/trainer/.ssh", "-v", f"{ws}:/workspace")) as one, \
         serving(image, ["sshd"], (*hosts, "-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={ports['node2']}",
                                   "-e", "SSH_LISTEN=127.0.0.1", "-e", "PCR_NODE=node2", "--shm-size", "1g",
                                   "-v", f"{ssh_dir}:/home/trainer/.ssh", "-v", f"{ws}:/workspace")) as two:
        for cid, n in ((one, "node1"), (two, "node2")):
            wait_until(f"sshd on {n}", lambda: f"Server listening on 127.0.0.1 port {ports[n]}" in logs(cid), cid)
        yield {"node1": one, "node2": two, "workspace": ws}


def exec_in(cid: str, cmd: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    opts = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
    return subprocess.run(["docker", "exec", "-w", "/workspace", *opts, cid, *cmd], capture_output=True, text=True,
                          timeout=timeout)


def rank_records(results: Path) -> list[dict]:
    recs = []
    for f in sorted(results.glob("rank*.json")):
        recs += json.loads(f.read_text())
    return recs


def assert_trained_across_both_nodes(results: Path, family: str, consolidated: str) -> None:
    recs = rank_records(results)
    failed = [r for r in recs if r["status"] == "FAIL"]
    assert recs and not failed, json.dumps(failed or recs, indent=1)[-4000:]
    assert {r["rank"] for r in recs} == {0, 1}
    # One rank on each node: each rank says where it ran (the node's container environment).
    nodes = {r["rank"]: r["actual"] for r in recs if r["check"] == f"{family}.node"}
    assert sorted(nodes.values()) == ["node1", "node2"], nodes
    passed = {(r["check"], r["rank"]) for r in recs if r["status"] == "PASS"}
    for rank in (0, 1):
        assert (f"{family}.world_size", rank) in passed and (f"{family}.loss_falls", rank) in passed
    assert (f"{consolidated}.exact", 0) in passed, "rank 0 consolidated the checkpoint and compared it"


def test_deepspeed_hostfile_zero3_over_pdsh_and_ssh(cluster):
    ws = cluster["workspace"]
    write_as_image_user(ws / "hostfile", "node1 slots=1\nnode2 slots=1\n")
    env = {**RANK_ENV, "PCR_RUN": "zero3 2 nodes", "PCR_RESULTS_DIR": "/workspace/zero3/results",
           "PCR_WORK": "/workspace/zero3"}
    write_as_image_user(ws / ".deepspeed_env", "".join(f"{k}={v}\n" for k, v in env.items()))
    proc = exec_in(cluster["node1"], ["deepspeed", "--hostfile", "/workspace/hostfile", "--launcher", "pdsh",
                                      "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                                      "--module", "pytorch_cuda_runtime.smoke.worker", "zero3"], env)
    assert proc.returncode == 0, shown(proc)
    assert "node1: " in proc.stdout + proc.stderr and "node2: " in proc.stdout + proc.stderr, shown(proc)  # pdsh's prefixes
    assert_trained_across_both_nodes(ws / "zero3" / "results", "zero3", "zero3.consolidated")


def test_torchrun_two_nodes_c10d_rendezvous_fsdp2(cluster):
    ws = cluster["workspace"]
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**RANK_ENV, "PCR_RUN": "fsdp2 2 nodes", "PCR_RESULTS_DIR": "/workspace/fsdp2/results", "PCR_WORK": "/workspace/fsdp2"}
    procs: dict[str, subprocess.CompletedProcess] = {}

    def node(name: str, host: bool) -> None:
        # node1 hosts the rendezvous store; on a cluster its address would be the endpoint.
        procs[name] = exec_in(cluster[name], [
            "torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "fsdp2-two-nodes", "--rdzv-conf", f"is_host={str(host).lower()}",
            "--local-addr", "127.0.0.1", "-m", "pytorch_cuda_runtime.smoke.worker", "fsdp2"], {**env, "PCR_NODE": name})

    threads = [threading.Thread(target=node, args=(n, n == "node1")) for n in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in NODES:
        assert procs[name].returncode == 0, f"{name}: {shown(procs[name])}"
    assert_trained_across_both_nodes(ws / "fsdp2" / "results", "fsdp2", "fsdp2.consolidated")
