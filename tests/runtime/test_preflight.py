"""pytorch-cuda-preflight's logic without torch, a GPU or a cluster: each node check against the
row's manifest and the job's needs, nccl-tests' bandwidths and table, the slow-node judgement, the
roll call's verdict and its bound (with an in-memory store standing in for torch's TCPStore), the
stand-in GPU hook, and bad arguments (one line, exit 2). The torch half runs in the image: the
structure tests (pytorch_cuda_build/checks/test_image.py) and the Slurm and replay tests."""
from __future__ import annotations

import json
import resource
import socket
import threading
import time

import pytest

from pytorch_cuda_runtime.launch.sources import Topology
from pytorch_cuda_runtime.preflight import PreflightError, cli, node, report, rollcall, standin

MANIFEST = {"cuda_platform": "12.1", "torch_cuda": "12.6", "driver_min": "525.60.13",
            "cuda_arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
            "ops_accelerator": "cuda", "prebuilt_ops": ["fused_adam"], "ops_arch_list": "8.0;9.0"}
H100 = ("NVIDIA H100 80GB HBM3", "550.54.15", "9.0")
GIB = 1 << 30


def facts(gpus=(H100, H100), **kw):
    base = dict(node="n1", gpus=list(gpus) if gpus is not None else None, gpu_source="nvidia-smi", device_nodes=["nvidia0", "nvidia1"],
                cuda_visible=None, shm_bytes=16 * GIB, memlock=resource.RLIM_INFINITY, ipc_lock=False, ib_names=[],
                ib_passed=False, ib_disabled=False)
    return node.Facts(**{**base, **kw})


def needs(**kw):
    return node.Needs(**{"gpus_per_node": 2, "shm_bytes": 16 * GIB, "rdma": False, "manifest": MANIFEST, **kw})


def test_a_node_that_has_what_the_job_and_the_row_need_passes():
    assert node.check(facts(), needs()) == []
    assert node.check(facts(gpus=None, device_nodes=[]), needs(gpus_per_node=0)) == []  # CPU ranks: no GPU asked


def test_a_driver_below_the_row_s_floor_names_it_the_floor_and_forward_compatibility():
    (line,) = node.check(facts(gpus=[("NVIDIA H100", "470.57.02", "9.0")] * 2), needs())
    assert line.startswith("driver 470.57.02 (nvidia-smi) is older than 525.60.13, the floor of this image's CUDA 12.1 platform")
    assert "(error 35, cudaErrorInsufficientDriver)" in line and "803" not in line and "804" not in line  # a driver too old
    assert "CUDA forward compatibility" in line and "cuda-compat" in line and "12.6" in line


def test_fewer_gpus_than_requested_or_none_answering_is_one_line():
    (line,) = node.check(facts(gpus=[H100]), needs())
    assert line == "1 GPU visible (nvidia-smi: 1 listed), the job requested 2 per node"
    (line,) = node.check(facts(cuda_visible="0"), needs())
    assert line == "1 GPU visible (nvidia-smi: 2 listed, CUDA_VISIBLE_DEVICES='0'), the job requested 2 per node"
    (line,) = node.check(facts(gpus=None), needs())
    assert line == ("no GPU driver answers (nvidia-smi absent or failing; /dev/nvidia0, /dev/nvidia1): "
                    "the job requested 2 GPUs per node")


def test_a_gpu_neither_torch_nor_the_ops_are_built_for_is_named_for_each():
    lines = node.check(facts(gpus=[("NVIDIA B200", "570.86.10", "10.0")] * 2), needs(gpus_per_node=2))
    assert len(lines) == 4 and all("sm_100 not in arch list" in ln for ln in lines)
    assert "torch in this image has no code for it" in lines[0] and "the prebuilt DeepSpeed ops" in lines[1]
    # sm_89 runs sm_86 code for torch; the ops' 8.0 cubin serves it too (same major)
    assert node.check(facts(gpus=[("NVIDIA L40S", "550.54.15", "8.9")] * 2), needs()) == []
    assert node.ops_archs("5.0;8.0;9.0+PTX") == ["sm_50", "sm_80", "sm_90", "compute_90"]


def test_a_small_dev_shm_is_named_with_the_size_the_job_needs():
    (line,) = node.check(facts(shm_bytes=64 << 20), needs())
    assert line.startswith("/dev/shm is 64 MiB, the job needs 16384 MiB")


def test_rdma_needs_its_devices_where_asked_and_an_unlimited_memlock_or_ipc_lock_where_used():
    (line,) = node.check(facts(), needs(rdma=True))
    assert line.startswith("the job asked for RDMA but no device in /sys/class/infiniband")
    lines = node.check(facts(ib_names=["mlx5_0"], ib_passed=False), needs(rdma=True))
    assert "mlx5_0 in /sys/class/infiniband but /dev/infiniband not passed in" in lines[0]
    (line,) = node.check(facts(ib_names=["mlx5_0"], ib_passed=True, memlock=64 << 10), needs())
    assert line.startswith("locked-memory limit 64 KiB (ulimit -l) and no CAP_IPC_LOCK, where RDMA is used")
    assert node.check(facts(ib_names=["mlx5_0"], ib_passed=True, memlock=64 << 10, ipc_lock=True), needs()) == []
    assert node.check(facts(ib_names=["mlx5_0"], ib_passed=True, memlock=64 << 10, ib_disabled=True), needs()) == []


def test_cap_ipc_lock_is_read_from_the_effective_set(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t0000000000004000\n")
    assert node.has_ipc_lock(str(status))
    status.write_text("CapEff:\t00000000a80425fb\n")  # Docker's default set: no IPC_LOCK
    assert not node.has_ipc_lock(str(status))


def test_stand_in_gpus_come_from_the_hook_s_file_per_host_and_say_so(tmp_path):
    table = tmp_path / "standin.json"
    table.write_text(json.dumps({"n2": [{"name": "stand-in", "driver": "470.57.02", "capability": "9.0"}],
                                 "*": [{"name": "stand-in", "driver": "550.54.15", "capability": "9.0"}] * 2}))
    env = {standin.VARIABLE: str(table)}
    assert standin.gpus(env, "n2") == [("stand-in", "470.57.02", "9.0")]
    assert len(standin.gpus(env, "n1")) == 2 and standin.gpus({}, "n1") is None
    f = node.gather(env, node="n2")
    assert f.gpus == [("stand-in", "470.57.02", "9.0")] and "stand-in GPUs (PYTORCH_CUDA_PREFLIGHT_STANDIN=standin.json)" in f.gpu_source
    (line,) = node.check(f, needs(gpus_per_node=1, shm_bytes=1))
    assert "driver 470.57.02 (stand-in GPUs" in line


# ---- the fabric's figures -------------------------------------------------------------------

def test_bus_bandwidth_follows_nccl_tests_formulas():
    algbw, busbw = report.bandwidths("all_reduce", 1e9, 0.5, 8)
    assert (algbw, busbw) == (2.0, 2.0 * 2 * 7 / 8)
    algbw, busbw = report.bandwidths("all_gather", 1e9, 0.5, 8)
    assert (algbw, busbw) == (2.0, 2.0 * 7 / 8)


def test_the_table_has_nccl_tests_columns_and_its_formula():
    rows = [report.row("all_reduce", 1 << 20, 0.001, 4), report.row("all_reduce", 4 << 20, 0.002, 4, wrong=3)]
    lines = report.table("all_reduce", rows, 4, 2, "gloo, cpu", 5, 1)
    assert lines[1].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
    assert lines[2].split() == ["#", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)"]
    assert lines[3].split() == ["1048576", "262144", "float", "sum", "-1", "1000.0", "1.05", "1.57", "0"]
    assert lines[4].split()[-1] == "3"
    assert lines[-2] == f"# Avg bus bandwidth    : {(1.048576 * 1.5 + 2.097152 * 1.5) / 2:.3f}"
    assert lines[-1] == "# busbw = algbw * 2(n-1)/n, n = 4 ranks (nccl-tests' PERFORMANCE.md)"


def test_ring_pairs_and_node_names():
    assert report.ring_pairs(["a"]) == [] and report.ring_pairs(["a", "b"]) == [(0, 1)]
    assert report.ring_pairs(["a", "b", "c"]) == [(0, 1), (1, 2), (2, 0)]
    assert report.node_names(["vm", "vm", "n3"]) == ["vm#0", "vm#1", "n3"]


def test_a_node_whose_best_link_is_under_half_the_median_is_named_and_its_neighbours_are_not():
    nodes = ["n1", "n2", "n3", "n4"]
    links = {(0, 1): 10.0, (1, 2): 9.0, (2, 3): 0.4, (3, 0): 0.5}  # n4 is slow: both its links are
    v = report.judge(nodes, links)
    assert v["best"] == {"n1": 10.0, "n2": 10.0, "n3": 9.0, "n4": 0.5} and v["median"] == 9.5 and v["slow"] == ["n4"]
    (line,) = report.slow_lines(nodes, links, v)
    assert line == ("node n4: slow: its best link to a ring neighbour carries 0.500 GB/s bus bandwidth, under 0.5 x the "
                    "median node's 9.500 GB/s (links, GB/s: n3<->n4 0.400, n4<->n1 0.500)")
    table = report.neighbour_table(nodes, links, v, 4 << 20, 3)
    assert any(ln.split() == ["n4", "0.500", "0.05", "SLOW"] for ln in table), table
    # within the threshold: nobody is named
    assert report.judge(nodes, {(0, 1): 10.0, (1, 2): 9.0, (2, 3): 6.0, (3, 0): 5.5})["slow"] == []


def test_with_two_nodes_one_link_names_no_node():
    v = report.judge(["n1", "n2"], {(0, 1): 0.01})
    assert v["slow"] == [] and "two nodes: one link" in v["note"]
    assert report.judge(["n1"], {})["note"].startswith("one node")


# ---- the roll call ---------------------------------------------------------------------------

class Store:
    """torch's TCPStore as the roll call uses it, in memory, shared by the nodes' threads."""
    data: dict[str, str] = {}
    lock = threading.Lock()

    def __init__(self, host, port, world, first, timeout, wait_for_workers=False):
        self.timeout = timeout.total_seconds()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("Wait timeout")
            time.sleep(0.05)


def listening():
    """A port that accepts connections, as the first node's store does."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


SLURM = Topology("slurm", 3, None, "n1", 29500, "42")


def test_a_slurm_node_is_its_hostname_s_place_in_the_node_list_and_the_store_is_at_port_plus_1():
    p = rollcall.place(SLURM, "n2", ["n1", "n2", "n3"])
    assert p == rollcall.Place("n2", False, ("n1", "n2", "n3"), "n1", 29501)
    assert rollcall.place(SLURM, "n1", ["n1.cluster", "n2", "n3"]).first
    static = Topology("explicit", 2, 1, "10.0.0.1", 29500)
    assert rollcall.place(static, "pod-b", []) == rollcall.Place("node 1", False, ("node 0", "node 1"), "10.0.0.1", 29501)
    with pytest.raises(PreflightError, match="hostname 'x9' is not in the job's node list"):
        rollcall.place(SLURM, "x9", ["n1", "n2", "n3"])


def test_every_node_gets_every_node_s_failed_lines_and_the_missing_nodes_are_named():
    Store.data = {}
    server = listening()
    port = server.getsockname()[1] - 1
    topo = Topology("slurm", 3, None, "127.0.0.1", port, "42")
    results = {"n1": {"lines": [], "summary": "node n1: ok"}, "n2": {"lines": ["driver 470 is old"], "summary": "node n2"}}
    out = {}

    def take_part(name):
        p = rollcall.place(topo, name, ["n1", "n2", "n3"])
        out[name] = rollcall.call(p, results[name], 3, store_cls=Store)

    threads = [threading.Thread(target=take_part, args=(n,)) for n in ("n1", "n2")]  # n3 never starts
    t0 = time.monotonic()
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    server.close()
    assert time.monotonic() - t0 < 3 + rollcall.ACK_WAIT_S + 2
    assert out["n1"] == out["n2"]
    assert out["n1"]["missing"] == ["n3"] and out["n1"]["answered"] == ["n1", "n2"]
    assert out["n1"]["lines"][0] == "node n2: driver 470 is old"
    assert out["n1"]["lines"][1].startswith("nodes that did not answer within 3 s: n3 (2 of 3 answered: n1, n2)")


def test_a_node_that_cannot_reach_the_first_says_so_within_its_bound_with_its_own_lines():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    p = rollcall.Place("n2", False, ("n1", "n2"), "127.0.0.1", port)
    t0 = time.monotonic()
    out = rollcall.call(p, {"lines": ["/dev/shm is 64 MiB"], "summary": "node n2"}, 2, store_cls=Store)
    assert 2 <= time.monotonic() - t0 < 4
    assert out["lines"][0] == "node n2: /dev/shm is 64 MiB"
    assert out["lines"][1].startswith(f"node n2: cannot reach the preflight's roll call at 127.0.0.1:{port} within 2 s: "
                                      "the first node, n1, did not answer")


# ---- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--shm-size", "16GB"], "'16GB' is not a size like 16Gi or 512Mi"),
    (["--timeout", "0"], "'0' is not a positive number of seconds"),
    (["--slow-ratio", "2"], "'2' is not a ratio between 0 and 1"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1 is negative"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys, tmp_path):
    assert cli.main(argv, {"PYTORCH_CUDA_MANIFEST": str(tmp_path / "none.json")}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pytorch-cuda-preflight: error: ") and says in err, err


def test_an_unreadable_manifest_or_scheduler_environment_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_MANIFEST", str(tmp_path / "none.json"))
    assert cli.main([], {}) == 2
    assert "the image's manifest is unreadable" in capsys.readouterr().err
    (tmp_path / "m.json").write_text(json.dumps(MANIFEST))
    monkeypatch.setenv("PYTORCH_CUDA_MANIFEST", str(tmp_path / "m.json"))
    assert cli.main([], {"PET_NNODES": "2", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "m"}) == 2
    assert "PET_NODE_RANK=3 is not below PET_NNODES=2" in capsys.readouterr().err


def test_after_a_double_dash_the_command_is_kept_whole():
    args = cli.parse(["--gpus-per-node", "8", "--", "pytorch-cuda-launch", "train.py", "--lr", "1e-4"], {})
    assert args.then == ["pytorch-cuda-launch", "train.py", "--lr", "1e-4"] and args.gpus_per_node == 8
    assert cli.parse([], {"PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT": "60"}).join_timeout == 60


def test_an_old_driver_s_nvidia_smi_is_asked_again_without_the_compute_capability(monkeypatch):
    """nvidia-smi before R510 refuses --query-gpu=...,compute_cap as a whole: the driver is still read."""
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return __import__("subprocess").CompletedProcess(argv, 0, "Tesla V100-SXM2-32GB, 470.57.02\n", "")

    monkeypatch.setattr(node.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert node.query_without_cap(run=run) == [("Tesla V100-SXM2-32GB", "470.57.02", "?")]
    assert calls == [["/usr/bin/nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]]
    (line,) = node.check(facts(gpus=[("Tesla V100-SXM2-32GB", "470.57.02", "?")] * 2), needs())
    assert line.startswith("driver 470.57.02 (nvidia-smi) is older than 525.60.13")  # and no arch line: the cap is unknown
