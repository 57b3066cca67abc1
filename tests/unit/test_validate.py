"""validate.py: every argument of build.py checked before Docker, the network, a lock or the
disk is touched. Each bad value, missing file and flag that does nothing (or contradicts
another) is one `error:` line naming the argument, exit 2, and nothing else happens: the
`untouched` fixture turns every way out of this process into an AssertionError."""
from __future__ import annotations

import argparse
import builtins
import io
import os
import socket
import subprocess

import certifi
import filelock
import pytest
import requests

from pytorch_cuda_build import arguments, cli, files, matrix, rules, spec
from pytorch_cuda_build import validate as stage
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.registry import client as registry

from helpers import ROOT, one_error_line, run_cli

NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTORCH_CUDA_REGISTRY": ""}
REG = ["--push", "--registry", "127.0.0.1:5000/ml"]
SNAPSHOT = str(ROOT / "tests" / "data" / "security")
DIGEST_REF = "127.0.0.1:5000/ml/pytorch-cuda@sha256:" + "0" * 64
JOB = ["job", "--torch", "2.7", "--nodes", "2", "--image", DIGEST_REF]  # + a scheduler, then the option, then SCRIPT
SLURM, K8S = [*JOB, "--scheduler", "slurm"], [*JOB, "--scheduler", "kubernetes", "--kind", "jobset"]


@pytest.fixture
def paths(tmp_path):
    """What the cases' {placeholders} name: a PEM bundle, a file that is not one, folders."""
    (tmp_path / "not.pem").write_text("not a certificate\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    return {"pem": certifi.where(), "notpem": str(tmp_path / "not.pem"), "dir": str(tmp_path),
            "full": str(tmp_path / "full"), "matrix": str(ROOT / "matrix.yaml")}


@pytest.fixture
def untouched(paths, monkeypatch):
    """Docker, processes, sockets, locks and writes all fail the test (and are recorded, in case
    a caller swallows the AssertionError). paths is made first: its files are the test's own, and
    monkeypatch, set up after it, is undone before pytest removes them (a passed test's folder goes)."""
    calls = []

    def refuse(what):
        def called(*a, **kw):
            calls.append(what)
            raise AssertionError(f"{what} called during argument validation")
        return called

    for owner, name in [(docker_env, "ensure_engine"), (docker_env, "client"), (docker_env, "build_client"),
                        (files, "writer_lock"), (files, "write_atomic"), (files, "write_all_atomic"),
                        (filelock.FileLock, "acquire"), (subprocess, "run"), (subprocess, "Popen"),
                        (socket.socket, "connect"), (socket, "create_connection"), (requests.Session, "request"),
                        (os, "mkdir"), (os, "replace"), (os, "rename"), (os, "unlink")]:
        monkeypatch.setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    real_open, real_os_open = builtins.open, os.open

    def reading_open(file, mode="r", *a, **kw):
        if set(mode) & set("wax+"):
            refuse(f"open({file!r}, {mode!r})")()
        return real_open(file, mode, *a, **kw)

    def reading_os_open(path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(f"os.open({path!r})")()
        return real_os_open(path, flags, *a, **kw)
    monkeypatch.setattr(builtins, "open", reading_open)
    monkeypatch.setattr(io, "open", reading_open)
    monkeypatch.setattr(os, "open", reading_os_open)
    yield calls
    assert calls == []


# (what, argv, the error line holds). Each value-taking option's bad-value cases say which
# option they cover in VALUE_CASES below; a new option without one fails the completeness test.
VALUE_CASES = {
    ("", "--matrix"): [(["--matrix", "/nonexistent/matrix.yaml", "list"], "cannot read matrix file /nonexistent/matrix.yaml"),
                       (["--matrix", "{dir}", "list"], "Is a directory")],
    **{(cmd, "--torch"): [([cmd, "--torch", "2.x", *extra], "--torch takes a torch version like 2.7 or 2.7.1, not '2.x'")]
       for cmd, extra in [("build", []), ("publish", REG), ("lock", []), ("test", []), ("verify", []), ("record", []), ("base", []), ("bench", []),
                          ("gpu-bundle", ["{dir}/b"]), ("job", ["--scheduler", "slurm", "--nodes", "2", "t.py"]), ("fetch", [])]},
    **{(cmd, "--cuda"): [([cmd, "--torch", "2.7", "--cuda", "cu121", *extra], "--cuda takes a CUDA version like 12.1, not 'cu121'")]
       for cmd, extra in [("build", []), ("publish", REG), ("lock", []), ("test", []), ("verify", []), ("record", []), ("base", []), ("bench", []),
                          ("gpu-bundle", ["{dir}/b"]), ("job", ["--scheduler", "slurm", "--nodes", "2", "t.py"]), ("fetch", [])]},
    **{(cmd, "--flavor"): [([cmd, "--torch", "2.7", "--flavor", "slim", *extra], "argument --flavor: invalid choice: 'slim'")]
       for cmd, extra in [("build", []), ("publish", REG), ("lock", []), ("test", []), ("verify", []), ("record", []), ("base", []), ("bench", []),
                          ("gpu-bundle", ["{dir}/b"]), ("job", ["--scheduler", "slurm", "--nodes", "2", "t.py"]), ("fetch", [])]},
    **{(cmd, "--ca-bundle"): [([cmd, *extra, "--ca-bundle", "/nonexistent/ca.pem"], "cannot read CA bundle /nonexistent/ca.pem"),
                              ([cmd, *extra, "--ca-bundle", "{notpem}"], "holds no PEM certificate"),
                              ([cmd, *extra, "--ca-bundle", "{dir}"], "Is a directory")]
       for cmd, extra in [("build", ["--torch", "2.7"]), ("matrix", ["--propose"]), ("publish", ["--torch", "2.7", *REG]),
                          ("lock", []), ("verify", ["--torch", "2.7"]), ("bench", ["--torch", "2.7"]), ("engine", []),
                          ("gpu-bundle", ["--torch", "2.7", "{dir}/b"]), ("fetch", ["--torch", "2.7"])]},
    ("fetch", "--to"): [(["fetch", "--torch", "2.7", "--to", "/nonexistent/dir/inputs"], "--to /nonexistent/dir/inputs: /nonexistent/dir is not a folder"),
                        (["fetch", "--torch", "2.7", "--to", "{notpem}"], "--to {notpem} is not a folder")],
    ("fetch", "--from-image"): [(["fetch", "--torch", "2.7", "--from-image", "pytorch-cuda:v2.7"],
                                 "--from-image takes an image pinned by digest, REPO@sha256:<64 hex>, not 'pytorch-cuda:v2.7'")],
    ("build", "--attach-inputs"): [(["build", "--torch", "2.7", *REG, "--attach-inputs", "wheels"], "argument --attach-inputs: invalid choice: 'wheels'")],
    ("publish", "--attach-inputs"): [(["publish", "--torch", "2.7", *REG, "--attach-inputs", "wheels"], "argument --attach-inputs: invalid choice: 'wheels'")],
    ("fetch", "--from"): [(["fetch", "--torch", "2.7", "--from", "/nonexistent/inputs"], "--from /nonexistent/inputs is not a folder"),
                          (["fetch", "--torch", "2.7", "--from", "{notpem}"], "--from {notpem} is not a folder")],
    **{(cmd, "--docker"): [([cmd, "--torch", "2.7", "--docker", "/nonexistent/docker"], "--docker '/nonexistent/docker' is neither")]
       for cmd in ("build", "verify", "record", "base", "bench")},
    **{(cmd, "--registry"): [([cmd, "--torch", "2.7", "--push", "--registry", "https://ghcr.io/acme"], "malformed registry address"),
                             ([cmd, "--torch", "2.7", "--push", "--registry", "127.0.0.1:99999/ml"], "port 99999 is not 1-65535")]
       for cmd in ("build", "publish")},
    **{(cmd, "--retries"): [([cmd, "--torch", "2.7", *REG, "--retries", "0"], "argument --retries: must be at least 1, not 0"),
                            ([cmd, "--torch", "2.7", *REG, "--retries", "many"], "argument --retries: takes a whole number, not 'many'")]
       for cmd in ("build", "publish")},
    **{(cmd, "--allow-vulnerable"): [([cmd, "--torch", "2.7", *REG, "--allow-vulnerable", ""], "--allow-vulnerable takes an advisory ID"),
                                     ([cmd, "--torch", "2.7", *REG, "--allow-vulnerable", "GHSA-1 GHSA-2"], "takes an advisory ID")]
       for cmd in ("build", "publish")},
    **{(cmd, "--compression"): [([cmd, "--torch", "2.7", *REG, "--compression", "zst"], "argument --compression: invalid choice: 'zst'")]
       for cmd in ("build", "publish")},
    ("build", "--jobs"): [(["build", "--all", "--jobs", "0"], "argument --jobs: must be at least 1, not 0"),
                          (["build", "--all", "--jobs", "two"], "argument --jobs: takes a whole number, not 'two'")],
    ("build", "--cache-from"): [(["build", "--torch", "2.7", "--cache-from", "registry,ref=r/c"], "--cache-from 'registry,ref=r/c' is not buildx's")],
    ("build", "--cache-to"): [(["build", "--torch", "2.7", "--cache-to", "ref=r/c,type=registry"], "--cache-to 'ref=r/c,type=registry' is not buildx's")],
    ("build", "--result-json"): [(["build", "--torch", "2.7", "--result-json", "/nonexistent/dir/r.json"], "/nonexistent/dir is not a directory"),
                                 (["build", "--torch", "2.7", "--result-json", "{dir}"], "--result-json {dir} is a directory")],
    ("lock", "--security-snapshot"): [(["lock", "--check-security", "--security-snapshot", "{notpem}"], "--security-snapshot {notpem} is not a folder")],
    **{(cmd, "--platform"): [([cmd, "--torch", "2.11", "--platform", "linux/riscv64", *extra],
                              "argument --platform: invalid choice: 'linux/riscv64'")]
       for cmd, extra in (("build", []), ("test", []), ("verify", []), ("record", []), ("base", []), ("fetch", []),
                          ("publish", ["--registry", "127.0.0.1:5000/ml"]))},
    ("publish", "--sign-key"): [(["publish", "--torch", "2.7", *REG, "--sign-key", "{dir}"], "--sign-key {dir}: no gnupg/ in it"),
                                (["publish", "--torch", "2.7", *REG, "--sign-key", "/nonexistent/key"], "--sign-key /nonexistent/key: no gnupg/")],
    ("publish", "--signatures"): [(["publish", "--torch", "2.7", *REG, "--sign-key", "{dir}", "--signatures", "{notpem}"],
                                   "--signatures {notpem} is not a directory")],
    ("signing-key", "folder"): [(["signing-key", "{dir}/k"], "set PYTORCH_CUDA_SIGN_PASSPHRASE")],  # a file: below
    ("verify", "--image"): [(["verify", "--image", "127.0.0.1:5000/ml/pytorch-cuda:v2.7"], "--image takes an image pinned by digest"),
                            (["verify", "--image", "pytorch-cuda@sha256:abc"], "--image takes an image pinned by digest")],
    ("verify", "--against"): [(["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--against", ""],
                               "--against takes a local image reference or ID, not ''")],
    ("verify", "--record"): [(["verify", "--torch", "2.7", "--record", "/nonexistent/r.json.xz"], "--record /nonexistent/r.json.xz: no such file"),
                             (["verify", "--torch", "2.7", "--record", "{dir}"], "--record {dir}: no such file")],
    ("record", "--image"): [(["record", "--torch", "2.7", "--image", ""], "--image takes an image reference or ID, not ''")],
    ("record", "--output"): [(["record", "--torch", "2.7", "--output", "/nonexistent/dir/r.json.xz"], "/nonexistent/dir is not a directory"),
                             (["record", "--torch", "2.7", "--output", "{dir}"], "--output {dir} is a directory")],
    ("test", "--image"): [(["test", "--torch", "2.7", "--image", ""], "--image takes an image reference or ID, not ''"),
                          (["test", "--torch", "2.7", "--image", "a b"], "--image takes an image reference or ID")],
    ("sbom", "image"): [(["sbom", ""], "IMAGE takes an image reference or ID, not ''")],
    ("sbom", "--output"): [(["sbom", "img", "--output", "/nonexistent/dir/sbom.json"], "--output /nonexistent/dir/sbom.json: /nonexistent/dir is not"),
                           (["sbom", "img", "--output", "{dir}"], "--output {dir} is a directory")],
    ("bench", "--runs"): [(["bench", "--torch", "2.7", "--runs", "0"], "argument --runs: must be at least 1, not 0")],
    ("bench", "--cold-runs"): [(["bench", "--torch", "2.7", "--full", "--yes", "--cold-runs", "-1"], "argument --cold-runs: must be at least 1")],
    ("bench", "--only"): [(["bench", "--torch", "2.7", "--full", "--yes", "--only", "size,bogus"], "--only takes a comma list of"),
                          (["bench", "--torch", "2.7", "--full", "--yes", "--only", ","], "--only takes a comma list of")],
    ("bench", "--pull-rows"): [(["bench", "--torch", "2.7", "--full", "--only", "pull", "--pull-rows", "0"], "argument --pull-rows: must be at least 1, not 0"),
                               (["bench", "--torch", "2.7", "--full", "--only", "pull", "--pull-rows", "1"], "--pull-rows takes 2 to 5 (the matrix's CUDA 13 rows), not 1"),
                               (["bench", "--torch", "2.7", "--full", "--only", "pull", "--pull-rows", "6"], "--pull-rows takes 2 to 5 (the matrix's CUDA 13 rows), not 6")],
    ("engine", "--store"): [(["engine", "--store", "zfs"], "argument --store: invalid choice: 'zfs'")],
    ("gpu-bundle", "DIR"): [(["gpu-bundle", "--torch", "2.7", "{full}"], "{full} exists and is not an empty directory"),
                            (["gpu-bundle", "--torch", "2.7", "/nonexistent/dir/b"], "/nonexistent/dir does not exist")],
    ("gpu-bundle", "--python"): [(["gpu-bundle", "--torch", "2.7", "{dir}/b", "--python", "3"], "--python '3': expected MAJOR.MINOR")],
    ("gpu-bundle", "--limit-mib"): [(["gpu-bundle", "--torch", "2.7", "{dir}/b", "--limit-mib", "0"], "--limit-mib must be at least 1")],
    ("gpu-bundle", "--ops-wheel"): [(["gpu-bundle", "--torch", "2.7", "{dir}/b", "--ops-wheel", "/nonexistent/ds.whl"],
                                     "--ops-wheel /nonexistent/ds.whl: no such file")],
    ("gpu-bundle", "--build-python"): [(["gpu-bundle", "--torch", "2.7", "{dir}/b", "--build-python", "/nonexistent/python3.12"],
                                        "--build-python '/nonexistent/python3.12' is neither a program on PATH nor an executable file")],
    ("gpu-bundle", "--ops-arch"): [(["gpu-bundle", "--torch", "2.7", "{dir}/b", "--ops-arch", "sm_90"],
                                    "--ops-arch 'sm_90': expected TORCH_CUDA_ARCH_LIST's form")],
    ("job", "--scheduler"): [([*JOB, "--scheduler", "lsf", "t.py"], "argument --scheduler: invalid choice: 'lsf'")],
    ("job", "--nodes"): [([*SLURM, "--nodes", "0", "t.py"], "argument --nodes: must be at least 1, not 0"),
                         ([*SLURM, "--nodes", "two", "t.py"], "argument --nodes: takes a whole number, not 'two'")],
    ("job", "--gpus-per-node"): [([*SLURM, "--gpus-per-node", "-1", "t.py"], "argument --gpus-per-node: must be at least 0, not -1")],
    ("job", "--image"): [([*SLURM, "--image", "127.0.0.1:5000/ml/pytorch-cuda:v2.7", "t.py"], "--image takes an image pinned by digest"),
                         ([*SLURM, "--image", "r/x@sha256:abc", "t.py"], "--image takes an image pinned by digest"),
                         ([*SLURM, "--image", "", "t.py"], "--image takes an image pinned by digest")],
    ("job", "--name"): [([*SLURM, "--name", "Train_1", "t.py"], "--name takes a lowercase DNS label"),
                        ([*SLURM, "--name", "x" * 41, "t.py"], "of at most 40 characters")],
    ("job", "--shm-size"): [([*SLURM, "--shm-size", "16GB", "t.py"], "--shm-size takes a size like 16Gi"),
                            ([*SLURM, "--shm-size", "0Gi", "t.py"], "--shm-size takes a size like 16Gi")],
    ("job", "--network"): [([*SLURM, "--network", "ib", "t.py"], "argument --network: invalid choice: 'ib'")],
    ("job", "--socket-ifname"): [([*SLURM, "--socket-ifname", "eth0 eth1", "t.py"], "--socket-ifname takes NCCL_SOCKET_IFNAME's form")],
    ("job", "--output"): [([*SLURM, "--output", "/nonexistent/dir/j.sbatch", "t.py"], "/nonexistent/dir is not a directory")],
    ("job", "--runtime"): [([*SLURM, "--runtime", "docker", "t.py"], "argument --runtime: invalid choice: 'docker'")],
    ("job", "--bundle"): [([*SLURM, "--bundle", "bundles/b", "t.py"], "--bundle takes an absolute path"),
                          ([*SLURM, "--bundle", "/shared/my bundle", "t.py"], "--bundle takes an absolute path")],
    ("job", "--sif"): [([*SLURM, "--runtime", "apptainer", "--sif", "/shared/img.tar", "t.py"], "--sif takes an absolute path to a .sif file"),
                       ([*SLURM, "--runtime", "apptainer", "--sif", "$HOME/img.sif", "t.py"], "--sif takes an absolute path")],
    ("job", "--kind"): [([*JOB, "--scheduler", "kubernetes", "--kind", "deployment", "t.py"], "argument --kind: invalid choice: 'deployment'")],
    ("job", "--rdma"): [([*K8S, "--rdma", "rdma/ib", "t.py"], "--rdma takes RESOURCE=COUNT"),
                        ([*K8S, "--rdma", "rdma/ib=0", "t.py"], "--rdma takes RESOURCE=COUNT")],
    ("job", "--namespace"): [([*K8S, "--namespace", "ML", "t.py"], "--namespace takes a Kubernetes namespace")],
    ("job", "--cluster-runtime"): [([*JOB, "--scheduler", "kubernetes", "--kind", "trainjob", "--cluster-runtime", "Torch", "t.py"],
                                    "--cluster-runtime takes a ClusterTrainingRuntime's name")],
    ("job", "--mount"): [([*K8S, "--mount", "data:/data", "t.py"], "--mount 'data:/data': SOURCE 'data' is relative"),
                         ([*K8S, "--mount", "pvc:data:data", "t.py"], "--mount 'pvc:data:data': TARGET 'data' is relative"),
                         ([*K8S, "--mount", "nfs:srv:/data", "t.py"], "unknown SOURCE kind 'nfs:'"),
                         ([*K8S, "--mount", "pvc:data", "t.py"], "--mount takes SOURCE:TARGET[:ro]"),
                         ([*K8S, "--mount", "/a:/data:rw", "t.py"], "'rw' is no option of a mount"),
                         ([*SLURM, "--mount", "/shared/my data:/data", "t.py"], "holds a blank, quote, backslash, $, : or comma"),
                         ([*K8S, "--mount", "pvc:a:/data", "--mount", "/b:/data", "t.py"], "both mount on /data"),
                         ([*K8S, "--mount", "pvc:a:/dev/shm", "t.py"], "TARGET /dev/shm is /dev/shm, which the job mounts"),
                         ([*SLURM, "--mount", "/a:/etc", "t.py"], "TARGET /etc would hide /etc/hosts")],
    ("job", "--workdir"): [([*SLURM, "--workdir", "src", "t.py"], "--workdir takes an absolute directory"),
                           ([*K8S, "--workdir", "/code/../x", "t.py"], "--workdir takes an absolute directory"),
                           ([*SLURM, "--workdir", "$HOME/src", "t.py"], "--workdir takes an absolute directory")],
    ("job", "--cpus-per-node"): [([*K8S, "--cpus-per-node", "0", "t.py"], "argument --cpus-per-node: must be at least 1, not 0"),
                                 ([*K8S, "--cpus-per-node", "1.5", "t.py"], "argument --cpus-per-node: takes a whole number, not '1.5'")],
    ("job", "--memory-per-node"): [([*K8S, "--memory-per-node", "64GB", "t.py"], "--memory-per-node takes a size like 64Gi or 512Mi"),
                                   ([*K8S, "--memory-per-node", "0Gi", "t.py"], "--memory-per-node takes a size like 64Gi")],
    ("job", "--qos"): [([*K8S, "--qos", "besteffort", "t.py"], "argument --qos: invalid choice: 'besteffort'")],
    ("job", "--image-pull-secret"): [([*K8S, "--image-pull-secret", "Reg_Cred", "t.py"], "--image-pull-secret takes a Secret's name"),
                                     ([*K8S, "--image-pull-secret", "regcred/x", "t.py"], "--image-pull-secret takes a Secret's name"),
                                     ([*K8S, "--image-pull-secret", "a" * 254, "t.py"], "--image-pull-secret takes a Secret's name")],
    ("job", "--deadline"): [([*K8S, "--deadline", "1 day", "t.py"], "--deadline takes a duration of at least 1s like 24h"),
                            ([*K8S, "--deadline", "0s", "t.py"], "--deadline takes a duration of at least 1s"),
                            ([*K8S, "--deadline", "1.5h", "t.py"], "--deadline takes a duration")],
    ("job", "SCRIPT"): [([*SLURM], "job needs SCRIPT [ARGS] after --"),
                        ([*SLURM, "--", "my script.py"], "SCRIPT takes a script path"),
                        ([*SLURM, "--", "-m"], "SCRIPT takes a script path")],
    ("prune", "--keep-storage"): [(["prune", "--keep-storage", "10XB"], "argument --keep-storage: '10XB' is not a size"),
                                  (["prune", "--keep-storage", "GB"], "is not a size")],
}
# Free-form on purpose: pytest checks its own arguments.
NO_BAD_VALUE = {("selftest", "pytest_args"): "passed to pytest as they are"}

# Flags that do nothing where they are given, or contradict each other: the line names both.
COMBINATION_CASES = [
    (["verify"], "verify needs the row: --torch X [--cuda Y], or a published image: --image REPO@sha256:..."),
    (["verify", "--torch", "2.7", "--against", "x"], "--against needs --image or --record"),
    (["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--record", "{notpem}"],
     "--image and --record do not go together"),
    (["verify", "--torch", "2.7", "--record", "{notpem}", "--compile-ops"], "--record and --compile-ops do not go together: --record builds nothing"),
    (["verify", "--torch", "2.11", "--record", "{notpem}", "--platform", "all"], "--record is one image's: give its one --platform, not all"),
    (["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--torch", "2.7"], "--image and --torch do not go together"),
    (["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--compile-ops"], "--image and --compile-ops do not go together: the rebuild always compiles the ops"),
    (["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--flavor", "devel"], "--image and --flavor do not go together"),
    (["verify", "--image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}", "--platform", "all"], "--image names one image: give its one --platform (of an index), not all"),
    (["publish", "--torch", "2.11", "--registry", "127.0.0.1:5000/ml", "--platform", "linux/arm64"],
     "publish --platform takes all (an index of every platform of the row) or this host's linux/amd64, not linux/arm64"),
    (["test", "--torch", "2.11", "--image", "x", "--platform", "all"], "--image names one image: give its one --platform, not all"),
    (["build", "--torch", "2.7", "--jobs", "2"], "--jobs needs --all"),
    (["bench", "--torch", "2.7", "--full", "--only", "size", "--pull-rows", "2"], "--pull-rows picks the rows of the pull measure, and --only leaves it out"),
    (["lock", "--check", "--upgrade"], "--check and --upgrade do not go together"),
    (["build", "--torch", "2.7", "--ca-bundle", "/nonexistent/ca.pem", "--dry-run"], "cannot read CA bundle /nonexistent/ca.pem"),
    (["build", "--torch", "2.7", "--ca-bundle", "{notpem}", "--dry-run"], "--ca-bundle {notpem} holds no PEM certificate"),
    (["build", "--torch", "2.7", *REG, "--allow-vulnerable", ""], "--allow-vulnerable takes an advisory ID"),
    (["build", "--torch", "2.7", "--push", "--registry", "R"], "malformed registry address 'R'"),
    (["build", "--torch", "2.7", "--push"], "no registry"),
    (["publish", "--torch", "2.7"], "no registry"),
    (["publish", *REG], "pick the rows"),
    (["publish", "--all", "--torch", "2.7", *REG], "pick the rows"),
    (["bench", "--torch", "2.7", "--full", "--only", "size,cold"], "need an empty build cache"),
    ([*JOB, "--scheduler", "kubernetes", "t.py"], "--scheduler kubernetes needs --kind"),
    *[(argv, says) for argv, says in [
        ([*SLURM, "--kind", "jobset", "t.py"], "--kind needs --scheduler kubernetes"),
        ([*K8S, "--runtime", "oci", "t.py"], "--runtime needs --scheduler slurm"),
        ([*K8S, "--bundle", "/shared/b", "t.py"], "--bundle needs --scheduler slurm"),
        ([*K8S, "--sif", "/shared/i.sif", "t.py"], "--sif needs --scheduler slurm"),
        ([*SLURM, "--runtime", "pyxis", "--bundle", "/shared/b", "t.py"], "--bundle needs --runtime oci"),
        ([*SLURM, "--sif", "/shared/i.sif", "t.py"], "--sif needs --runtime apptainer"),
        ([*SLURM, "--rdma", "rdma/ib=1", "t.py"], "--rdma needs --scheduler kubernetes"),
        ([*SLURM, "--namespace", "ml", "t.py"], "--namespace needs --scheduler kubernetes"),
        ([*K8S, "--cluster-runtime", "torch-distributed", "t.py"], "--cluster-runtime needs --kind trainjob"),
        ([*SLURM, "--mount", "pvc:code:/code", "t.py"], "--mount 'pvc:code:/code' needs --scheduler kubernetes"),
        ([*K8S, "--workdir", "$SLURM_SUBMIT_DIR/src", "t.py"], "--workdir '$SLURM_SUBMIT_DIR/src' needs --scheduler slurm"),
        ([*SLURM, "--cpus-per-node", "8", "t.py"], "--cpus-per-node needs --scheduler kubernetes"),
        ([*SLURM, "--memory-per-node", "64Gi", "t.py"], "--memory-per-node needs --scheduler kubernetes"),
        ([*SLURM, "--qos", "guaranteed", "t.py"], "--qos needs --scheduler kubernetes"),
        ([*SLURM, "--image-pull-secret", "regcred", "t.py"], "--image-pull-secret needs --scheduler kubernetes"),
        ([*SLURM, "--deadline", "24h", "t.py"], "--deadline needs --scheduler kubernetes"),
        ([*K8S, "--memory-per-node", "16Gi", "t.py"], "--memory-per-node 16Gi must be larger than --shm-size 16Gi"),
        ([*K8S, "--memory-per-node", "1G", "--shm-size", "2048Mi", "t.py"], "--memory-per-node 1G must be larger than --shm-size 2048Mi"),
        ([*K8S, "--qos", "guaranteed", "t.py"], "--qos guaranteed needs --cpus-per-node and --memory-per-node"),
        ([*K8S, "--qos", "guaranteed", "--cpus-per-node", "8", "t.py"], "--qos guaranteed needs --cpus-per-node and --memory-per-node"),
        ([*K8S, "--qos", "guaranteed", "--memory-per-node", "64Gi", "t.py"],
         "--qos guaranteed needs --cpus-per-node and --memory-per-node")]],
    *[(["--matrix", "{matrix}", cmd, *extra], f"--matrix does nothing for `{cmd}`")
      for cmd, extra in [("engine", []), ("sbom", ["img"]), ("selftest", [])]],
]

# The rules over two options, declared with each command's options: (command, *rule).
NEEDS = [(h.options.NAME, *rule) for h in cli.COMMANDS for rule in h.options.NEEDS]
CLASHES = [(h.options.NAME, *rule) for h in cli.COMMANDS for rule in h.options.CLASHES]
ONLY_WITH = [(h.options.NAME, *rule) for h in cli.COMMANDS for rule in h.options.ONLY_WITH]
BASE = {"build": ["--torch", "2.7"], "bench": ["--torch", "2.7"], "publish": ["--torch", "2.7", "--registry", "127.0.0.1:5000/ml"],
        "lock": [], "matrix": [], "engine": [], "job": [*K8S[1:], "t.py"], "fetch": ["--torch", "2.7"]}
GIVE = {"jobs": ["--jobs", "2"], "retries": ["--retries", "2"], "allow_vulnerable": ["--allow-vulnerable", "GHSA-x"],
        "security_snapshot": ["--security-snapshot", SNAPSHOT], "only": ["--only", "size"], "cold_runs": ["--cold-runs", "2"], "pull_rows": ["--pull-rows", "2"],
        "cache_from": ["--cache-from", "type=registry,ref=r/c"], "cache_to": ["--cache-to", "type=registry,ref=r/c"],
        "result_json": ["--result-json", "{dir}/r.json"], "ca_bundle": ["--ca-bundle", "{pem}"], "cuda": ["--cuda", "12.1"],
        "cluster_runtime": ["--kind", "trainjob", "--cluster-runtime", "torch-distributed"], "rdma": ["--rdma", "rdma/ib=1"],
        "platform": ["--platform", "linux/arm64"], "sign_key": ["--sign-key", "{dir}"], "signatures": ["--signatures", "{dir}"], "compression": ["--compression", "zstd"], "deadline": ["--deadline", "24h"],
        "to": ["--to", "{dir}"], "from_": ["--from", "{dir}"], "from_image": ["--from-image", f"127.0.0.1:5000/ml/pytorch-cuda@sha256:{'a' * 64}"],
        "attach_inputs": ["--attach-inputs", "all"]}


def _give(command: str, dest: str, but: str | None = None) -> list[str]:
    """argv that gives dest, with what dest needs (so that the rule under test is the one that fires)."""
    needed = [n for cmd, d, n, _ in NEEDS if cmd == command and d == dest and n != but]
    return GIVE.get(dest, [spec.flag_of(dest)]) + [a for n in needed for a in _give(command, n)]


def _rule_cases():
    for cmd, dest, needed, _ in NEEDS:
        yield pytest.param([cmd, *BASE[cmd], *_give(cmd, dest, but=needed)], f"{spec.flag_of(dest)} needs {spec.flag_of(needed)}",
                           id=f"{cmd}-{dest}-needs-{needed}")
    for cmd, one, other, _ in CLASHES:
        yield pytest.param([cmd, *BASE[cmd], *_give(cmd, one), *_give(cmd, other)],
                           f"{spec.flag_of(one)} and {spec.flag_of(other)} do not go together", id=f"{cmd}-{one}-{other}")


def _filled(items: list[str], paths: dict) -> list[str]:
    return [s.format(**paths) for s in items]


@pytest.mark.parametrize("argv, says", [pytest.param(argv, says, id=f"{cmd or 'global'} {opt} {argv[-1]!r}")
                                        for (cmd, opt), cases in VALUE_CASES.items() for argv, says in cases])
def test_a_bad_value_is_one_line_before_anything_is_touched(untouched, paths, argv, says):
    proc = run_cli(ROOT, *_filled(argv, paths), env=NO_DOCKER)
    one_error_line(proc, 2, says.format(**paths))
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, says", [*COMBINATION_CASES, *_rule_cases()])
def test_a_flag_that_does_nothing_or_contradicts_is_one_line_naming_both(untouched, paths, argv, says):
    proc = run_cli(ROOT, *_filled(argv, paths), env=NO_DOCKER)
    one_error_line(proc, 2, says.format(**paths))
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, says", [
    (["build", "--torch", "2.7", "--push", "--registry", "R", "--allow-vulnerable", ""],
     ["--allow-vulnerable takes an advisory ID", "malformed registry address 'R'"]),
    (["build", "--torch", "two", "--cuda", "x"], ["--torch takes a torch version", "--cuda takes a CUDA version"]),
    (["signing-key", "{notpem}"], ["FOLDER {notpem} is not a directory", "set PYTORCH_CUDA_SIGN_PASSPHRASE"]),
    ([*JOB, "--scheduler", "kubernetes", "--kind", "jobset", "--name", "Bad_Name", "--shm-size", "lots", "--memory-per-node", "8Gi",
      "--", "t.py"],
     ["--name takes a lowercase DNS label", "--shm-size"]),  # the memory-vs-shm check reads --shm-size: skipped
    (["build", "--torch", "2.7", "--dry-run", "--push"], ["--dry-run and --push do not go together"]),  # no "no registry" after it
    # What argparse's types and choices refuse is kept, not the end of the parse: every one is a line.
    (["build", "--all", "--jobs", "0", "--push", "--registry", "127.0.0.1:5000/ml", "--retries", "x"],
     ["argument --jobs: must be at least 1, not 0", "argument --retries: takes a whole number, not 'x'"]),
    (["test", "--flavor", "slim"], ["argument --flavor: invalid choice: 'slim'", "the following arguments are required: --torch"]),
    (["prune", "--keep-storage", "lots", "--matrix", "{matrix}"],  # --matrix goes before the command
     ["argument --keep-storage: 'lots' is not a size", "unrecognized arguments: --matrix"]),
    (["build", "--torch", "2.7", "--flavor", "slim", "--cuda", "x"], ["argument --flavor: invalid choice", "--cuda takes a CUDA version"]),
    # The row is looked up with the rest: a bad registry and a row the matrix lacks are two lines.
    (["publish", "--torch", "9.9", "--registry", "bad"], ["malformed registry address 'bad'", "no row for torch 9.9"]),
    (["build", "--torch", "2.7", "--cuda", "99.0", "--jobs", "0"],
     ["argument --jobs: must be at least 1, not 0", "no row for torch 2.7 with CUDA 99.0"]),  # --jobs refused: not "needs --all" too
    (["build", "--all", "--torch", "9.9", "--jobs", "2"], ["no rows match --torch 9.9"]),
    (["publish", "--torch", "2.7", "--registry", "bad", "--retries", "0"],
     ["argument --retries: must be at least 1, not 0", "malformed registry address 'bad'"]),  # the address does not read --retries
])
def test_every_problem_is_reported_at_once_and_a_check_on_a_refused_argument_is_skipped(untouched, paths, argv, says):
    proc = run_cli(ROOT, *_filled(argv, paths), env=NO_DOCKER)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == len(says), proc.stderr
    for line, want in zip(lines, says):
        assert line.startswith("error: ") and want.format(**paths) in line, proc.stderr


@pytest.mark.parametrize("value", ["soon", "-1", "9999"])
def test_a_bad_retry_backoff_is_one_line_before_anything_is_touched(untouched, value):
    proc = run_cli(ROOT, "publish", "--torch", "2.7", "--registry", "127.0.0.1:5000/ml",
                   env={**NO_DOCKER, "PYTORCH_CUDA_RETRY_BACKOFF": value})
    one_error_line(proc, 2, f"$PYTORCH_CUDA_RETRY_BACKOFF takes seconds from 0 to 600 (the first retry's wait), not {value!r}")


def _value_options() -> set[tuple[str, str]]:
    """(command, option) for every argument of build.py that takes a value, read from the parser."""
    def taking(p: argparse.ArgumentParser, command: str):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from taking(sub, name)
            elif a.nargs != 0 and not isinstance(a, argparse._HelpAction):
                yield command, a.option_strings[0] if a.option_strings else (a.metavar or a.dest)
    return set(taking(cli.parser(), ""))


def test_every_only_with_rule_has_a_case():
    """Each ONLY_WITH row of validate.py fires in COMBINATION_CASES (its message, as written)."""
    said = {says for _, says in COMBINATION_CASES}
    missing = [(dest, other) for _, dest, other, values, _ in ONLY_WITH
               if f"{spec.flag_of(dest)} needs {spec.flag_of(other)} {' or '.join(values)}" not in said]
    assert not missing


def test_every_option_that_takes_a_value_has_a_bad_value_case():
    assert set(VALUE_CASES) | set(NO_BAD_VALUE) == _value_options()


def test_every_rule_names_flags_its_command_has():
    """A renamed flag must not leave a rule that can never fire (its cases above would still pass)."""
    commands = cli.parser()._subparsers._group_actions[0].choices
    for cmd, one, other, *_ in [*NEEDS, *CLASHES, *ONLY_WITH]:
        flags = {o for a in commands[cmd]._actions for o in a.option_strings}
        assert {spec.flag_of(one), spec.flag_of(other)} <= flags, (cmd, one, other)


@pytest.mark.parametrize("argv, completed", [
    (["build", "--torch", "2.7"], {"jobs": 1, "retries": 4, "compression": "gzip"}),
    (["build", "--torch", "2.7", *REG, "--compression", "zstd"], {"compression": "zstd"}),
    (["publish", "--torch", "2.7", "--registry", "127.0.0.1:5000/ml", "--compression", "zstd"], {"compression": "zstd"}),  # a dry run
    (["build", "--all", "--jobs", "3", *REG, "--retries", "2", "--allow-vulnerable", "GHSA-abcd-1234-wxyz"], {"jobs": 3, "retries": 2}),
    (["build", "--torch", "2.7", "--ca-bundle", certifi.where(), "--dry-run"], {"jobs": 1}),
    (["build", "--torch", "2.7", "--no-test", "--cache-from", "type=registry,ref=r/ns/c:{image}", "--cache-to", "type=inline"], {}),
    (["publish", "--all", "--registry", "127.0.0.1:5000/ml"], {"retries": 4}),
    (["bench", "--torch", "2.7", "--runs", "3"], {"cold_runs": 1, "only": None}),
    (["bench", "--torch", "2.7", "--full", "--yes", "--only", "size,cold", "--cold-runs", "2"], {"cold_runs": 2}),
    (["lock", "--check-security", "--record", "--security-snapshot", SNAPSHOT], {}),
    (["engine", "--down", "--store", "classic"], {}),
    ([*SLURM, "--runtime", "apptainer", "--sif", "${SLURM_SUBMIT_DIR}/img.sif", "--socket-ifname", "^docker,lo", "--", "-m", "train"], {}),
    ([*SLURM, "--mount", "/shared/datasets:/data:ro", "--mount", "/scratch/out:/out", "--workdir", "$SLURM_SUBMIT_DIR/src", "--",
      "train.py"], {"mount": ["/shared/datasets:/data:ro", "/scratch/out:/out"], "workdir": "$SLURM_SUBMIT_DIR/src"}),
    ([*K8S, "--mount", "pvc:code:/code:ro", "--mount", "/mnt/datasets:/data", "--", "train.py"], {"workdir": None}),
    ([*JOB, "--scheduler", "kubernetes", "--kind", "trainjob", "--rdma", "rdma/ib=1", "--rdma", "nvidia.com/hostdev=2",
      "--namespace", "ml", "--name", "llm-7b", "--shm-size", "512Mi", "--", "t.py", "--lr", "1e-4"], {"runtime": None, "qos": "burstable"}),
    ([*K8S, "--cpus-per-node", "32", "--memory-per-node", "17Gi", "--qos", "guaranteed", "--image-pull-secret", "regcred",
      "--image-pull-secret", "mirror.pull-1", "--deadline", "1h30m", "--", "t.py"],
     {"cpus_per_node": 32, "qos": "guaranteed", "image_pull_secret": ["regcred", "mirror.pull-1"], "deadline": "1h30m"}),
    ([*JOB, "--scheduler", "kubernetes", "--kind", "trainjob", "--cluster-runtime", "torch-distributed", "--memory-per-node", "600Mi",
      "--shm-size", "512Mi", "--image-pull-secret", "regcred", "--", "t.py"], {"qos": "burstable", "deadline": None}),
    *[(["prune", "--keep-storage", size], {"keep_storage": size}) for size in ("40GB", "512MB", "10GiB", "1.5g", "1048576", "20 GB")],
])
def test_good_arguments_pass_and_are_completed(monkeypatch, argv, completed):
    monkeypatch.delenv("PYTORCH_CUDA_REGISTRY", raising=False)
    args = stage.validate(cli.parser().parse_args(argv))
    assert {k: getattr(args, k) for k in completed} == completed


@pytest.mark.parametrize("registry", [None, registry.Registry.parse("127.0.0.1:5000/ml")])
def test_a_child_of_all_gets_arguments_that_validate(tmp_path, monkeypatch, registry):
    """--all's rows run as `build.py build ... --result-json F` with the parent's options: those must pass too."""
    monkeypatch.delenv("PYTORCH_CUDA_REGISTRY", raising=False)
    opts = arguments.BuildOptions(matrix=ROOT / "matrix.yaml", all=True, jobs=2, no_test=registry is None, no_cache=True,
                                  push=registry is not None, registry=str(registry) if registry else None, retries=2 if registry else 4,
                                  allow_vulnerable=("GHSA-x",) if registry else (), cache_from=("type=registry,ref=r/c",),
                                  compression="zstd" if registry else "gzip", quiet=True, ca_path=certifi.where())
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    argv = opts.child_argv(row, tmp_path / "result.json")
    stage.validate(cli.parser().parse_args(argv))


def test_dry_run_still_needs_no_docker(untouched):
    proc = run_cli(ROOT, "--torch", "2.7", "--cuda", "12.1", "--dry-run", env=NO_DOCKER)
    assert proc.returncode == 0 and "FROM python-env AS runtime" in proc.stdout, proc.stderr


def test_a_ca_bundle_with_a_pem_certificate_among_other_text_is_taken(tmp_path):
    pem = open(certifi.where()).read()
    first = pem[pem.index("-----BEGIN CERTIFICATE-----"):pem.index("-----END CERTIFICATE-----") + 25]
    bundle = tmp_path / "ca.pem"
    bundle.write_text("# the company's root\n" + first + "\n")
    rules.ca_bundle("--ca-bundle", str(bundle))
    bundle.write_text(first.replace("-----BEGIN CERTIFICATE-----", "-----BEGIN PRIVATE KEY-----"))
    with pytest.raises(Exception, match="holds no PEM certificate"):
        rules.ca_bundle("--ca-bundle", str(bundle))


def test_publish_sign_key_on_a_row_of_several_platforms_is_refused_before_anything_is_touched(untouched, paths, monkeypatch):
    """The rows a publish takes come from the arguments and the matrix: signing an index is refused in validation."""
    from pytorch_cuda_build.registry import sign  # its key check needs gpg: stood in for, the key taken as good

    monkeypatch.setattr(sign, "check_key", lambda folder: "F" * 40)
    for rows in (["--torch", "2.11"], ["--all"]):
        proc = run_cli(ROOT, "publish", *rows, *REG, "--sign-key", paths["dir"], env=NO_DOCKER)
        one_error_line(proc, 2, "--sign-key signs single-platform rows' images; 2.11.0-cuda13.0-runtime is an index of "
                                "linux/amd64, linux/arm64, which publish does not sign yet")
        assert proc.stdout == ""


@pytest.fixture
def pulled(tmp_path):
    """matrix.yaml with its Debian base a registry image instead (written before `untouched` starts)."""
    text = (ROOT / "matrix.yaml").read_text()
    pulled = text.replace("    kind: debootstrap\n    suite: bookworm\n    mirror: http://deb.debian.org/debian\n    variant: minbase\n",
                          "    kind: registry\n    image: debian@sha256:" + "0" * 64 + "\n", 1)
    assert pulled != text
    (tmp_path / "pulled.yaml").write_text(pulled)
    return tmp_path / "pulled.yaml"


def test_base_of_a_row_whose_base_is_a_registry_image_is_refused_before_anything_is_touched(pulled, untouched):
    proc = run_cli(ROOT, "--matrix", str(pulled), "base", "--torch", "2.7", env=NO_DOCKER)
    one_error_line(proc, 2, f"2.7.1-cuda12.1-runtime's base is the registry image debian@sha256:{'0' * 64}: it is pulled, never built")
