"""What must be true of every image, checked on the image itself (pytest-testinfra).

Facts come from the artefact: labels are compared with the committed lock, versions
with what the installed wheels report, not with what the matrix claims.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import docker
import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.checks.support import Host, run_image, shown
from pytorch_cuda_build.matrix import REPRODUCIBLE_EPOCH
from pytorch_cuda_build.resolve import pypi as resolve_pypi
from pytorch_cuda_build.stages import render
from pytorch_cuda_runtime import ninjalogs, stack
from pytorch_cuda_runtime.opsbuild import BEYOND, SIMD

pytestmark = pytest.mark.docker

COMMANDS = ["python", "torchrun", "deepspeed", "ds_report", "zero_to_fp32", "pdsh", "ssh", "/usr/sbin/sshd",
            "jupyter", "jupyter-lab", "tensorboard", "tini", "pytorch-cuda-smoke", "pytorch-cuda-banner", "pytorch-cuda-entrypoint",
            "pytorch-cuda-launch", "pytorch-cuda-preflight"]


def test_default_user_is_non_root_with_writable_workspace(host: Host) -> None:
    assert host.user().name == "trainer"
    assert host.user().uid == 1000
    ws = host.file("/workspace")
    assert ws.is_directory and ws.user == "trainer"
    assert host.run("touch /workspace/.probe && rm /workspace/.probe").rc == 0


def test_group_0_may_write_what_the_default_user_may(root_host: Host) -> None:
    """Any uid: OpenShift runs an arbitrary uid in group 0, which gets HOME=/home/trainer and
    /workspace as trainer has them (docker-stacks' convention: chgrp 0, chmod g=u)."""
    where = "/home/trainer /workspace"
    assert root_host.check_output(f"find {where} ! -group 0 | head -5") == ""
    for bit in ("r", "w", "x"):
        odd = root_host.check_output(f"find {where} -perm -u={bit} ! -perm -g={bit} | head -5")
        assert odd == "", f"the owner may {bit} but group 0 may not: {odd}"


def test_the_launch_contract_prints_a_single_node_launch(host: Host) -> None:
    cmd = host.run("pytorch-cuda-launch --print /etc/hostname")
    assert cmd.rc == 0 and "source: single-node" in cmd.stdout.splitlines(), cmd.stdout + cmd.stderr


def test_runs_as_root_when_asked(image_ref: str) -> None:
    proc = run_image(image_ref, ["id", "-u"], ("--user", "0", "-e", "PYTORCH_CUDA_NO_BANNER=1"))
    assert proc.returncode == 0 and proc.stdout.strip() == "0", shown(proc)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_on_path(host: Host, command: str) -> None:
    assert host.exists(command), f"{command} is not on PATH"


def test_entrypoint_and_cmd(image_attrs: dict) -> None:
    config = image_attrs["Config"]
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "pytorch-cuda-entrypoint"]
    assert config["Cmd"] == ["bash"]
    assert config["User"] == "1000:1000"  # numeric: runAsNonRoot can verify it; the name is trainer
    assert config["WorkingDir"] == "/workspace"


def test_nvidia_environment(host: Host, row: matrix.Image) -> None:
    env = host.environment()
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    assert env["NVIDIA_REQUIRE_CUDA"] == f"cuda>={row.cuda}"
    venv_first = env["PATH"].removeprefix("/usr/local/cuda/bin:") if row.flavor == "devel" else env["PATH"]
    assert venv_first.startswith("/opt/venv/bin:"), env["PATH"]


def test_labels_equal_the_lock(image_attrs: dict, expected_labels: dict) -> None:
    labels = image_attrs["Config"]["Labels"]
    wrong = {k: (v, labels.get(k)) for k, v in expected_labels.items() if labels.get(k) != v}
    assert not wrong, f"label: (expected, actual): {wrong}"
    assert labels.get("org.opencontainers.image.revision")
    assert labels.get("org.opencontainers.image.created", "").endswith("Z")
    assert labels.get("org.opencontainers.image.base.digest", "").startswith("sha256:")


def test_manifest_equals_rendered(host: Host, row: matrix.Image, lock_meta: dict, project_root: Path) -> None:

    baked = json.loads(host.file("/opt/pytorch-cuda/manifest.json").content_string)
    committed = json.loads((project_root / "images" / row.name / "manifest.json").read_text())
    assert {k: v for k, v in baked.items() if k in committed} == committed
    assert render.manifest(row, lock_meta) == committed


def test_installed_versions_come_from_the_lock(host: Host, row: matrix.Image, lock_meta: dict, project_root: Path) -> None:
    """Every package pip reports installed is the version the lock pins (and nothing unpinned)."""

    out = host.check_output("pip list --format=json --disable-pip-version-check")
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}
    pins = dict(lock_meta["pins"])
    if row.flavor == "devel" and row.toolkit is not None and row.toolkit.source == "pypi":  # nvcc & co. from toolkit.lock
        pins.update(resolve_pypi.pins((project_root / "images" / row.name / "toolkit.lock").read_text()))
    if row.flavor == "train":  # the extras and what they add, and the sdists compiled in te-builder
        pins.update(lock_meta["extras"][row.platform]["pins"])
        pins.update(lock_meta["extras"][row.platform]["built"])
    # Everything must be pinned (pip and uv too: users install with them).
    extra = {n: v for n, v in installed.items() if n not in pins}
    assert not extra, f"installed but not in the lock: {extra}"
    differ = {n: (v, installed.get(n)) for n, v in pins.items() if installed.get(n) != v and n != "setuptools"}
    assert not differ, f"lock pin vs installed: {differ}"


# Root's own writes into the venv, after the environment is complete: the runtime package's path
# entry and JupyterLab's server config (runtime.j2). Users need not change either.
VENV_ROOT_FILES = {"/opt/venv/etc/jupyter/jupyter_server_config.py", "/opt/venv/lib/python{python}/site-packages/pytorch_cuda_runtime.pth"}


def test_the_venv_is_the_users_and_group_0_may_write_it_too(root_host: Host, row: matrix.Image) -> None:
    """pip and uv as uid 1000 and as any uid in group 0 (docs/extending.md): every entry of the venv
    is 1000:0, and group 0 has the owner's rights, except root's few files named above."""
    allowed = {f.format(python=row.python) for f in VENV_ROOT_FILES}
    odd = set(root_host.check_output("find /opt/venv \\( ! -user 1000 -o ! -group 0 \\) -print").splitlines()) - allowed
    assert not odd, f"not 1000:0: {sorted(odd)[:8]}"
    for bit in ("r", "w", "x"):
        odd = set(root_host.check_output(f"find /opt/venv ! -type l -perm -u={bit} ! -perm -g={bit} -print").splitlines()) - allowed
        assert not odd, f"the owner may {bit} but group 0 may not: {sorted(odd)[:8]}"


def test_pip_and_uv_hold_the_tested_stack(host: Host, row: matrix.Image, lock_meta: dict) -> None:
    """PIP_CONSTRAINT and UV_CONSTRAINT name the constraints file, which pins torch, triton, DeepSpeed
    and every nvidia-*/cuda-* wheel at the installed (locked) version; uv is at its pin."""
    env = dict(line.split("=", 1) for line in host.check_output("env").splitlines() if "=" in line)
    assert env.get("PIP_CONSTRAINT") == env.get("UV_CONSTRAINT") == "/opt/pytorch-cuda/constraints.txt"
    pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+)$", host.file("/opt/pytorch-cuda/constraints.txt").content_string, re.M))
    locked = lock_meta["pins"]
    want = {n: v for n, v in stack.protected(locked).items() if n != "deepspeed"}  # deepspeed: against the row, below
    assert {n: v for n, v in pins.items() if n != "deepspeed" and n in locked} == want
    assert pins["deepspeed"] == row.deepspeed
    cmd = host.run("python -m pytorch_cuda_runtime.stack check")
    assert cmd.rc == 0, cmd.stdout + cmd.stderr
    assert host.check_output("uv --version").split()[1] == locked["uv"]


def test_pip_check_passes(host: Host) -> None:
    cmd = host.run("pip check")
    assert cmd.rc == 0, cmd.stdout + cmd.stderr


def test_ds_report_shows_every_prebuilt_op_installed_for_cuda(host: Host, row: matrix.Image) -> None:
    out = host.run("DS_ACCELERATOR=cuda ds_report")
    assert out.rc == 0, out.stderr
    for op in row.prebuilt_ops:
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(op + " ")), "")
        assert "[YES]" in line, f"{op} not prebuilt: {line!r}"


LOAD_OPS = """
import json, os, sys
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import accelerator_name, installed_ops
from deepspeed.ops.op_builder.all_ops import ALL_OPS
loaded = {}
for op in sys.argv[1].split(","):
    builder = get_accelerator().create_op_builder(type(ALL_OPS[op]).__name__)
    loaded[op] = bool(builder.load(verbose=False))
built = [os.path.join(r, f) for r, _, fs in os.walk(os.environ["TORCH_EXTENSIONS_DIR"]) for f in fs]
print(json.dumps({"accelerator": get_accelerator()._name, "wheel": accelerator_name, "loaded": loaded, "built": built}))
"""


def test_prebuilt_cuda_ops_load_without_a_gpu_and_compile_nothing(host: Host, row: matrix.Image) -> None:
    """What DeepSpeed does on every GPU host (accelerator `cuda`), minus the GPU: loading a CUDA
    extension needs none. A JIT build would leave files in the empty TORCH_EXTENSIONS_DIR."""
    cmd = host.run(f"d=$(mktemp -d) && DS_ACCELERATOR=cuda TORCH_EXTENSIONS_DIR=$d python -c '{LOAD_OPS}' {','.join(row.prebuilt_ops)}")
    assert cmd.rc == 0, cmd.stdout[-2000:] + cmd.stderr[-3000:]
    facts = json.loads(cmd.stdout.strip().splitlines()[-1])
    assert facts["accelerator"] == facts["wheel"] == "cuda", facts
    assert facts["loaded"] == {op: True for op in row.prebuilt_ops}, facts
    assert facts["built"] == [], f"compiled at run time: {facts['built']}"


def test_ops_were_built_for_every_torch_arch_the_toolkit_compiles(host: Host) -> None:
    facts = json.loads(host.file("/opt/pytorch-cuda/ops-facts.json").content_string)
    torch_archs = json.loads(host.file("/opt/pytorch-cuda/torch-facts.json").content_string)["cuda_arch_list"]
    built = {a.replace(".", "") for a in facts["ops_arch_list"].removesuffix("+PTX").split(";")}
    skipped = {a.replace(".", "") for a in facts["ops_arch_not_compiled"]}
    wanted = {a.split("_")[1] for a in torch_archs if a.startswith("sm_")}
    assert built | skipped == wanted and built, (facts, torch_archs)
    assert facts["ops_arch_list"].endswith("+PTX"), "newer GPUs need the PTX of the newest arch"


def test_deepspeed_has_the_zero3_all_gather_fix(host: Host, row: matrix.Image) -> None:
    """DeepSpeed PR #8539: a coalesced ZeRO-3 gather waits on every gloo handle (patched into 0.17.6)."""
    text = host.file(f"/opt/venv/lib/python{row.python}/site-packages/deepspeed/runtime/zero/partition_parameters.py").content_string
    assert "launch_handles[-1].wait()" not in text and "for handle in launch_handles:" in text


def test_torch_compile_has_its_compiler_and_headers(host: Host, row: matrix.Image) -> None:
    """Inductor (CPU) and Triton (GPU) compile at run time: a C++ compiler and Python.h must be there."""
    for cc in ("gcc", "g++", "cc", "c++"):
        assert host.exists(cc), f"{cc} missing: torch.compile needs it"
    inc = host.check_output("python -c 'import sysconfig; print(sysconfig.get_paths()[\"include\"])'")
    assert host.file(f"{inc}/Python.h").exists
    assert host.exists("nvcc") == (row.flavor == "devel"), "nvcc belongs to the devel flavor only"


TORCH_COMPILE = """
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
x = torch.randn(8, 16)
eager = m(x)
compiled = torch.compile(m)(x)
torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
print("COMPILED_OK")
"""


def test_torch_compile_matches_eager_on_the_cpu(host: Host) -> None:
    cmd = host.run(f"TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -c '{TORCH_COMPILE}'")
    assert cmd.rc == 0 and "COMPILED_OK" in cmd.stdout, cmd.stdout[-2000:] + cmd.stderr[-3000:]


@pytest.mark.parametrize("path", ["/root/.cache", "/wheelhouse", "/dist", "/opscache", "/debs", "/run/secrets"])
def test_no_caches_or_secrets_left(root_host: Host, path: str) -> None:
    # BuildKit leaves mount targets behind as empty directories; their content must not ship.
    files = root_host.run(f"find {path} -mindepth 1 2>/dev/null | head -5").stdout.strip()
    assert not files, f"{path} is not empty in the image: {files}"


def test_trainer_cache_holds_only_the_prebuilt_cpu_ops(root_host: Host, host: Host, row: matrix.Image) -> None:

    """DeepSpeed's CPU-accelerator ops, compiled at build time, are the only thing in ~trainer/.cache."""
    assert root_host.check_output("ls -A /home/trainer/.cache") == "torch_extensions"
    assert host.environment()["PYTORCH_CUDA_CPU_OPS"] == f"/home/trainer/.cache/torch_extensions/{render.torch_ext_folder(row)}"
    libs = root_host.check_output("cd /home/trainer/.cache/torch_extensions && ls */*/*.so").split()
    assert sorted(p.split("/")[1] for p in libs) == sorted(render.CPU_OPS.values()), libs
    assert root_host.check_output("find /home/trainer/.cache ! -user trainer | wc -l") == "0"


def test_cpu_accelerator_ops_are_built_for_the_cpu_baseline(root_host: Host, row: matrix.Image) -> None:
    """The CPU Adam ops baked into the image, and any op DeepSpeed JIT-builds later, target the
    matrix's CPU baseline, not the build host's CPU (-march=native gives AVX-512 on an AVX-512
    builder, and SIGILL on a node without it). shm_comm takes no -march and carries its own
    AVX-512 paths by DeepSpeed's design (docs/limits.md)."""
    ext = "/home/trainer/.cache/torch_extensions/*"
    for op in ("cpu_adam", "fused_adam"):
        cflags = root_host.check_output(f"grep '^cflags' {ext}/{op}/build.ninja")
        assert "-march=native" not in cflags and f"-march={row.cpu_arch}" in cflags, cflags
        simd = SIMD[row.cpu_arch]
        assert simd in cflags and "-D__SCALAR__" not in cflags, cflags
        if row.cpu_arch in BEYOND:
            dis = root_host.check_output(f"objdump -d {ext}/{op}/{op}.so")
            pattern, what = BEYOND[row.cpu_arch]
            assert dis and not re.search(pattern, dis), f"{op} has {what} instructions beyond {row.cpu_arch}"
    # Located without importing deepspeed, whose import logs to stdout.
    package = root_host.check_output("python -c 'import importlib.util as u; print(u.find_spec(\"deepspeed\").submodule_search_locations[0])'")
    builder = root_host.file(f"{package}/ops/op_builder/builder.py").content_string
    assert "-march=native" not in builder
    # the SIMD define is the baseline's, not what the host's CPU flags said (opsbuild.patch)
    assert f"def simd_width(self):\n        return '{simd}'" in builder


def test_ninja_logs_of_the_baked_ops_are_in_their_reproducible_form(root_host: Host) -> None:
    """ninja's logs beside the baked ops hold no build times (ninjalogs.py), or two builds of
    the image differ in them and `verify` finds different digests."""
    ext = root_host.environment()["PYTORCH_CUDA_CPU_OPS"]
    for op in render.CPU_OPS.values():
        log = root_host.file(f"{ext}/{op}/.ninja_log").content_string
        assert ninjalogs.normalize_build_log(log) == log, f"{op}/.ninja_log:\n{log}"
        deps = root_host.file(f"{ext}/{op}/.ninja_deps").content
        assert ninjalogs.normalize_deps_log(deps) == deps, f"{op}/.ninja_deps is not in canonical form"


def test_files_the_baked_ops_compiled_from_carry_the_reproducible_epoch(root_host: Host) -> None:
    """Every file under a site-packages include/ directory (torch's headers, read through
    -isystem, which .ninja_deps leaves out) and every DeepSpeed csrc file the CPU ops' compiles
    read (their .ninja_deps) has matrix.REPRODUCIBLE_EPOCH as its mtime. pip gives installed files
    the time of the install; GCC's #pragma once takes two headers of equal size, mtime (seconds)
    and contents for one, and torch ships such twins, so with install times the ops' objects
    depended on whether pip wrote a pair within one second."""
    ext = root_host.environment()["PYTORCH_CUDA_CPU_OPS"]
    deps: set[str] = set()
    for op in render.CPU_OPS.values():
        deps |= ninjalogs.deps_inputs(root_host.file(f"{ext}/{op}/.ninja_deps").content)
    read = sorted(p for p in deps if "/site-packages/" in p)
    assert any("/site-packages/deepspeed/ops/csrc/includes/" in p for p in read), read[:20]
    package = read[0].split("/site-packages/")[0] + "/site-packages"
    listing = root_host.check_output(
        f"find {package} \\( -path '*/site-packages/*/include/*' -o -path '*/deepspeed/ops/csrc/*' \\) -type f -printf '%T@ %p\\n'")
    mtimes = {p: float(t) for t, p in (line.split(" ", 1) for line in listing.splitlines())}
    assert len(mtimes) > 1000 and not set(read) - set(mtimes), sorted(set(read) - set(mtimes))[:5]
    others = sorted((p, t) for p, t in mtimes.items() if t != REPRODUCIBLE_EPOCH)
    assert not others, f"{len(others)} file(s) not at {REPRODUCIBLE_EPOCH}: {others[:5]}"


CPU_OPS_UP_TO_DATE = """
import os, time
from deepspeed.accelerator import get_accelerator
t0 = time.time()
for b in ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(b).load(verbose=False)
print("LOADED_IN", round(time.time() - t0, 1))
"""


def test_cpu_accelerator_ops_load_as_built_without_recompiling(host: Host) -> None:
    """As the default user, DS_ACCELERATOR=cpu loads the baked ops: no library is rebuilt."""
    before = host.check_output("cd ~/.cache/torch_extensions && stat -c '%n %Y' */*/*.so")
    cmd = host.run(f"DS_ACCELERATOR=cpu python -c '{CPU_OPS_UP_TO_DATE}'")
    assert cmd.rc == 0 and "LOADED_IN" in cmd.stdout, cmd.stdout[-2000:] + cmd.stderr[-3000:]
    assert host.check_output("cd ~/.cache/torch_extensions && stat -c '%n %Y' */*/*.so") == before


def test_no_apt_lists_or_debs(root_host: Host) -> None:
    assert root_host.check_output("find /var/lib/apt/lists /var/cache/apt -type f -name '*_*' | wc -l") == "0"


def test_history_and_config_carry_no_secret(image_attrs: dict, docker_client: docker.DockerClient, image_ref: str) -> None:
    ca_paths = ("ca-certificates.crt", "/run/secrets", "PIP_CERT=/")
    history = json.dumps(docker_client.api.history(image_ref))
    config = json.dumps(image_attrs["Config"])
    for needle in ca_paths[:1]:
        assert needle not in config, f"{needle} in image config"
    assert "src=" not in history and "BEGIN CERTIFICATE" not in history + config


def test_zero_to_fp32_command_works(host: Host) -> None:
    out = host.run("zero_to_fp32 --help")
    assert out.rc == 0 and "checkpoint" in out.stdout.lower(), out.stdout + out.stderr


RDMA_LOAD = """
import ctypes, glob
for lib in ("libibverbs.so.1", "librdmacm.so.1"):
    ctypes.CDLL(lib)
providers = sorted(p.split("/")[-1] for p in glob.glob("/usr/lib/x86_64-linux-gnu/libibverbs/lib*-rdmav*.so"))
for p in providers:
    ctypes.CDLL("/usr/lib/x86_64-linux-gnu/libibverbs/" + p)
print(" ".join(providers))
"""


def test_rdma_user_space_loads_with_its_providers(host: Host) -> None:
    """NCCL's IB/RoCE transport dlopens libibverbs (and librdmacm); the verbs providers
    (mlx5, efa, ...) must load too, or it sees no device and falls back to sockets."""
    cmd = host.run(f"python -c '{RDMA_LOAD}'")
    assert cmd.rc == 0, cmd.stderr[-2000:]
    assert {"libmlx5-rdmav34.so", "libefa-rdmav34.so"} <= set(cmd.stdout.split()), cmd.stdout


def test_no_ssh_host_key_ships(root_host: Host) -> None:
    """openssh-server's postinst makes host keys; a key baked into a layer would be every container's.
    sshd mode generates a container's own at start."""
    keys = root_host.run("find / -xdev -name 'ssh_host_*key*' 2>/dev/null").stdout.strip()
    assert not keys, f"ssh host keys in the image: {keys}"


def test_sshd_keeps_its_keys_where_strict_modes_accepts_them(root_host: Host) -> None:
    """sshd's StrictModes refuses a key file below a directory that group or others may write,
    and the home is group-writable for any uid: sshd mode's directory is the user's own, 0700,
    below root's directories."""
    d = root_host.file("/var/lib/pytorch-cuda/sshd")
    assert (d.is_directory, d.uid, d.mode) == (True, 1000, 0o700)
    for parent in ("/var/lib/pytorch-cuda", "/var/lib", "/var"):
        f = root_host.file(parent)
        assert f.uid == 0 and f.mode & 0o022 == 0, f"{parent}: uid {f.uid}, mode {oct(f.mode)}"


def test_servers_are_configured_for_auth(host: Host) -> None:
    """JupyterLab's config sets where it serves from, never its token; the login profile restores the venv."""
    conf = host.file("/opt/venv/etc/jupyter/jupyter_server_config.py").content_string
    assert 'c.ServerApp.root_dir = "/workspace"' in conf and "token" not in conf.split("c = get_config")[1].lower()
    assert host.file("/etc/profile.d/pytorch-cuda.sh").exists
    assert host.run("bash -lc 'command -v python'").stdout.strip() == "/opt/venv/bin/python"


def test_banner_prints_versions_and_cpu_warning(image_ref: str, row: matrix.Image, lock_meta: dict) -> None:
    proc = run_image(image_ref, ["true"], ("--shm-size", "64m"))
    assert proc.returncode == 0, shown(proc)
    banner = proc.stderr
    for fact in (row.torch, row.cuda, row.wheel_cuda, row.deepspeed, f"built with CUDA {lock_meta['cuda_toolkit']}", *row.prebuilt_ops):
        assert fact in banner, f"{fact} missing from banner:\n{banner}"
    assert "--gpus all" in banner  # no GPU: says how to get one
    assert "shm" in banner.lower()  # 64 MB /dev/shm: says how to fix it
    assert "InfiniBand/RoCE: no devices visible" in banner
    assert proc.stdout == ""  # banner never pollutes stdout


def test_banner_can_be_silenced(image_ref: str) -> None:
    proc = run_image(image_ref, ["echo", "hi"], ("-e", "PYTORCH_CUDA_NO_BANNER=1"))
    assert proc.returncode == 0 and proc.stdout == "hi\n" and proc.stderr == "", shown(proc)


def test_no_user_in_etc_shadow_records_the_day_of_the_build(root_host: Host) -> None:
    """The last password change of every account, the base's and those the build adds (openssh's
    sshd, the image's user), is the fixed epoch's day: useradd and adduser take SOURCE_DATE_EPOCH.
    The day of the build in /etc/shadow made every build of a commit on another UTC day another image."""
    day = str(REPRODUCIBLE_EPOCH // 86400)
    for name in ("/etc/shadow", "/etc/shadow-"):  # readable by root only
        cmd = root_host.run(f"cut -d: -f1,3 {name}")
        if name.endswith("-") and cmd.rc != 0:
            continue  # no backup where no step rewrote the file
        assert cmd.rc == 0, cmd.stderr
        other = [line for line in cmd.stdout.split() if line.split(":")[1] not in ("", day)]
        assert not other, f"{name}: last change not {day} (the epoch's day): {other}"


def test_the_debian_packages_are_exactly_the_locked_ones(host: Host, row: matrix.Image, lock_meta: dict) -> None:
    """The image holds every Debian package lock.json `debian` names at that exact version (the
    base's and the apt step's .debs, debs.lock), and no other: nothing was upgraded, added or left
    out at build time. The security suite's fixes arrive by relocking (docs/security.md)."""
    locked = lock_meta.get("debian", {})
    assert locked, "the lock names no Debian packages: run `build.py lock`"
    cmd = host.run("dpkg-query -W -f='${db:Status-Status} ${Package} ${Version}\\n'")
    assert cmd.rc == 0, cmd.stderr
    held = {name: version for status, name, version in (line.split(" ", 2) for line in cmd.stdout.splitlines()) if status == "installed"}
    wrong = sorted(f"{n} {held.get(n, 'absent')} (locked: {locked.get(n, 'not locked')})"
                   for n in set(held) | set(locked) if held.get(n) != locked.get(n))
    assert not wrong, "Debian packages not as locked: " + "; ".join(wrong[:10])
    if row.os.updates:
        assert host.file("/etc/apt/sources.list.d/updates.list").contains(row.os.updates[0].suite)


def test_debian_packages_are_the_locked_versions(host: Host, row: matrix.Image, lock_meta: dict) -> None:
    for name in row.os.packages:
        pkg = host.package(name)
        assert pkg.is_installed and pkg.version == lock_meta["apt"][name], (name, pkg.version, lock_meta["apt"][name])


PREFLIGHT_OPTS = ("--shm-size", "1g", "-e", "PYTORCH_CUDA_NO_BANNER=1", "-e", "PYTORCH_CUDA_NPROC_PER_NODE=2")


def test_the_preflight_passes_on_two_cpu_ranks_and_prints_the_table_and_its_json_report(image_ref: str) -> None:
    """One node, two gloo ranks: the node's checks, then all_reduce and all_gather as nccl-tests
    prints them; the JSON report has the same rows. About 30 s natively; the bound leaves room for
    an emulated arm64 image (emulation costs about 12x, docs/arm64.md)."""
    proc = run_image(image_ref, ["sh", "-c", "cd /tmp && pytorch-cuda-preflight --report pf.json && cat pf.json"],
                     PREFLIGHT_OPTS, timeout=600)
    assert proc.returncode == 0, shown(proc)
    assert "pytorch-cuda-preflight: passed" in proc.stderr, shown(proc)
    out = proc.stdout
    assert "# all_reduce: 2 ranks on 1 node (gloo, cpu)" in out and "# all_gather: 2 ranks on 1 node (gloo, cpu)" in out, shown(proc)
    assert "# busbw = algbw * 2(n-1)/n, n = 2 ranks" in out and "# busbw = algbw * (n-1)/n, n = 2 ranks" in out
    report = json.loads(out[out.index("\n{") + 1:])
    assert report["passed"] and report["backend"] == "gloo" and report["ranks"] == 2
    for op in ("all_reduce", "all_gather"):
        rows = report[op]
        assert [r["size"] for r in rows][:2] == [1024, 4096] and all(r["wrong"] == 0 and r["busbw"] > 0 for r in rows), rows
    assert report["node_checks"][0].startswith("node ") and "requested 0 GPU(s) per node" in report["node_checks"][0]


def test_the_preflight_refuses_an_old_driver_and_a_missing_gpu_in_one_line_each_before_any_rank(image_ref: str) -> None:
    """Stand-in GPUs through the test hook (PYTORCH_CUDA_PREFLIGHT_STANDIN): one GPU of two, its
    driver below the row's floor. Both lines, exit 1, and no fabric step (no table)."""
    standin = '{"*": [{"name": "stand-in GPU", "driver": "470.57.02", "capability": "9.0"}]}'
    script = f"echo '{standin}' > /tmp/s.json && PYTORCH_CUDA_PREFLIGHT_STANDIN=/tmp/s.json pytorch-cuda-preflight --gpus-per-node 2"
    proc = run_image(image_ref, ["sh", "-c", script], PREFLIGHT_OPTS, timeout=120)
    assert proc.returncode == 1, shown(proc)
    failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("pytorch-cuda-preflight: FAILED: ")]
    assert len(failed) == 3 and failed[-1].endswith("training not started"), shown(proc)
    assert "1 GPU visible (stand-in GPUs (PYTORCH_CUDA_PREFLIGHT_STANDIN=s.json), not a driver: 1 listed), the job requested 2" \
        in failed[0], shown(proc)
    assert "driver 470.57.02 (stand-in GPUs" in failed[1] and "older than 525.60.13" in failed[1], shown(proc)
    assert "all_reduce" not in proc.stdout


def test_the_preflight_names_each_faulty_gpu_through_the_fake_nvml_and_stand_in_figures(image_ref: str) -> None:
    """The GPU part in the image with its stand-ins (preflight/fakenvml.py and stand-in GPUs with
    figures): three GPUs, the second with a pending row remap and a slowdown, the third slow and
    wrong. One line per fault, each naming the node and the GPU by index and serial; the table
    and the report hold them; a check named in --warn only warns. No rank starts."""
    gpu = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "capability": "9.0", "tflops": 700.0}
    standin = {"*": [gpu, gpu, {**gpu, "tflops": 300.0, "corrupt": True}]}
    nvml = {"*": [{}, {"remapped_rows": [0, 1, 1, 0], "reasons": 0x41}, {"temperature": 95}]}
    script = (f"cd /tmp && echo '{json.dumps(standin)}' > s.json && echo '{json.dumps(nvml)}' > n.json && "
              "PYTORCH_CUDA_PREFLIGHT_STANDIN=/tmp/s.json PYTORCH_CUDA_PREFLIGHT_FAKE_NVML=/tmp/n.json "
              "pytorch-cuda-preflight --gpus-per-node 3 --warn temperature --report pf.json; echo rc=$?; cat pf.json")
    proc = run_image(image_ref, ["sh", "-c", script], PREFLIGHT_OPTS, timeout=120)
    assert "rc=1" in proc.stdout, shown(proc)
    failed = [ln.split("FAILED: ", 1)[1] for ln in proc.stderr.splitlines() if "pytorch-cuda-preflight: FAILED: node " in ln]
    checks = sorted(ln.rsplit("[", 1)[1].rstrip("]") for ln in failed)
    assert checks == ["compute-checksum", "compute-peak", "compute-slow", "row-remap", "throttle"], shown(proc)
    assert all(" GPU 1 (serial 1650922000001): " in ln for ln in failed if "[row-remap]" in ln or "[throttle]" in ln)
    assert all(" GPU 2 (serial 1650922000002): " in ln for ln in failed if "[compute-" in ln)
    assert any("warning: node " in ln and "GPU 2 (serial 1650922000002): 95 C" in ln for ln in proc.stderr.splitlines())
    assert "# all_reduce" not in proc.stdout  # no rank started
    report = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])
    assert not report["passed"] and [r["failed"] for r in report["gpus"]["rows"]] == [
        [], ["row-remap", "throttle"], ["compute-checksum", "compute-peak", "compute-slow", "temperature (warning)"]]
