"""gpu-bundle without Docker: which wheels travel, what the bundle holds, the size limit, and
bad input as one `error:` line with nothing written. Downloads are replaced by small local
files, except in the test marked `network`, which builds a real bundle of the default row."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build.errors import BundleTooLarge
from pytorch_cuda_build.stages import lock, matrix
from pytorch_cuda_build.tools import gpubundle

from helpers import ROOT, missing, one_error_line, run_cli

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEFAULT = MATRIX.select("2.7", "12.1")
CUDA13 = MATRIX.select("2.11", "13.0")
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}

LOCK = """\
# GENERATED ...
hjson==3.1.0 \\
    --hash=sha256:aa
    # via deepspeed
numpy==2.4.6 \\
    --hash=sha256:bb
    # via
    #   deepspeed
    #   torch
sympy==1.14.0 \\
    --hash=sha256:cc
    # via torch
torch==2.7.1 \\
    --hash=sha256:dd
    # via deepspeed
nvidia-nccl-cu12==2.26.2 \\
    --hash=sha256:ee
    # via torch
nvidia-ml-py==13.615.71 \\
    --hash=sha256:ff
huggingface-hub==2.4.0 \\
    --hash=sha256:11
tqdm==4.70.1 \\
    --hash=sha256:22
    # via
    #   deepspeed
    #   huggingface-hub
"""


def test_the_closure_follows_deepspeed_and_the_smoke_suite_and_never_enters_torch():
    pins = gpubundle.parse_lock(LOCK)
    assert pins["numpy"].parents == {"deepspeed", "torch"} and pins["huggingface-hub"].parents == set()
    assert pins["hjson"].text == "hjson==3.1.0 \\\n    --hash=sha256:aa\n"  # hashes kept, comments dropped
    names = [p.name for p in gpubundle.closure(pins)]
    # sympy is torch's alone, torch and the CUDA libraries are the machine's: none travels.
    assert names == ["hjson", "huggingface-hub", "numpy", "nvidia-ml-py", "tqdm"]


@pytest.mark.parametrize("image", [DEFAULT, CUDA13], ids=lambda i: i.name)
def test_the_rows_wheels_are_deepspeeds_needs_at_the_locked_versions(image):
    text = (lock.image_dir(ROOT, image) / "requirements.lock").read_text()
    pins = {p.name: p for p in gpubundle.closure(gpubundle.parse_lock(text))}
    assert {"hjson", "pydantic", "ninja", "numpy", "msgpack", "setuptools", "nvidia-ml-py", "huggingface-hub"} <= set(pins)
    assert not [n for n in pins if n in ("torch", "triton") or n.startswith(("nvidia-cu", "nvidia-nccl", "cuda-"))]
    assert not {"jupyterlab", "tensorboard", "ipykernel"} & set(pins)  # the image's other ways in stay home
    assert all(p.version == lock.read(ROOT, image)["pins"][p.name] and "--hash=sha256:" in p.text for p in pins.values())


def fake_downloads(monkeypatch, wheel_bytes: int = 1000) -> list:
    """fetch_sdist and fetch_wheels write small local files; the calls are recorded."""
    calls = []

    def sdist(index, name, version, digest, dest, ca):
        calls.append(("sdist", name, version, digest))
        path = dest / f"{name}-{version}.tar.gz"
        path.write_bytes(b"sdist")
        return path

    def wheels(pins, python, tags, dest, ca):
        calls.append(("wheels", python, tags[0], [p.name for p in pins]))
        for p in pins:
            (dest / f"{p.name.replace('-', '_')}-{p.version}-py3-none-any.whl").write_bytes(b"w" * wheel_bytes)

    monkeypatch.setattr(gpubundle, "fetch_sdist", sdist)
    monkeypatch.setattr(gpubundle, "fetch_wheels", wheels)
    return calls


def test_the_bundle_holds_the_locked_sdist_wheels_runtime_manifest_and_run_sh(tmp_path, monkeypatch):
    calls = fake_downloads(monkeypatch)
    dest = tmp_path / "bundle"
    desc = gpubundle.write(ROOT, CUDA13, dest, "3.12", None, log=lambda _: None)
    name, version, digest = gpubundle.sdist_pin((lock.image_dir(ROOT, CUDA13) / "deepspeed.lock").read_text())
    assert calls[0] == ("sdist", "deepspeed", CUDA13.deepspeed, digest)
    assert calls[1][:3] == ("wheels", "3.12", "manylinux_2_28_x86_64")  # the target Python, the lock's platform
    files = set(desc["files"])
    assert {f"deepspeed-{version}.tar.gz", "manifest.json", "run.sh", "pytorch_cuda_runtime/gpucheck.py",
            "pytorch_cuda_runtime/opsbuild.py", "pytorch_cuda_runtime/smoke/cli.py"} <= files
    assert {f"wheels/{w.replace('-', '_')}-{v}-py3-none-any.whl" for w, v in desc["wheels"].items()} <= files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert on_disk == files | {"bundle.json"}
    assert json.loads((dest / "bundle.json").read_text()) == desc
    assert all(gpubundle.sha256(dest / f) == meta["sha256"] for f, meta in desc["files"].items())
    assert (dest / "manifest.json").read_bytes() == (lock.image_dir(ROOT, CUDA13) / "manifest.json").read_bytes()
    assert desc["python"] == "3.12" and desc["row_python"] == CUDA13.python and desc["prebuilt_ops"] == list(CUDA13.prebuilt_ops)
    assert os.access(dest / "run.sh", os.X_OK) and "pytorch_cuda_runtime.gpucheck" in (dest / "run.sh").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # the staging directory was renamed, not copied


def test_an_empty_directory_is_filled(tmp_path, monkeypatch):
    fake_downloads(monkeypatch)
    (tmp_path / "bundle").mkdir()
    gpubundle.write(ROOT, DEFAULT, tmp_path / "bundle", DEFAULT.python, None, log=lambda _: None)
    assert (tmp_path / "bundle" / "bundle.json").exists()


def test_a_bundle_over_the_limit_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    fake_downloads(monkeypatch, wheel_bytes=2**20)
    with pytest.raises(BundleTooLarge) as e:
        gpubundle.write(ROOT, DEFAULT, tmp_path / "bundle", "3.11", None, limit_mib=5, log=lambda _: None)
    assert e.value.exit_code == 2 and "over the 5 MiB" in str(e.value) and "nothing written" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no DIR, no staging directory


def test_the_size_check_names_the_largest_files():
    files = {"a": {"size": 3 * 2**20}, "b": {"size": 2**20}, "c": {"size": 10}}
    assert gpubundle.check_size(files, 5) == 4 * 2**20 + 10
    with pytest.raises(BundleTooLarge, match=r"4\.0 MiB, over the 3 MiB .*largest: a 3\.0 MiB, b 1\.0 MiB"):
        gpubundle.check_size(files, 3)


def test_cli_unknown_row(tmp_path):
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "9.9", str(tmp_path / "b"), env=NO_DOCKER), 2, "no row for torch 9.9")


def test_cli_refuses_a_directory_that_is_not_empty(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(tmp_path / "b"), env=NO_DOCKER), 2,
                   "exists and is not an empty directory")
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["keep.txt"]


def test_cli_refuses_a_file_and_a_missing_parent(tmp_path):
    (tmp_path / "f").write_text("")
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(tmp_path / "f"), env=NO_DOCKER), 2, "is not an empty directory")
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(tmp_path / "no" / "b"), env=NO_DOCKER), 2, "does not exist")


@contextlib.contextmanager
def read_only(path: Path):
    """A directory nobody may write: a read-only mount for root (who passes mode bits), else mode 555."""
    path.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]).returncode != 0:
            missing("root cannot mount a read-only tmpfs here")
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=False)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


def test_cli_refuses_an_unwritable_directory(tmp_path):
    with read_only(tmp_path / "ro") as ro:
        one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(ro / "b"), env=NO_DOCKER), 2, "is not writable")


@pytest.mark.parametrize(("args", "text"), [
    (["--python", "3"], "--python '3': expected MAJOR.MINOR"),
    (["--limit-mib", "0"], "--limit-mib must be at least 1"),
])
def test_cli_bad_options(tmp_path, monkeypatch, args, text):
    fake_downloads(monkeypatch)
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(tmp_path / "b"), *args, env=NO_DOCKER), 2, text)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.network
def test_a_real_bundle_of_the_default_row_fits_and_its_files_are_the_locked_ones(tmp_path):
    proc = run_cli(ROOT, "gpu-bundle", "--torch", "2.7", "--cuda", "12.1", "--python", "3.12", str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr
    desc = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert 0 < desc["size"] <= gpubundle.LIMIT_MIB * 2**20
    wheels = [f for f in desc["files"] if f.startswith("wheels/")]
    assert len(wheels) == len(desc["wheels"])
    assert not [w for w in wheels if "-cp3" in w and "-cp312-" not in w and "abi3" not in w]  # for the target Python
