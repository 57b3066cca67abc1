"""gpu-bundle without Docker: which wheels travel, what the bundle holds (a prebuilt DeepSpeed wheel,
libaio, no sdist), where the wheel comes from, the size limit, and bad input as one `error:` line
with nothing written. Downloads and the ops build are replaced by small local files, except in the
test marked `network`, which fetches a real bundle's wheels and libaio around a wheel it is given."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import gpubundle, lockpins, opswheel
from pytorch_cuda_build.errors import BadFile, BadValue, BundleTooLarge, CommandFailed, EnvironmentProblem, ImageUnfit, ResolveError
from pytorch_cuda_build.resolve import debian
from pytorch_cuda_build.stages import lock

from helpers import ROOT, layer_tar, missing, one_error_line, run_cli

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
    pins = lockpins.parse_lock(LOCK)
    assert pins["numpy"].parents == {"deepspeed", "torch"} and pins["huggingface-hub"].parents == set()
    assert pins["hjson"].text == "hjson==3.1.0 \\\n    --hash=sha256:aa\n"  # hashes kept, comments dropped
    names = [p.name for p in lockpins.closure(pins, gpubundle.ROOTS, gpubundle.EXCLUDED)]
    # sympy is torch's alone, torch and the CUDA libraries are the machine's: none travels.
    assert names == ["hjson", "huggingface-hub", "numpy", "nvidia-ml-py", "tqdm"]


@pytest.mark.parametrize("image", [DEFAULT, CUDA13], ids=lambda i: i.name)
def test_the_rows_wheels_are_deepspeeds_needs_at_the_locked_versions(image):
    text = (lock.image_dir(ROOT, image) / "requirements.lock").read_text()
    pins = {p.name: p for p in lockpins.closure(lockpins.parse_lock(text), gpubundle.ROOTS, gpubundle.EXCLUDED)}
    assert {"hjson", "pydantic", "ninja", "numpy", "msgpack", "nvidia-ml-py", "huggingface-hub"} <= set(pins)
    assert not [n for n in pins if n in ("torch", "triton") or n.startswith(("nvidia-cu", "nvidia-nccl", "cuda-"))]
    assert not {"jupyterlab", "tensorboard", "ipykernel"} & set(pins)  # the image's other ways in stay home
    assert all(p.version == lock.read(ROOT, image)["pins"][p.name] and "--hash=sha256:" in p.text for p in pins.values())


def ds_wheel(folder: Path, image: matrix.Image, python: str = "3.12", accelerator: str = "cuda",
             ops: tuple[str, ...] | None = None, torch: str | None = None, extra: dict[str, bytes] | None = None) -> Path:
    """A stand-in DeepSpeed wheel: the build record DeepSpeed writes, nothing compiled."""
    tag = "cp" + python.replace(".", "")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"deepspeed-{image.deepspeed}-{tag}-{tag}-linux_x86_64.whl"
    installed = {op: True for op in (image.prebuilt_ops if ops is None else ops)}
    info = (f"installed_ops = {installed!r}\naccelerator_name = {accelerator!r}\n"
            f"torch_info = {{'version': {(torch or '.'.join(image.torch.split('.')[:2]))!r}}}\n")
    files = {"deepspeed/git_version_info_installed.py": info.encode(), **(extra or {})}
    record = "".join(f"{n},sha256=x,{len(b)}\n" for n, b in files.items())
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"deepspeed-{image.deepspeed}.dist-info/RECORD", record + f"deepspeed-{image.deepspeed}.dist-info/RECORD,,\n")
    return path


def fake_downloads(monkeypatch, wheel_bytes: int = 1000, state: Path | None = None) -> list:
    """fetch_sdist, fetch_wheels, libaio and the ops build write small local files; the calls are recorded."""
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

    def libaio(image, root, cache, ca):
        calls.append(("libaio", image.name))
        prefix = cache / "libaio-test"
        (prefix / "usr" / "lib").mkdir(parents=True, exist_ok=True)
        (prefix / "usr" / "lib" / "libaio.so.1.0.2").write_bytes(b"ELF")
        (prefix / "usr" / "lib" / "libaio.so.1").unlink(missing_ok=True)
        (prefix / "usr" / "lib" / "libaio.so.1").symlink_to("libaio.so.1.0.2")  # as the package has it
        return prefix, "libaio1 0.3.113-4"

    def build(root, image, python, exe, archs, sdist, aio, dest, ca, log):
        calls.append(("build", python, exe, archs, sdist.name))
        wheel = ds_wheel(dest, image, python)
        (dest / "ops-facts.json").write_text("{}")
        return opswheel.OpsWheel(wheel, list(image.prebuilt_ops), archs, image.torch, f"built here with {exe}")

    monkeypatch.setattr(gpubundle, "fetch_sdist", sdist)
    monkeypatch.setattr(gpubundle, "fetch_wheels", wheels)
    monkeypatch.setattr(opswheel, "libaio", libaio)
    monkeypatch.setattr(opswheel, "build", build)
    monkeypatch.setattr(opswheel, "find_python", lambda python, given: given or f"/usr/bin/python{python}")
    if state:
        monkeypatch.setattr(gpubundle.paths, "STATE_DIR", state)
    return calls


def test_the_bundle_holds_a_prebuilt_wheel_libaio_wheels_runtime_manifest_and_run_sh(tmp_path, monkeypatch):
    calls = fake_downloads(monkeypatch, state=tmp_path / "state")
    dest = tmp_path / "bundle"
    desc = gpubundle.write(ROOT, CUDA13, dest, "3.12", None, log=lambda _: None)
    name, version, digest = gpubundle.sdist_pin((lock.image_dir(ROOT, CUDA13) / "deepspeed.lock").read_text())
    assert calls[0] == ("libaio", CUDA13.name) and calls[1] == ("sdist", "deepspeed", CUDA13.deepspeed, digest)
    assert calls[2] == ("build", "3.12", "/usr/bin/python3.12", "9.0", f"deepspeed-{version}.tar.gz")
    assert calls[3][:3] == ("wheels", "3.12", "manylinux_2_28_x86_64")  # the target Python, the lock's platform
    files = set(desc["files"])
    wheel = f"ops/deepspeed-{version}-cp312-cp312-linux_x86_64.whl"
    assert {wheel, "ops/ops-facts.json", "lib/libaio.so.1", "manifest.json", "run.sh", "pytorch_cuda_runtime/gpucheck.py",
            "pytorch_cuda_runtime/gpu_estimates.json", "pytorch_cuda_runtime/smoke/cli.py"} <= files
    assert not [f for f in files if f.endswith(".tar.gz")]  # no sdist: nothing is compiled there
    assert desc["ops_wheel"] == {"file": wheel, "ops": list(CUDA13.prebuilt_ops), "arch_list": "9.0", "torch": CUDA13.torch,
                                 "source": "built here with /usr/bin/python3.12", "debug_info": "stripped (strip --strip-debug)"}
    assert desc["libaio"] == {"file": "lib/libaio.so.1", "package": "libaio1 0.3.113-4"} and desc["schema"] == 2
    assert {f"wheels/{w.replace('-', '_')}-{v}-py3-none-any.whl" for w, v in desc["wheels"].items()} <= files
    assert "setuptools" not in desc["wheels"]  # nothing is built there
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert on_disk == files | {"bundle.json"}
    assert json.loads((dest / "bundle.json").read_text()) == desc
    assert all(gpubundle.sha256(dest / f) == meta["sha256"] for f, meta in desc["files"].items())
    assert (dest / "manifest.json").read_bytes() == (lock.image_dir(ROOT, CUDA13) / "manifest.json").read_bytes()
    assert desc["python"] == "3.12" and desc["row_python"] == CUDA13.python and desc["prebuilt_ops"] == list(CUDA13.prebuilt_ops)
    run_sh = (dest / "run.sh").read_text()
    assert os.access(dest / "run.sh", os.X_OK) and "pytorch_cuda_runtime.gpucheck" in run_sh and "for 9.0" in run_sh
    assert [p.name for p in tmp_path.iterdir() if p.name != "state"] == ["bundle"]  # the staging directory was renamed


def test_a_wheel_given_is_checked_and_carried_and_nothing_is_built(tmp_path, monkeypatch):
    calls = fake_downloads(monkeypatch, state=tmp_path / "state")
    given = ds_wheel(tmp_path / "given", DEFAULT, "3.11")
    (tmp_path / "given" / "ops-facts.json").write_text(json.dumps({"ops_arch_list": "7.0;8.0;9.0+PTX"}))
    desc = gpubundle.write(ROOT, DEFAULT, tmp_path / "b", "3.11", None, gpubundle.WheelSource(ops_wheel=given), log=lambda _: None)
    assert [c[0] for c in calls] == ["libaio", "wheels"]  # no sdist, no build
    assert desc["ops_wheel"]["file"] == f"ops/{given.name}" and desc["ops_wheel"]["arch_list"] == "7.0;8.0;9.0+PTX"
    assert desc["ops_wheel"]["source"] == f"given: {given.name}" and (tmp_path / "b" / "ops" / given.name).is_file()


@pytest.mark.parametrize(("kw", "text"), [
    ({"python": "3.11"}, "for Python 3.12 (cp312)"),
    ({"accelerator": "cpu"}, "built for 'cpu'"),
    ({"ops": ("cpu_adam",)}, "without fused_adam"),
    ({"torch": "2.7"}, "built against torch 2.7"),
])
def test_a_wheel_that_does_not_fit_the_row_is_refused_before_any_download(tmp_path, monkeypatch, kw, text):
    calls = fake_downloads(monkeypatch)
    given = ds_wheel(tmp_path / "given", CUDA13, **kw)
    with pytest.raises(BadFile, match=text.replace("(", r"\(").replace(")", r"\)")):
        gpubundle.write(ROOT, CUDA13, tmp_path / "b", "3.12", None, gpubundle.WheelSource(ops_wheel=given), log=lambda _: None)
    assert calls == [] and not (tmp_path / "b").exists()


def test_the_ops_debug_info_is_stripped_and_record_kept_true(tmp_path):
    src = tmp_path / "op.c"
    src.write_text("int scale(int x) { return 3 * x; }\n")
    so = tmp_path / "op.so"
    subprocess.run(["gcc", "-g", "-O0", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    name = "deepspeed/ops/adam/fused_adam_op.cpython-312-x86_64-linux-gnu.so"
    wheel = ds_wheel(tmp_path / "w", CUDA13, extra={name: so.read_bytes()})
    before, after = opswheel.strip_debug(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        data = z.read(name)
        record = z.read(f"deepspeed-{CUDA13.deepspeed}.dist-info/RECORD").decode()
    (tmp_path / "stripped.so").write_bytes(data)
    sections = subprocess.run(["objdump", "-h", str(tmp_path / "stripped.so")], capture_output=True, text=True).stdout
    assert ".debug_info" not in sections and ".text" in sections
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert f"{name},sha256={digest},{len(data)}" in record.splitlines()
    assert record.splitlines()[-1].endswith("RECORD,,")  # RECORD's own line stays hashless


def test_a_file_that_is_no_deepspeed_wheel_is_refused(tmp_path):
    bad = tmp_path / f"deepspeed-{CUDA13.deepspeed}-cp312-cp312-linux_x86_64.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(BadFile, match="not a DeepSpeed wheel"):
        opswheel.check(bad, CUDA13, "3.12")
    with pytest.raises(BadFile, match="expected deepspeed-"):
        opswheel.check(tmp_path / "torch-2.11.0-cp312-cp312-linux_x86_64.whl", CUDA13, "3.12")


def test_an_arm64_row_is_refused(tmp_path, monkeypatch):
    fake_downloads(monkeypatch)
    arm = CUDA13.on("linux/arm64") if "linux/arm64" in CUDA13.platforms else None
    if arm is None:
        pytest.skip("the 2.11 row has no arm64 platform")
    with pytest.raises(ImageUnfit, match="arm64 row"):
        gpubundle.write(ROOT, arm, tmp_path / "b", "3.12", None, log=lambda _: None)


def fake_python(folder: Path, name: str, version: str, headers: bool = True) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text(f"#!/bin/sh\necho {version} {headers}\n")
    exe.chmod(0o755)
    return str(exe)


def test_the_build_python_is_the_one_given_else_found_on_path_or_by_uv(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    monkeypatch.setenv("PATH", str(bin_))
    with pytest.raises(EnvironmentProblem, match=r"no Python 3\.12 with its headers .*--build-python PATH.*--ops-wheel FILE"):
        opswheel.find_python("3.12", None)
    fake_python(bin_, "python3", "3.11")
    fake_python(tmp_path / "uv-pythons", "python3.12", "3.12")
    (bin_ / "uv").write_text(f"#!/bin/sh\n[ \"$1 $2 $3\" = 'python find 3.12' ] && echo {tmp_path}/uv-pythons/python3.12\n")
    (bin_ / "uv").chmod(0o755)
    assert opswheel.find_python("3.12", None) == f"{tmp_path}/uv-pythons/python3.12"
    (bin_ / "uv").unlink()
    fake_python(tmp_path / "pyenv" / "versions" / "3.12.9" / "bin", "python3.12", "3.12")
    newest = fake_python(tmp_path / "pyenv" / "versions" / "3.12.10" / "bin", "python3.12", "3.12")
    (bin_ / "pyenv").write_text(f"#!/bin/sh\n[ \"$1\" = root ] && echo {tmp_path}/pyenv\n")
    (bin_ / "pyenv").chmod(0o755)
    assert opswheel.find_python("3.12", None) == newest  # pyenv's versions, the newest first
    on_path = fake_python(bin_, "python3.12", "3.12")
    assert opswheel.find_python("3.12", None) == on_path
    assert opswheel.find_python("3.11", None) == str(bin_ / "python3")


@pytest.mark.parametrize(("version", "headers", "error", "text"), [
    ("3.11", True, BadValue, "is Python 3.11; the bundle is for 3.12"),
    ("3.12", False, EnvironmentProblem, "has no C headers"),
])
def test_a_build_python_given_must_be_the_version_with_headers(tmp_path, version, headers, error, text):
    exe = fake_python(tmp_path, "py", version, headers)
    with pytest.raises(error, match=text):
        opswheel.find_python("3.12", exe)
    with pytest.raises(BadValue, match="does not run"):
        opswheel.find_python("3.12", str(tmp_path / "nothing"))


def test_the_same_inputs_compile_once(tmp_path, monkeypatch):
    """The second build of the same inputs takes the first one's wheel; other archs compile again."""
    monkeypatch.setattr(opswheel.paths, "STATE_DIR", tmp_path / "state")
    venv = tmp_path / "venv-key"
    venv.mkdir()
    (venv / "ready").write_text("torch==2.11.0\n")
    monkeypatch.setattr(opswheel, "build_venv", lambda *a: venv)
    compiled = []

    def compile_ops(root, image, venv, facts, archs, sdist, aio, dest, logfile):
        compiled.append(archs)
        ds_wheel(dest, image, "3.12")
        (dest / "ops-facts.json").write_text("{}")

    monkeypatch.setattr(opswheel, "compile_ops", compile_ops)
    sdist = tmp_path / "deepspeed.tar.gz"
    sdist.write_bytes(b"sdist")
    said: list[str] = []
    built = [opswheel.build(ROOT, CUDA13, "3.12", "py", archs, sdist, tmp_path, tmp_path / f"d{i}", None, said.append)
             for i, archs in enumerate(("9.0", "9.0", "8.0;9.0"))]
    assert compiled == ["9.0", "8.0;9.0"] and "nothing compiled" in said[2]
    assert built[0].path.read_bytes() == built[1].path.read_bytes() and built[1].path.parent == tmp_path / "d1"


def test_a_failed_build_step_is_one_line_naming_its_log(tmp_path):
    log = tmp_path / "ops-build.log"
    with pytest.raises(CommandFailed) as e:
        opswheel.run(["sh", "-c", "echo compiling; echo 'nvcc fatal: no such arch' >&2; exit 3"], "opsbuild.py", log)
    assert e.value.exit_code == 1 and str(log) in str(e.value) and "nvcc fatal: no such arch" in str(e.value)
    assert "\n" not in str(e.value) and "compiling" in log.read_text()


@pytest.mark.parametrize(("args", "says"), [(["--python"], "--python needs a path"),
                                            (["--python", "/nonexistent/python3.12"], "no Python interpreter /nonexistent/python3.12")])
def test_run_sh_refuses_a_missing_interpreter_in_one_line(tmp_path, args, says):
    run_sh = tmp_path / "run.sh"
    run_sh.write_text(gpubundle.RUN_SH.format(image="x", python="3.12", torch="2.11.0", deepspeed="0.19.8", archs="9.0"))
    proc = subprocess.run(["sh", str(run_sh), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"run.sh: error: {says}" + (" (name one with --python PATH)" if "no Python" in says else "")]


def test_the_build_venv_holds_torch_deepspeeds_needs_and_the_toolkit_all_hashed():
    reqs = opswheel.build_requirements(ROOT, CUDA13)
    names = {ln.split("==")[0] for ln in reqs.splitlines() if "==" in ln}
    assert {"torch", "triton", "setuptools", "ninja", "hjson", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt"} <= names
    assert not {"jupyterlab", "tensorboard", "deepspeed"} & names
    blocks = [b for b in reqs.split("\n") if "==" in b]
    assert blocks and all(b.rstrip().endswith("\\") for b in blocks)  # each pin continues with its hashes


def deb(files: dict[str, bytes]) -> bytes:
    """A minimal Debian package: an ar archive with debian-binary and data.tar (dpkg takes it uncompressed too)."""
    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("data.tar", layer_tar(files))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + (b"\n" if len(data) % 2 else b"")
    return out


def test_a_deb_is_unpacked_without_dpkg(tmp_path):
    opswheel.extract_deb(deb({"./usr/lib/x86_64-linux-gnu/libaio.so.1.0.2": b"ELF", "./usr/include/libaio.h": b"/* h */"}), tmp_path)
    assert (tmp_path / "usr/lib/x86_64-linux-gnu/libaio.so.1.0.2").read_bytes() == b"ELF"
    assert (tmp_path / "usr/include/libaio.h").exists()
    with pytest.raises(ResolveError, match="no ar header"):
        opswheel.extract_deb(b"PK\x03\x04", tmp_path)


def test_libaio_at_another_version_than_the_lock_is_refused(tmp_path, monkeypatch):
    def toolkit(mirror, suite, components, packages, ca):
        return [debian.Deb(p, "0.3.999-1", f"pool/{p}.deb", "00", 1) for p in packages]

    monkeypatch.setattr(debian, "debian_toolkit", toolkit)
    with pytest.raises(ResolveError, match="has libaio1 0.3.999-1; the row's lock pins 0.3.113-4"):
        opswheel.libaio(CUDA13, ROOT, tmp_path, None)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_directory_is_filled(tmp_path, monkeypatch):
    fake_downloads(monkeypatch, state=tmp_path / "state")
    (tmp_path / "bundle").mkdir()
    gpubundle.write(ROOT, DEFAULT, tmp_path / "bundle", DEFAULT.python, None, log=lambda _: None)
    assert (tmp_path / "bundle" / "bundle.json").exists()


def test_a_bundle_over_the_limit_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    fake_downloads(monkeypatch, wheel_bytes=2**20, state=tmp_path / "state")
    with pytest.raises(BundleTooLarge) as e:
        gpubundle.write(ROOT, DEFAULT, tmp_path / "bundle", "3.11", None, limit_mib=5, log=lambda _: None)
    assert e.value.exit_code == 2 and "over the 5 MiB" in str(e.value) and "nothing written" in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["state"]  # no DIR, no staging directory


def test_the_size_check_names_the_largest_files():
    files = {"a": {"size": 3 * 2**20}, "b": {"size": 2**20}, "c": {"size": 10}}
    assert gpubundle.check_size(files, 5) == 4 * 2**20 + 10
    with pytest.raises(BundleTooLarge, match=r"4\.0 MiB, over the 3 MiB .*largest: a 3\.0 MiB, b 1\.0 MiB"):
        gpubundle.check_size(files, 3)


def test_the_repositorys_tracked_files_count_against_the_limit():
    files = {"a": {"size": 50 * 2**20}}
    assert gpubundle.check_size(files, 64, beside=10 * 2**20) == 50 * 2**20
    with pytest.raises(BundleTooLarge, match=r"50\.0 MiB with the repository's 15\.0 MiB of tracked files beside it, over the 64"):
        gpubundle.check_size(files, 64, beside=15 * 2**20)
    tracked = gpubundle.tracked_bytes(ROOT)
    assert 2**20 < tracked < 64 * 2**20  # this checkout's, as a lent machine's command carries it


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
    (["--ops-wheel", "/nonexistent/deepspeed.whl"], "--ops-wheel /nonexistent/deepspeed.whl: no such file"),
    (["--ops-wheel", "/etc/hostname", "--build-python", "/usr/bin/python3"], "name one of them"),
    (["--ops-arch", "sm_90"], "--ops-arch 'sm_90': expected TORCH_CUDA_ARCH_LIST's form"),
])
def test_cli_bad_options(tmp_path, monkeypatch, args, text):
    fake_downloads(monkeypatch)
    one_error_line(run_cli(ROOT, "gpu-bundle", "--torch", "2.7", str(tmp_path / "b"), *args, env=NO_DOCKER), 2, text)
    assert list(tmp_path.iterdir()) == []


def test_cli_without_a_python_of_the_target_version_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no python3.99, no uv
    proc = run_cli(ROOT, "gpu-bundle", "--torch", "2.7", "--python", "3.99", str(tmp_path / "b"), env=NO_DOCKER)
    one_error_line(proc, 2, "no Python 3.99 with its headers")
    assert not (tmp_path / "b").exists()


@pytest.mark.network
def test_a_real_bundle_of_the_default_row_fits_and_its_files_are_the_locked_ones(tmp_path):
    """The index's wheels and Debian's libaio for real, around a stand-in wheel (the build is opswheel's, tested above)."""
    given = ds_wheel(tmp_path / "given", DEFAULT, "3.12")
    proc = run_cli(ROOT, "gpu-bundle", "--torch", "2.7", "--cuda", "12.1", "--python", "3.12", "--ops-wheel", str(given),
                   str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr
    desc = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert 0 < desc["size"] <= gpubundle.LIMIT_MIB * 2**20
    wheels = [f for f in desc["files"] if f.startswith("wheels/")]
    assert len(wheels) == len(desc["wheels"])
    assert not [w for w in wheels if "-cp3" in w and "-cp312-" not in w and "abi3" not in w]  # for the target Python
    assert (tmp_path / "b" / "lib" / "libaio.so.1").read_bytes()[:4] == b"\x7fELF" and desc["libaio"]["package"] == "libaio1 0.3.113-4"
