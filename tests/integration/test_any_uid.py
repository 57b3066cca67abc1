"""Any uid (issue 28, item 2), on the built default row, as two kinds of site run it:

- `group-0`: OpenShift's restricted pods, an arbitrary uid in group 0 with no /etc/passwd entry
  and HOME=/ (`--user 1000700000:0`). Group 0 owns, and may write, what the image's user may
  (/home/trainer, /workspace: jupyter/docker-stacks' convention), so this uid gets
  HOME=/home/trainer and loads the CPU ops prebuilt there without compiling;
- `caller`: Apptainer and enroot, the calling user's own uid and group (`--user 4242:4242`,
  HOME=/). Outside group 0 it gets a HOME of its own under /tmp (launch/environment.py); its
  CPU ops compile on first use into that HOME, and /workspace is not its own: it mounts its
  directory there, as Apptainer binds the caller's.

Under both: the banner, a writable HOME and caches (XDG_CACHE_HOME, HF_HOME, TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR, torch's extensions directory), torch and DeepSpeed import,
`pytorch-cuda-launch` trains two gloo ranks, JupyterLab and TensorBoard serve, and sshd refuses
in one line (it logs in only users /etc/passwd knows). Every container is removed afterwards.
"""
from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import requests

from helpers import as_root, default_image, free_port, one_error_line, run_once, serving, shown, ssh_keypair, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.second_lane]

USERS = {
    "group-0": ("--user", "1000700000:0"),
    "caller": ("--user", "4242:4242", "-e", "HOME=/"),
}
HOMES = {"group-0": "/home/trainer", "caller": "/tmp/pytorch-cuda-home-4242"}
QUIET = ("-e", "PYTORCH_CUDA_NO_BANNER=1")
IMAGE_ERROR = {"prefix": "pytorch-cuda: error: ", "only_line": True}


@pytest.fixture(scope="module")
def image(docker_client, default_build) -> str:
    # default_build first: the session's one tested build, which default_image() then finds done
    return default_image()


def run_as(image: str, user: str, cmd: list[str], opts: tuple[str, ...] = (), timeout: int = 300):
    from pytorch_cuda_build.stages import gate

    return run_once(image, cmd, ("--label", f"{gate.RUN_LABEL}={gate.RUN_ID}", "--label", "pytorch-cuda.test=any-uid",
                                 *USERS[user], *opts), timeout)


def owned_by(path: Path, uid: int, gid: int) -> Path:
    """A host directory for a /workspace mount, owned as the caller's own would be."""
    path.mkdir(parents=True, exist_ok=True)
    as_root("chown", f"{uid}:{gid}", str(path))  # through sudo where this user is not root
    return path


# Each line `NAME ok`, or the failure: HOME, /workspace, every cache variable, and torch's
# extensions directory as torch computes it.
PROBE = r"""
set -u
try() { mkdir -p "$2" 2>/dev/null && touch "$2/.probe-$$" 2>/dev/null && rm "$2/.probe-$$" && echo "$1 ok" || echo "$1 FAILS $2"; }
echo "uid $(id -u) HOME=$HOME"
try HOME "$HOME"
try workspace /workspace
for v in XDG_CACHE_HOME HF_HOME TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR; do eval "try $v \"\${$v:-/unset}\""; done
ext=$(python -c 'from torch.utils.cpp_extension import get_default_build_root as r; print(r())')
echo "extensions $ext"
try extensions "$ext"
python -c 'import torch, deepspeed; print("imported", torch.__version__, deepspeed.__version__)' 2>&1 | tail -1
"""


@pytest.mark.parametrize("user", USERS)
def test_banner_home_workspace_caches_and_imports(image, user):
    proc = run_as(image, user, ["bash", "-c", PROBE])
    assert proc.returncode == 0, shown(proc)
    assert "== pytorch-cuda 2.7.1-cuda12.1-runtime" in proc.stderr, shown(proc)
    out = proc.stdout.splitlines()
    home = HOMES[user]
    assert f"uid {USERS[user][1].split(':')[0]} HOME={home}" in out, shown(proc)
    # The one line that says where HOME went, with the banner (HOME=/ is never used).
    assert f"pytorch-cuda: uid {USERS[user][1].split(':')[0]}: HOME={home} (" in proc.stderr, shown(proc)
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "extensions"):
        assert f"{name} ok" in out, shown(proc)
    assert f"extensions {home}/.cache/torch_extensions" in out, shown(proc)
    # group 0 may write /workspace; the caller's uid may not and mounts its own (test_jupyter_lab_serves).
    assert ("workspace ok" in out) == (user == "group-0"), shown(proc)
    assert any(line.startswith("imported 2.7.1") for line in out), shown(proc)


# As pytorch_cuda_build/checks/test_image.py's CPU_OPS_UP_TO_DATE: DeepSpeed's builders load.
LOAD_CPU_OPS = r"""
set -eu
snapshot() { cd "$PYTORCH_CUDA_CPU_OPS" && find . -type f ! -name lock -printf '%p %s %T@\n' | sort; }
before=$(snapshot)
python -c '
from deepspeed.accelerator import get_accelerator
for b in ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(b).load(verbose=False)
print("LOADED")
' 2>&1 | tail -1
[ "$(snapshot)" = "$before" ] && echo UNCHANGED
"""


def test_the_prebuilt_cpu_ops_load_without_compiling_for_group_0(image):
    proc = run_as(image, "group-0", ["bash", "-c", LOAD_CPU_OPS], QUIET + ("-e", "DS_ACCELERATOR=cpu"))
    assert proc.returncode == 0 and proc.stdout.split() == ["LOADED", "UNCHANGED"], shown(proc)


TRAIN = """import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
x = torch.randn(64, 8, generator=g)
y = x.sum(dim=1, keepdim=True)
losses = []
for _ in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
if dist.get_rank() == 0:
    print(f"TRAINED world={dist.get_world_size()} first={losses[0]:.4f} last={losses[-1]:.4f}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("user", USERS)
def test_the_launch_contract_trains_two_gloo_ranks(image, user, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN)
    for p in (job, job / "train.py"):
        p.chmod(0o755)
    proc = run_as(image, user, ["pytorch-cuda-launch", "/job/train.py"],
                    QUIET + ("-e", "PYTORCH_CUDA_NPROC_PER_NODE=2", "-e", "OMP_NUM_THREADS=1", "-v", f"{job}:/job:ro"))
    assert proc.returncode == 0, shown(proc)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TRAINED ")), "")
    fields = dict(f.split("=") for f in line.split()[1:])
    assert fields.get("world") == "2" and float(fields["last"]) < float(fields["first"]) / 10, shown(proc)


def lab_answers(port: int, token: str):
    def ready():
        try:
            return requests.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"},
                                timeout=10).status_code == 200
        except requests.ConnectionError:
            return False
    return ready


@pytest.mark.parametrize("user", USERS)
def test_jupyter_lab_serves_and_saves_in_workspace(image, user, tmp_path):
    # group 0 writes the image's /workspace; the caller mounts its own directory there.
    mount = () if user == "group-0" else ("-v", f"{owned_by(tmp_path / 'ws', 4242, 4242)}:/workspace")
    port, token = free_port(), secrets.token_hex(16)
    cmd = ["jupyter", "lab", "--ip=127.0.0.1", f"--port={port}"]
    with serving(image, cmd, (*USERS[user], "-e", f"JUPYTER_TOKEN={token}", *mount)) as cid:
        wait_until("jupyter lab", lab_answers(port, token), cid, timeout=180)
        saved = requests.put(f"http://127.0.0.1:{port}/api/contents/proof.txt", timeout=30,
                             headers={"Authorization": f"token {token}"},
                             json={"type": "file", "format": "text", "content": "any uid"})
        assert saved.status_code == 201, saved.text


def test_jupyter_says_so_where_the_caller_cannot_write_workspace(image):
    proc = run_as(image, "caller", ["jupyter", "lab", "--ip=127.0.0.1", f"--port={free_port()}"], QUIET)
    one_error_line(proc, 1, "/workspace is not writable by uid 4242", **IMAGE_ERROR)


@pytest.mark.parametrize("user", USERS)
def test_tensorboard_serves(image, user):
    port = free_port()
    cmd = ["tensorboard", "--logdir", "/tmp/runs", "--host", "127.0.0.1", "--port", str(port)]
    with serving(image, cmd, USERS[user]) as cid:
        def page():
            try:
                return requests.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200
            except requests.ConnectionError:
                return False
        wait_until("tensorboard", page, cid, timeout=180)


@pytest.mark.parametrize("user", USERS)
def test_sshd_refuses_a_uid_without_an_account_in_one_line(image, user, tmp_path):
    _, pub = ssh_keypair(tmp_path)
    proc = run_as(image, user, ["sshd"], QUIET + ("-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={free_port()}"))
    one_error_line(proc, 1, "has no account in /etc/passwd", **IMAGE_ERROR)
