"""The launch contract (pytorch_cuda_runtime.launch) without torch, a GPU or a scheduler: each
scheduler's environment, as its controller writes it, gives the expected torchrun argv; each bad
environment is one line and exit 2; PATH, HOME and the caches are restored; the bin script execs
torchrun (a stand-in torch package records what it got)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytorch_cuda_runtime import hostlist
from pytorch_cuda_runtime.launch import LaunchError, environment, nproc
from pytorch_cuda_runtime.launch.cli import Machine, plan, render

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "pytorch_cuda_runtime" / "bin" / "pytorch-cuda-launch"
PY = "/opt/venv/bin/python"
TORCHRUN = [PY, "-m", "torch.distributed.run"]
IMAGE_PATH = "/usr/local/cuda/bin:/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def machine(gpus: int = 0, writable: tuple[str, ...] = ("/home/trainer", "/tmp"), uid: int = 1000,
            passwd_home: str | None = "/home/trainer") -> Machine:
    return Machine(python=PY, uid=uid, passwd_home=passwd_home, hostnames=hostlist.expand,
                   gpus=lambda env: nproc.visible_gpus(env, [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl"],
                                                       lambda: 0),
                   writable=lambda p: any(p == w or p.startswith(w + "/") for w in writable),
                   is_file=lambda p: True)


def launch(env: dict[str, str], gpus: int = 0, args: tuple[str, ...] = ("train.py", "--zero", "3"), **kw):
    return plan(list(args), {"PATH": "/usr/bin:/bin", "HOME": "/home/trainer", **env}, machine(gpus, **kw))


def static(nnodes, nproc_value, rank, addr, port, timeout=1800):
    return TORCHRUN + ["--nnodes", str(nnodes), "--nproc_per_node", nproc_value, "--node_rank", str(rank),
                       "--master_addr", addr, "--master_port", str(port), "--rdzv_conf", f"timeout={timeout}",
                       "train.py", "--zero", "3"]


def c10d(nnodes, nproc_value, endpoint, job, timeout=1800):
    return TORCHRUN + ["--nnodes", str(nnodes), "--nproc_per_node", nproc_value, "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", endpoint, "--rdzv_id", job, "--rdzv_conf", f"join_timeout={timeout}",
                       "train.py", "--zero", "3"]


# training-operator v1.9.2 pkg/controller.v1/pytorch/{envvar,master}.go: Master replica 1, Worker
# replica 1, nprocPerNode defaulted to "auto" (WORLD_SIZE = replicas x 1), port 23456.
def pytorchjob_pod(rank: int) -> dict[str, str]:
    return {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456",
            "MASTER_ADDR": "bert-master-0", "PET_MASTER_ADDR": "bert-master-0", "WORLD_SIZE": "2",
            "RANK": str(rank), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2"}


# Trainer v2.1.0 pkg/runtime/framework/plugins/torch/torch.go: PET_* only; the pod is a JobSet
# pod, so Kubernetes sets JOB_COMPLETION_INDEX too.
def trainjob_pod(rank: int, nproc_value: str = "4") -> dict[str, str]:
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": nproc_value, "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "llm-node-0-0.llm", "PET_MASTER_PORT": "29500", "JOB_COMPLETION_INDEX": str(rank)}


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]",
         "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_SUBMIT_DIR": "/home/alice"}
SLURM_TASK = {"SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node02"}


@pytest.mark.parametrize("rank", [0, 1])
def test_pytorchjob_pods(rank):
    got = launch(pytorchjob_pod(rank), gpus=8)
    assert got.argv == static(2, "auto", rank, "bert-master-0", 23456)
    assert got.topology.source == "kubeflow"
    for gone in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NODE_RANK"):
        assert gone not in got.env
    assert got.env["PYTHONUNBUFFERED"] == "1"


def test_pytorchjob_auto_on_a_cpu_node_is_one_rank_not_one_per_core():
    got = launch(pytorchjob_pod(1), gpus=0)
    assert got.argv == static(2, "1", 1, "bert-master-0", 23456)
    assert "one CPU rank" in got.nproc_why


@pytest.mark.parametrize("rank", [0, 1])
def test_trainjob_pods(rank):
    got = launch(trainjob_pod(rank), gpus=4)
    assert got.argv == static(2, "4", rank, "llm-node-0-0.llm", 29500)
    assert got.topology.source == "kubeflow"  # before JOB_COMPLETION_INDEX


@pytest.mark.parametrize("rank", [0, 1])
def test_jobset_pods(rank):
    env = {"JOB_COMPLETION_INDEX": str(rank), "PYTORCH_CUDA_NNODES": "2",
           "PYTORCH_CUDA_MASTER_ADDR": "train-workers-0-0.train"}
    got = launch(env, gpus=2)
    assert got.argv == static(2, "auto", rank, "train-workers-0-0.train", 29500)
    assert got.topology.source == "indexed-job"


def test_indexed_job_pod_with_its_own_port():
    env = {"JOB_COMPLETION_INDEX": "2", "PYTORCH_CUDA_NNODES": "3", "PYTORCH_CUDA_MASTER_ADDR": "train-0.train-svc",
           "PYTORCH_CUDA_MASTER_PORT": "29400"}
    assert launch(env).argv == static(3, "1", 2, "train-0.train-svc", 29400)


@pytest.mark.parametrize("task_vars", [SLURM_TASK, {}], ids=["srun", "srun-container"])
def test_slurm_with_and_without_the_per_task_variables(task_vars):
    got = launch({**SLURM, **task_vars})
    assert got.argv == c10d(2, "1", "node01:29500", "4242")
    assert "--node_rank" not in got.argv
    assert got.topology.source == "slurm" and got.topology.node_rank is None


def test_slurm_gpus_on_node_and_master_port():
    got = launch({**SLURM, "SLURM_GPUS_ON_NODE": "4", "MASTER_PORT": "12345"}, gpus=8)
    assert got.argv == c10d(2, "4", "node01:12345", "4242")
    assert got.nproc_why == "SLURM_GPUS_ON_NODE=4"
    assert "MASTER_PORT" not in got.env


def test_slurm_gpus_on_node_zero_is_one_cpu_rank():
    assert launch({**SLURM, "SLURM_GPUS_ON_NODE": "0"}, gpus=8).nproc == "1"


def test_slurm_without_a_count_uses_the_local_gpus():
    got = launch(SLURM, gpus=4)
    assert got.nproc == "auto" and "4 seen" in got.nproc_why


def test_slurm_a_step_on_part_of_the_allocation():
    env = {**SLURM, "SLURM_JOB_NODELIST": "gpu[1-4]", "SLURM_NNODES": "4", "SLURM_STEP_NODELIST": "gpu[3-4]",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
    assert launch(env).argv == c10d(2, "1", "gpu3:29500", "4242")


def test_slurm_job_variables_only():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]", "SLURM_NNODES": "4"}
    assert launch(env).argv == c10d(4, "1", "rack1-node01:29500", "7")


def test_the_rendezvous_waits_as_long_as_asked_for_a_slow_node():
    """PYTORCH_CUDA_RDZV_TIMEOUT: c10d's join_timeout and the static store's timeout (default 1800 s,
    beside torchrun's 600 s, for a node still pulling or unpacking the image)."""
    assert launch({**SLURM, "PYTORCH_CUDA_RDZV_TIMEOUT": "3600"}).argv == c10d(2, "1", "node01:29500", "4242", 3600)
    assert launch({**pytorchjob_pod(1), "PYTORCH_CUDA_RDZV_TIMEOUT": "90"}, gpus=8).argv == static(2, "auto", 1, "bert-master-0", 23456, 90)
    for bad in ("0", "-5", "10m", "1.5"):
        with pytest.raises(LaunchError, match=rf"PYTORCH_CUDA_RDZV_TIMEOUT='{bad}' is not a whole number of seconds"):
            launch({**SLURM, "PYTORCH_CUDA_RDZV_TIMEOUT": bad})


def test_rank_labels_prefix_every_line_with_its_rank_where_asked():
    labelled = launch({**SLURM, "PYTORCH_CUDA_RANK_LABELS": "1"})
    assert labelled.argv[-5:-3] == ["--tee", "3"] and labelled.env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "
    assert any(c.startswith("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=") for c in labelled.changes)
    plain = launch(SLURM)
    assert "--tee" not in plain.argv and "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" not in plain.env


@pytest.mark.parametrize("gpus,expected", [(0, "1"), (8, "auto")])
def test_no_scheduler_is_one_standalone_node(gpus, expected):
    got = launch({}, gpus=gpus)
    assert got.argv == TORCHRUN + ["--standalone", "--nproc_per_node", expected, "train.py", "--zero", "3"]
    assert got.topology.source == "single-node"


def test_the_explicit_contract_wins_over_every_scheduler():
    env = {**pytorchjob_pod(1), **SLURM, "PYTORCH_CUDA_NNODES": "3", "PYTORCH_CUDA_NODE_RANK": "2",
           "PYTORCH_CUDA_MASTER_ADDR": "10.0.0.1", "PYTORCH_CUDA_NPROC_PER_NODE": "2"}
    got = launch(env, gpus=8)
    assert got.argv == static(3, "2", 2, "10.0.0.1", 29500)
    assert got.topology.source == "explicit"


def test_kubeflow_wins_over_slurm():
    assert launch({**SLURM, **trainjob_pod(1)}).topology.source == "kubeflow"


def test_module_and_dry_run_options():
    got = launch({}, args=("--print", "-m", "pkg.train", "--lr", "1"))
    assert got.dry_run
    assert got.argv[-4:] == ["--module", "pkg.train", "--lr", "1"]
    text = render(got)
    assert "source: single-node" in text and text.splitlines()[-1].startswith("argv: /opt/venv/bin/python -m")


def test_the_print_names_source_rendezvous_ranks_and_argv():
    text = render(launch({**SLURM, "SLURM_GPUS_ON_NODE": "4"}))
    assert "source: slurm (SLURM_STEP_NODELIST=node[01-02]" in text
    assert "nnodes: 2" in text and "node rank: assigned by the c10d rendezvous" in text
    assert "rendezvous: c10d at node01:29500, id 4242" in text
    assert "nproc_per_node: 4 (SLURM_GPUS_ON_NODE=4)" in text


BAD = [
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "m"}, "PET_NODE_RANK=2 is not below PET_NNODES=2"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "1"}, "PET_MASTER_ADDR is not set"),
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "m"}, "PET_NODE_RANK is not set"),
    ({"PET_NNODES": "0", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m"}, "PET_NNODES='0' is not a positive whole number"),
    ({"PET_NNODES": "two", "PET_MASTER_ADDR": "m"}, "PET_NNODES='two' is not a positive whole number"),
    ({"PET_NNODES": "-1", "PET_MASTER_ADDR": "m"}, "is not a positive whole number"),
    ({"PET_NNODES": "1:4", "PET_RDZV_BACKEND": "c10d"}, "elastic range"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "70000"}, "not a port"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m", "PET_NPROC_PER_NODE": "many"},
     "PET_NPROC_PER_NODE='many' is not"),
    ({**SLURM, "SLURM_STEP_NODELIST": "node[01-"}, "unbalanced bracket"),
    ({**SLURM, "SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES=3 but SLURM_STEP_NODELIST=node[01-02] names 2 hosts"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "3"}, "SLURM_NNODES=3 but"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}, "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST is not set"),
    ({**SLURM, "SLURM_NTASKS": "16"}, "one task per node"),
    ({**SLURM, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below"),
    ({**SLURM, "SLURM_GPUS_ON_NODE": "four"}, "SLURM_GPUS_ON_NODE='four'"),
    ({"JOB_COMPLETION_INDEX": "0"}, "PYTORCH_CUDA_NNODES is not"),
    ({"JOB_COMPLETION_INDEX": "1", "PYTORCH_CUDA_NNODES": "2"}, "PYTORCH_CUDA_MASTER_ADDR is not set"),
    ({"JOB_COMPLETION_INDEX": "2", "PYTORCH_CUDA_NNODES": "2", "PYTORCH_CUDA_MASTER_ADDR": "m"}, "not below"),
    ({"PYTORCH_CUDA_NNODES": "2"}, "nothing gives this node's rank"),
    ({"PYTORCH_CUDA_NODE_RANK": "0", "PYTORCH_CUDA_NNODES": "2", "PYTORCH_CUDA_MASTER_ADDR": "a b"}, "not a host name"),
    ({"PYTORCH_CUDA_NPROC_PER_NODE": "0"}, "PYTORCH_CUDA_NPROC_PER_NODE='0'"),
]


@pytest.mark.parametrize("env,says", BAD, ids=[s for _, s in BAD])
def test_bad_environments_are_one_line(env, says):
    with pytest.raises(LaunchError) as e:
        launch(env)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args,says", [((), "no SCRIPT"), (("",), "no SCRIPT"), (("--print",), "no SCRIPT"),
                                       (("--nproc", "2", "t.py"), "unknown option '--nproc'")])
def test_bad_arguments(args, says):
    with pytest.raises(LaunchError, match=says):
        launch({}, args=args)


def test_a_missing_script():
    m = Machine(python=PY, uid=1000, hostnames=hostlist.expand, gpus=lambda env: (0, ""), is_file=lambda p: False)
    with pytest.raises(LaunchError, match="'train.py': no such file"):
        plan(["train.py"], {}, m)


# ---- the working directory: PYTORCH_CUDA_WORKDIR (build.py job's sbatch script sets it)


def workdir_machine(files: tuple[str, ...] = ("/home/alice/job/train.py",), dirs: tuple[str, ...] = ("/home/alice/job",)) -> Machine:
    return Machine(python=PY, uid=1000, passwd_home="/home/trainer", hostnames=hostlist.expand, gpus=lambda env: (0, ""),
                   writable=lambda p: True, is_file=lambda p: p in files, is_dir=lambda p: p in dirs)


def test_the_workdir_is_where_a_relative_script_is_found_and_the_args_go_as_written():
    env = {**SLURM, "PYTORCH_CUDA_WORKDIR": "/home/alice/job", "PWD": "/home/alice"}
    got = plan(["train.py", "--deepspeed", "ds.json"], env, workdir_machine())
    assert got.cwd == "/home/alice/job" and got.env["PWD"] == "/home/alice/job"
    assert got.argv[-3:] == ["train.py", "--deepspeed", "ds.json"]  # relative, as given: the ranks start in the workdir
    assert "cwd: /home/alice/job (PYTORCH_CUDA_WORKDIR)" in render(got).splitlines()
    assert plan(["train.py"], {**SLURM, "PWD": "/x"}, workdir_machine(files=("train.py",))).cwd is None  # unset: where it started


@pytest.mark.parametrize("workdir, args, says", [
    ("job", ["train.py"], "PYTORCH_CUDA_WORKDIR='job' is not an absolute path"),
    ("/data", ["train.py"], "PYTORCH_CUDA_WORKDIR=/data is not a directory here (is it mounted into the container?)"),
    ("/home/alice/job", ["eval.py"], "SCRIPT 'eval.py': no such file in /home/alice/job (PYTORCH_CUDA_WORKDIR)"),
])
def test_a_bad_workdir_or_a_script_not_in_it_is_one_line(workdir, args, says):
    with pytest.raises(LaunchError) as e:
        plan(args, {**SLURM, "PYTORCH_CUDA_WORKDIR": workdir}, workdir_machine())
    assert str(e.value) == says


# ---- PATH, HOME and caches


def test_srun_container_path_and_home_are_restored():
    # srun's PATH and HOME replace the image's; the task runs as uid 1000 (ENVIRONMENT.md).
    env = {**SLURM, "PATH": "/opt/slurm/bin:/usr/bin:/bin", "HOME": "/root", "PYTORCH_CUDA_PATH": IMAGE_PATH}
    got = plan(["train.py"], env, machine())
    assert got.env["PATH"] == IMAGE_PATH + ":/opt/slurm/bin"
    assert got.env["HOME"] == "/home/trainer"
    assert got.env["XDG_CACHE_HOME"] == "/home/trainer/.cache"
    assert any(c.startswith("HOME=/home/trainer (uid 1000's home: HOME=/root is not a writable directory") for c in got.changes)


def test_without_the_image_path_the_venv_comes_first():
    got = plan(["train.py"], {"PATH": "/usr/bin:/opt/venv/bin:/bin", "HOME": "/home/trainer"}, machine())
    assert got.env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"


def test_an_arbitrary_uid_gets_a_home_in_tmp():
    # OpenShift: uid 1000700000 in group 0, HOME=/, no passwd entry, /home/trainer not writable.
    got = plan(["train.py"], {"HOME": "/", "PATH": "/usr/bin"}, machine(uid=1000700000, passwd_home=None, writable=("/tmp",)))
    assert got.env["HOME"] == "/tmp/pytorch-cuda-home-1000700000"
    assert got.env["XDG_CACHE_HOME"] == "/tmp/pytorch-cuda-home-1000700000/.cache"
    assert got.env["HF_HOME"] == "/tmp/pytorch-cuda-home-1000700000/.cache/huggingface"
    assert got.env["TRITON_CACHE_DIR"] == "/tmp/pytorch-cuda-home-1000700000/.cache/triton"
    assert got.env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/torchinductor_1000700000"
    assert "TORCH_EXTENSIONS_DIR" not in got.env


def test_an_arbitrary_uid_uses_the_image_home_where_group_0_may_write():
    got = plan(["train.py"], {"HOME": "/"}, machine(uid=1000700000, passwd_home=None))
    assert got.env["HOME"] == "/home/trainer"


def test_a_writable_home_given_is_kept_even_where_the_image_home_is_writable():
    # docs/ops.md: the CPU ops are found prebuilt only where HOME is /home/trainer; a uid in group 0
    # started with a writable HOME of its own (Apptainer's bind, HOME=/scratch/alice) keeps it.
    got = plan(["train.py"], {"HOME": "/scratch/alice"},
               machine(uid=1000700000, passwd_home=None, writable=("/scratch/alice", "/home/trainer", "/tmp")))
    assert got.env["HOME"] == "/scratch/alice"
    assert got.env["XDG_CACHE_HOME"] == "/scratch/alice/.cache"


def test_tmpdir_is_preferred_for_the_fallback_home():
    env = {"HOME": "/nonexistent", "TMPDIR": "/scratch/job1"}
    got = plan(["train.py"], env, machine(uid=2000, passwd_home="/home/alice", writable=("/scratch/job1", "/tmp")))
    assert got.env["HOME"] == "/scratch/job1/pytorch-cuda-home-2000"
    assert got.env["TORCHINDUCTOR_CACHE_DIR"] == "/scratch/job1/torchinductor_2000"


def test_writable_settings_are_kept_and_unwritable_ones_replaced():
    env = {"HOME": "/home/trainer", "XDG_CACHE_HOME": "/data/cache", "HF_HOME": "/models/hf",
           "TRITON_CACHE_DIR": "/data/triton", "TORCHINDUCTOR_CACHE_DIR": "/data/inductor"}
    got = plan(["train.py"], env, machine(writable=("/home/trainer", "/tmp", "/data")))
    assert got.env["XDG_CACHE_HOME"] == "/data/cache" and got.env["TRITON_CACHE_DIR"] == "/data/triton"
    assert got.env["TORCHINDUCTOR_CACHE_DIR"] == "/data/inductor"
    assert got.env["HF_HOME"] == "/data/cache/huggingface"  # /models is read-only


def test_writable_looks_at_the_nearest_existing_parent(tmp_path):
    assert environment.writable(str(tmp_path / "a" / "b"))
    (tmp_path / "f").write_text("")
    assert not environment.writable(str(tmp_path / "f"))
    assert not environment.writable(str(tmp_path / "f" / "x"))


def test_the_entrypoint_step_changes_only_home_and_caches():
    # The entrypoint must keep the user's PATH, RANK, MASTER_ADDR: only HOME and the caches move.
    env = {"HOME": "/", "PATH": "/usr/bin", "RANK": "3", "MASTER_ADDR": "n1"}
    changed, lines = environment.home_and_caches(env, 4242, None, lambda p: p == "/tmp" or p.startswith("/tmp/"))
    assert changed == {"HOME": "/tmp/pytorch-cuda-home-4242", "XDG_CACHE_HOME": "/tmp/pytorch-cuda-home-4242/.cache",
                       "HF_HOME": "/tmp/pytorch-cuda-home-4242/.cache/huggingface",
                       "TRITON_CACHE_DIR": "/tmp/pytorch-cuda-home-4242/.cache/triton",
                       "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/tmp/pytorch-cuda-home-4242/.cache/flash_attention_cute_dsl",
                       "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_4242"}
    assert lines[0] == "HOME=/tmp/pytorch-cuda-home-4242 (no writable home: HOME=/ is not a writable directory)"


def test_the_entrypoint_step_prints_exports_and_makes_home(tmp_path):
    # Run as this test's uid; a HOME that is a file is not writable, so a new one is made under TMPDIR.
    (tmp_path / "file").write_text("")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "file"), "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "PYTORCH_CUDA_NO_BANNER": "1"}
    r = subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.launch.environment"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r
    shown = subprocess.run(["sh", "-c", r.stdout + 'echo "$HOME|$XDG_CACHE_HOME|$TORCHINDUCTOR_CACHE_DIR"'],
                           env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60).stdout.strip()
    home, cache, inductor = shown.split("|")
    assert home != str(tmp_path / "file") and os.path.isdir(home) and os.access(home, os.W_OK), r.stdout
    assert cache == f"{home}/.cache" and inductor.startswith(str(tmp_path)), r.stdout


# ---- nproc rules


@pytest.mark.parametrize("env,devices,smi,expected", [
    ({}, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"], 0, 2),
    ({}, ["nvidiactl"], 0, 0),
    ({}, [], 3, 3),
    ({"CUDA_VISIBLE_DEVICES": "1,3,5"}, ["nvidia0", "nvidia1"], 0, 3),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, ["nvidia0"], 0, 1),
    ({"CUDA_VISIBLE_DEVICES": ""}, ["nvidia0"], 0, 0),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, [], 0, 0),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, [], 0, 0),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, ["nvidia0"], 1, 0),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, ["nvidia0"], 1, 0),
])
def test_visible_gpus(env, devices, smi, expected):
    assert nproc.visible_gpus(env, devices, lambda: smi)[0] == expected


def test_nvidia_smi_is_asked_only_without_device_nodes():
    def smi():
        raise AssertionError("nvidia-smi ran")
    assert nproc.visible_gpus({}, ["nvidia0"], smi)[0] == 1


@pytest.mark.parametrize("env,gpus,expected", [
    ({"PYTORCH_CUDA_NPROC_PER_NODE": "3"}, 8, "3"),
    ({"PYTORCH_CUDA_NPROC_PER_NODE": "cpu"}, 0, "cpu"),
    ({"PYTORCH_CUDA_NPROC_PER_NODE": "auto"}, 0, "1"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "gpu"}, 0, "gpu"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "6"}, 8, "6"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"}, 8, "auto"),
    ({}, 2, "auto"),
    ({}, 0, "1"),
])
def test_nproc_rules(env, gpus, expected):
    assert launch(env, gpus=gpus).nproc == expected


# ---- the bin script, as the image runs it


def run_bin(args: list[str], env: dict[str, str], pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": env.get("HOME", "/tmp"), "PYTHONPATH": pythonpath,
            "PYTORCH_CUDA_PYTHON": sys.executable}
    return subprocess.run(["sh", str(BIN), *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env,args", [
    ({"PET_NNODES": "2", "PET_NODE_RANK": "5", "PET_MASTER_ADDR": "m"}, ["--print", "t.py"]),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2", "SLURM_NNODES": "2"}, ["t.py"]),
    ({"JOB_COMPLETION_INDEX": "0"}, ["t.py"]),
    ({}, []),
    ({}, ["--print", ""]),
])
def test_the_script_says_one_line_and_exits_2(env, args, tmp_path):
    (tmp_path / "t.py").write_text("")
    r = run_bin([str(tmp_path / a) if a == "t.py" else a for a in args], env)
    assert r.returncode == 2, r
    assert r.stdout == ""
    assert r.stderr.startswith("pytorch-cuda: error: ") and r.stderr.count("\n") == 1, r.stderr


def test_the_script_prints_the_launch(tmp_path):
    (tmp_path / "t.py").write_text("")
    r = run_bin(["--print", str(tmp_path / "t.py"), "--lr", "1"], {**SLURM, "SLURM_GPUS_ON_NODE": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (f"argv: {sys.executable} -m torch.distributed.run --nnodes 2 "
                                         "--nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint node01:29500 "
                                         f"--rdzv_id 4242 --rdzv_conf join_timeout=1800 {tmp_path / 't.py'} --lr 1")


FAKE_TORCHRUN = """import json, os, sys
with open(os.environ["FAKE_TORCHRUN_OUT"], "w") as f:
    json.dump({"pid": os.getpid(), "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}, f)
"""


def fake_torch(tmp_path: Path) -> Path:
    """A torch package whose torch.distributed.run records its pid, argv, environment and cwd."""
    fake = tmp_path / "fake"
    (fake / "torch" / "distributed").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "run.py").write_text(FAKE_TORCHRUN)
    return fake


def test_the_script_execs_torchrun_in_the_workdir(tmp_path):
    fake, job = fake_torch(tmp_path), tmp_path / "submit"
    job.mkdir()
    (job / "train.py").write_text("")
    out = tmp_path / "out.json"
    p = subprocess.run(["sh", str(BIN), "train.py", "--deepspeed", "ds.json"], cwd=tmp_path, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{fake}", "PYTORCH_CUDA_PYTHON": sys.executable,
                            "HOME": str(tmp_path / "home"), "FAKE_TORCHRUN_OUT": str(out), "PYTORCH_CUDA_WORKDIR": str(job)})
    assert p.returncode == 0
    got = json.loads(out.read_text())
    assert got["cwd"] == str(job) and got["argv"][-3:] == ["train.py", "--deepspeed", "ds.json"]


def test_the_script_execs_torchrun_with_the_restored_environment(tmp_path):
    fake = fake_torch(tmp_path)
    (tmp_path / "t.py").write_text("")
    out = tmp_path / "out.json"
    env = {**pytorchjob_pod(1), "FAKE_TORCHRUN_OUT": str(out), "HOME": str(tmp_path / "home"),
           "PYTORCH_CUDA_PATH": f"/opt/venv/bin:{os.path.dirname(sys.executable)}", "TMPDIR": str(tmp_path)}
    p = subprocess.Popen(["sh", str(BIN), str(tmp_path / "t.py"), "--x"],
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{fake}",
                              "PYTORCH_CUDA_PYTHON": sys.executable, **env})
    assert p.wait(timeout=60) == 0
    got = json.loads(out.read_text())
    assert got["pid"] == p.pid  # exec'd all the way: signals to the launcher reach torchrun
    assert got["argv"] == ["--nnodes", "2", "--nproc_per_node", got["argv"][3], "--node_rank", "1",
                           "--master_addr", "bert-master-0", "--master_port", "23456", "--rdzv_conf", "timeout=1800",
                           str(tmp_path / "t.py"), "--x"]
    for gone in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NPROC_PER_NODE"):
        assert gone not in got["env"]
    assert got["env"]["PATH"].startswith(f"/opt/venv/bin:{os.path.dirname(sys.executable)}:")
    home = got["env"]["HOME"]
    assert os.path.isdir(home) and os.access(home, os.W_OK)
