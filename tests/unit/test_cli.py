"""The CLI as users run it: one clear line, the right exit code, nothing half-written.

Most tests call the CLI in this process (helpers.run_cli, milliseconds); a few run
build.py itself as a user would (helpers.run_build_py, about a second each) to cover
the entry point. Those marked `network` resolve against the real index, frozen at the
committed locks' time by tests/conftest.py (PYTORCH_CUDA_EXCLUDE_NEWER).
"""
from __future__ import annotations

import json
from pathlib import Path

import certifi
import pytest

from pytorch_cuda_build import arguments, files, matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.stages import build
from pytorch_cuda_build.tooling import bench

from helpers import ROOT, one_error_line, project_copy, run_build_py, run_cli, tmpfs, tree_snapshot

NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


def test_unknown_row_lists_rows():
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.4", env=NO_DOCKER)
    one_error_line(proc, 2, "rows for torch 2.7: cuda 12.1 (devel, default), cuda 12.1 (runtime, default), "
                            "cuda 12.1 (train, default), cuda 12.6 (runtime)")


@pytest.mark.parametrize("args, says", [
    (["--only", "size,bogus"], f"--only takes a comma list of {','.join(bench.MEASURES)}, not 'size,bogus'"),
    (["--only", ","], "--only takes a comma list of"),
    (["--runs", "0"], "argument --runs: must be at least 1, not 0"),
    (["--cold-runs", "0"], "argument --cold-runs: must be at least 1, not 0"),
])
def test_bench_rejects_bad_arguments_before_touching_docker(args, says):
    proc = run_cli(ROOT, "bench", "--torch", "2.7", "--cuda", "12.1", "--full", "--yes", *args, env=NO_DOCKER)
    one_error_line(proc, 2, says)


@pytest.mark.parametrize(("args", "text"), [
    (["--torch", "9.9"], "no row for torch 9.9"),
    (["--torch", "2.7", "--flavor", "slim"], "argument --flavor: invalid choice: 'slim'"),
    (["--cuda", "12.1"], "--torch is required (e.g. --torch 2.7)"),
    (["--torch", "2.7", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--matrix", "/nonexistent.yaml", "list"], "cannot read matrix file /nonexistent.yaml"),
])
def test_bad_arguments(args, text):
    one_error_line(run_cli(ROOT, *args, env=NO_DOCKER), 2, text)


def test_dry_run_prints_the_plan_without_docker():
    proc = run_cli(ROOT, "--torch", "2.7", "--cuda", "12.1", "--dry-run", env=NO_DOCKER)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "pytorch-cuda:2.7.1-cuda12.1-runtime pytorch-cuda:v2.7-cuda12.1 pytorch-cuda:v2.7" in out
    assert "wheel CUDA 12.6" in out and "torch 2.7 has no CUDA 12.1 build" in out
    assert "FROM python-env AS runtime" in out
    # stage 3 builds the base with mmdebstrap; matrix.yaml's kind name, debootstrap, is not the tool
    assert "(built here with mmdebstrap from http://deb.debian.org/debian, suite bookworm: debian-bookworm)" in out
    assert "debootstrap" not in out.split("\n\n", 1)[0]


def test_list_shows_every_row_without_docker():
    proc = run_cli(ROOT, "list", env=NO_DOCKER)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1 + len(matrix.load(ROOT / "matrix.yaml").images)
    assert "2.7.1-cuda12.1-runtime" in proc.stdout and "v2.7-cuda12.1 v2.7" in proc.stdout


def test_matrix_errors_all_reported_at_once(tmp_path):
    root = project_copy(tmp_path / "p")
    text = (root / "matrix.yaml").read_text().replace("cudnn: 9.5.1.17", "cudnn: nine", 1).replace("nccl: 2.26.2", "ncl: 2.26.2", 1)
    (root / "matrix.yaml").write_text(text)
    proc = run_cli(root, "list", env=NO_DOCKER)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0].endswith("3 problems") or len(lines) >= 3, proc.stderr
    assert any("'nine' is not a valid version" in ln for ln in lines)
    assert any("ncl: unknown key" in ln for ln in lines) and any("nccl: Field required" in ln for ln in lines)


def test_stale_lock_refuses_to_build_and_writes_nothing(tmp_path):
    root = project_copy(tmp_path / "p")
    text = (root / "matrix.yaml").read_text().replace("deepspeed: 0.17.6\n    default: true", "deepspeed: 0.17.5\n    default: true")
    (root / "matrix.yaml").write_text(text)
    before = tree_snapshot(root / "images")
    proc = run_cli(root, "--torch", "2.7", "--cuda", "12.1", env=NO_DOCKER)
    one_error_line(proc, 2, "lock is stale against matrix.yaml")
    assert run_cli(root, "lock", "--check", env=NO_DOCKER).returncode == 2
    assert tree_snapshot(root / "images") == before


@pytest.mark.network
def test_lock_refuses_a_matrix_that_disagrees_with_the_wheel(tmp_path):
    """Real resolution against the index: the matrix claims the wrong NCCL for torch 2.7.1."""
    root = project_copy(tmp_path / "p")
    text = (root / "matrix.yaml").read_text().replace("nccl: 2.26.2", "nccl: 2.21.5")
    (root / "matrix.yaml").write_text(text)
    before = tree_snapshot(root / "images")
    proc = run_build_py(root, "lock", "--torch", "2.7", "--cuda", "12.6", env=NO_DOCKER, timeout=600)
    one_error_line(proc, 2, "NCCL 2.21.5 in matrix.yaml but torch 2.7.1's wheel requires 2.26.2")
    assert tree_snapshot(root / "images") == before


def test_render_check_fails_on_a_hand_edit(tmp_path):
    root = project_copy(tmp_path / "p")
    df = root / "images" / "2.7.1-cuda12.1-runtime" / "Dockerfile"
    df.write_text(df.read_text() + "RUN echo hand-edit\n")
    one_error_line(run_cli(root, "render", "--check", env=NO_DOCKER), 2, "rendered files drifted")


def test_unreadable_ca_bundle(tmp_path):
    proc = run_cli(ROOT, "--torch", "2.7", "--ca-bundle", str(tmp_path / "missing.pem"), env=NO_DOCKER)
    one_error_line(proc, 2, f"cannot read CA bundle {tmp_path / 'missing.pem'}")


@pytest.mark.fault
def test_no_docker_daemon_names_the_address():
    proc = run_cli(ROOT, "--torch", "2.7", "--ca-bundle", certifi.where(), env=NO_DOCKER)
    one_error_line(proc, 2, "no Docker daemon answers at unix:///nonexistent/docker.sock")


# ---- BuildKit client detection, with fake clients --------------------------------

CONTAINERD_STORE = '[["driver-type","io.containerd.snapshotter.v1"]]'
CLASSIC_STORE = '[["Backing Filesystem","extfs"],["Supports d_type","true"]]'


def fake_docker(tmp_path, version: str, buildx: bool, store: str = CLASSIC_STORE, driver: str = "docker") -> str:
    path = tmp_path / f"docker-{version}-{'bx' if buildx else 'nobx'}-{len(store)}-{driver}"
    path.write_text(f"""#!/bin/sh
case "$1" in
  version) echo {version};;
  buildx) {'echo buildx v0.20' if buildx else 'echo "docker: buildx is not a docker command" >&2; exit 1'};;
  info) echo '{store}';;
esac
case "$1 $2" in
  "buildx inspect") printf 'Name:          default\nDriver:        {driver}\n';;
esac
""")
    path.chmod(0o755)
    return str(path)


def test_new_client_without_buildx_is_refused(tmp_path):
    assert docker_env.probe(fake_docker(tmp_path, "28.2.2", buildx=False)) is None


def test_buildx_preferred_and_old_client_uses_builtin_buildkit(tmp_path):
    bx = docker_env.probe(fake_docker(tmp_path, "28.2.2", buildx=True))
    assert bx and bx.argv[1:] == ("buildx", "build", "--load")
    old = docker_env.probe(fake_docker(tmp_path, "20.10.24+dfsg1", buildx=False))
    assert old and old.argv[1:] == ("build",) and old.env == {"DOCKER_BUILDKIT": "1"}


def test_override_must_be_buildkit_capable(tmp_path, monkeypatch):
    bad = fake_docker(tmp_path, "28.2.2", buildx=False)
    with pytest.raises(EnvironmentProblem, match="cannot build with BuildKit"):
        docker_env.build_client(bad)
    monkeypatch.setenv("PYTORCH_CUDA_DOCKER", fake_docker(tmp_path, "20.10.24", buildx=False))
    assert docker_env.build_client().env == {"DOCKER_BUILDKIT": "1"}


def test_buildx_on_the_containerd_store_exports_a_time_rewritten_oci_tarball(tmp_path, monkeypatch):
    """--load with rewrite-timestamp fails there; the build writes an OCI tarball and loads it."""
    monkeypatch.delenv("PYTORCH_CUDA_BUILD_NETWORK", raising=False)
    ctrd = docker_env.build_client(fake_docker(tmp_path, "26.1.5", buildx=True, store=CONTAINERD_STORE))
    assert ctrd.export == "oci" and ctrd.argv[1:] == ("buildx", "build")
    classic = docker_env.build_client(fake_docker(tmp_path, "26.1.5", buildx=True))
    assert classic.export == "load" and classic.argv[1:] == ("buildx", "build", "--load")
    image = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    src = build.Source("abc", 1)
    cmd = build.command(ctrd, ROOT, image, tmp_path, tmp_path / "iid", src, None, False)
    lock_hash = json.loads((ROOT / "images" / image.name / "lock.json").read_text())["files_sha256"]
    assert cmd[-6:-1] == ["--provenance=mode=max", "--label", f"io.pytorch-cuda.lock-sha256={lock_hash}",
                          "--output", f"type=oci,dest={tmp_path / 'image.oci.tar'},rewrite-timestamp=true"]
    assert f'io.pytorch-cuda.lock-sha256="{lock_hash}"' in (ROOT / "images" / image.name / "Dockerfile").read_text()  # the same value
    plain = build.command(classic, ROOT, image, tmp_path, tmp_path / "iid", src, None, False)
    assert "--output" not in plain and not any(a.startswith("--provenance") for a in plain)


def test_source_date_epoch_is_one_fixed_time_and_the_created_label_is_the_commits(tmp_path, monkeypatch):
    """A commit's time as SOURCE_DATE_EPOCH made a warm-cache build and a cold one of the same
    commit differ on Docker 26 (tests/integration/test_engines.py shows why)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "42")  # the caller's own is not taken either
    bc = docker_env.build_client(fake_docker(tmp_path, "26.1.5", buildx=True, store=CONTAINERD_STORE))
    assert docker_env.build_env(bc)["SOURCE_DATE_EPOCH"] == str(matrix.REPRODUCIBLE_EPOCH) == "1767225600"
    image = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    src = build.Source("abc", 1763942400)  # 2025-11-24
    cmd = build.command(bc, ROOT, image, tmp_path, tmp_path / "iid", src, None, False)
    assert "org.opencontainers.image.created=2025-11-24T00:00:00Z" in cmd


def test_a_row_builds_with_no_network_whatever_the_environment_and_only_host_is_taken(tmp_path, monkeypatch):
    """Every file a row's build reads is in its context (the store's): its steps get no network,
    also where the engine's own builds take the host's (bench's naive image, the tests' images)."""
    client = fake_docker(tmp_path, "20.10.24", buildx=False)
    monkeypatch.setenv("PYTORCH_CUDA_BUILD_NETWORK", "host")
    bc = docker_env.build_client(client)
    assert bc.network == "host"
    image = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    cmd = build.command(bc, ROOT, image, tmp_path, tmp_path / "iid", build.Source("abc", 1), "/etc/ssl/certs/ca-certificates.crt", False)
    assert cmd[-3:-1] == ["--network", "none"] and "--secret" not in cmd
    assert build.export_command(bc, ROOT, image, tmp_path, tmp_path / "ops", None)[-3:-1] == ["--network", "none"]
    monkeypatch.setenv("PYTORCH_CUDA_BUILD_NETWORK", "bridge")
    with pytest.raises(EnvironmentProblem, match="may be `host` or unset, not 'bridge'"):
        docker_env.build_client(client)


@pytest.mark.parametrize("client,args,says", [
    (("20.10.24", False, CLASSIC_STORE), ["--cache-from", "type=registry,ref=r/c:{image}"], "need buildx"),
    (("26.1.5", True, CLASSIC_STORE), ["--cache-to", "type=registry,ref=r/c:{image}"], "--cache-to needs the containerd image store or a docker-container builder"),
    (("26.1.5", True, CONTAINERD_STORE), ["--cache-from", "registry,ref=r/c"], "is not buildx's type=...,key=value form"),
])
def test_cache_options_the_client_cannot_honour_are_refused_before_building(tmp_path, monkeypatch, client, args, says):
    monkeypatch.delenv("PYTORCH_CUDA_BUILD_NETWORK", raising=False)
    docker = fake_docker(tmp_path, *client[:2], store=client[2])
    proc = run_cli(ROOT, "--torch", "2.7", "--cuda", "12.1", "--docker", docker, "--ca-bundle", certifi.where(), *args)
    one_error_line(proc, 2, says)


def test_cache_specs_name_each_row_and_reach_the_build_and_child_runs(tmp_path, monkeypatch):
    from pytorch_cuda_build import pipeline
    monkeypatch.delenv("PYTORCH_CUDA_BUILD_NETWORK", raising=False)
    opts = pipeline.Options(cache_from=("type=registry,ref=r/ns/cache:{image}",),
                            cache_to=("type=registry,ref=r/ns/cache:{image},mode=max",))
    image = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    args = opts.cache_args(image)
    assert args == ["--cache-from", "type=registry,ref=r/ns/cache:2.7.1-cuda12.1-runtime",
                    "--cache-to", "type=registry,ref=r/ns/cache:2.7.1-cuda12.1-runtime,mode=max"]
    child = arguments.BuildOptions(all=True, cache_from=opts.cache_from, cache_to=opts.cache_to).child_argv(image, tmp_path / "r.json")
    assert "type=registry,ref=r/ns/cache:{image}" in child  # a child run fills in its own row
    container_builder = docker_env.build_client(fake_docker(tmp_path, "28.2.2", buildx=True, driver="docker-container"))
    assert container_builder.driver == "docker-container" and container_builder.export == "load"
    build.check_cache_options(container_builder, opts.cache_from, opts.cache_to)  # classic store, yet it can export
    bc = docker_env.build_client(fake_docker(tmp_path, "26.1.5", buildx=True, store=CONTAINERD_STORE))
    build.check_cache_options(bc, opts.cache_from, opts.cache_to)
    cmd = build.command(bc, ROOT, image, tmp_path, tmp_path / "iid", build.Source("abc", 1), None, False, cache_args=args)
    assert all(a in cmd for a in args)


# ---- full disks, on a real tiny filesystem ---------------------------------------

@pytest.fixture
def tiny_fs(tmp_path):
    with tmpfs(tmp_path / "tiny", "64k") as mnt:
        yield mnt


@pytest.mark.fault
def test_full_disk_leaves_the_old_file_whole(tiny_fs):
    target = tiny_fs / "requirements.lock"
    files.write_atomic(target, "old\n")
    with pytest.raises(EnvironmentProblem, match="no space left on device"):
        files.write_atomic(target, "x" * 200_000)
    assert target.read_text() == "old\n"
    assert [p.name for p in tiny_fs.iterdir()] == ["requirements.lock"]


@pytest.mark.fault
def test_build_refuses_to_start_on_a_full_disk(tiny_fs):
    with pytest.raises(EnvironmentProblem, match=r"no disk space for a build: 0.0 GiB free .*prune --keep-storage"):
        build.check_disk(str(tiny_fs))




def test_verify_refuses_a_row_without_lock_and_an_unreadable_ca(tmp_path):
    root = project_copy(tmp_path / "p")
    (root / "images" / "2.7.1-cuda12.6-runtime" / "lock.json").unlink()
    before = tree_snapshot(root / "images")
    one_error_line(run_cli(root, "verify", "--torch", "2.7", "--cuda", "12.6", env=NO_DOCKER), 2, "no lock")
    missing = tmp_path / "nope.pem"
    one_error_line(run_cli(root, "verify", "--torch", "2.7", "--cuda", "12.1", "--ca-bundle", str(missing), env=NO_DOCKER),
                   2, f"cannot read CA bundle {missing}")
    assert tree_snapshot(root / "images") == before
    assert not (root / "build-results").exists()


def test_verify_platform_is_one_of_the_rows_before_anything_is_built(tmp_path):
    """verify --platform: a row not locked for it, or a name that is no platform, is one line and
    exit 2 before an engine is asked for (NO_DOCKER would make any Docker call a different error)."""
    root = project_copy(tmp_path / "p")
    one_error_line(run_cli(root, "verify", "--torch", "2.7", "--cuda", "12.1", "--platform", "linux/arm64", env=NO_DOCKER),
                   2, "2.7.1-cuda12.1-runtime is locked for linux/amd64 only, not linux/arm64")
    one_error_line(run_cli(root, "verify", "--torch", "2.11", "--platform", "linux/s390x", env=NO_DOCKER), 2, "--platform")
    assert not (root / "build-results").exists()


@pytest.mark.network
def test_lock_upgrade_prints_what_moved(tmp_path):
    """Real re-resolution: a lock whose recorded tqdm pin is old reports the move, and the files
    come back byte for byte as the index answers now.

    The index is frozen (PYTORCH_CUDA_EXCLUDE_NEWER, tests/conftest.py), but a frozen index can
    still gain a file dated before the freeze (seen: certifi 2026.10.19.post1, dated 2026-10-22,
    appeared after the committed locks chose 2026.10.18). So the reference is not the committed
    lock but a first `--upgrade` of an untouched copy, seconds before.
    """
    import json

    def copy_upgraded(name: str) -> Path:
        root = project_copy(tmp_path / name)
        proc = run_build_py(root, "lock", "--upgrade", "--torch", "2.7", "--cuda", "12.6", env=NO_DOCKER, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return root / "images" / "2.7.1-cuda12.6-runtime"

    reference = copy_upgraded("reference")
    current = json.loads((reference / "lock.json").read_text())["pins"]["tqdm"]
    root = project_copy(tmp_path / "p")
    meta_path = root / "images" / "2.7.1-cuda12.6-runtime" / "lock.json"
    meta = json.loads(meta_path.read_text())
    meta["pins"]["tqdm"] = "4.0.0"
    meta_path.write_text(json.dumps(meta))
    proc = run_build_py(root, "lock", "--upgrade", "--torch", "2.7", "--cuda", "12.6", env=NO_DOCKER, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"2.7.1-cuda12.6-runtime: tqdm 4.0.0 -> {current}" in proc.stdout
    assert json.loads(meta_path.read_text())["pins"]["tqdm"] == current
    for name in ("requirements.lock", "deepspeed.lock", "toolkit.lock"):
        assert (meta_path.parent / name).read_bytes() == (reference / name).read_bytes(), name


def test_quiet_and_verbose_together_is_one_line_before_anything_runs():
    proc = run_cli(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--verbose", env=NO_DOCKER)
    one_error_line(proc, 2, "argument --verbose: not allowed with argument --quiet")
    assert proc.stdout == ""
