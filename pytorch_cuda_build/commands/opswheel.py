"""The gpu-bundle's DeepSpeed wheel, its ops prebuilt here, and libaio's library beside it.

A lent GPU machine must compile nothing, so the bundle carries the wheel the image's own recipe
makes (opsbuild.py, the row's locked sdist, torch and CUDA toolkit), built for the machine's
Python and its GPU archs. Two ways to it:

  build()      here, by a Python of the target version (`--build-python`, else found: pythonX.Y on
               PATH, python3, `uv python find X.Y`, pyenv's versions), in a venv of its own (kept
               under the state dir) holding the row's locked torch and toolkit with --require-hashes;
               its headers are what the ops' Python bindings compile against, so it must be that
               version. The wheel is kept there too, under the hash of every input of the compile:
               the same inputs again compile nothing
  from_file()  a wheel made before (`--ops-wheel FILE`), checked like a built one: DeepSpeed at the
               row's version, tagged for the target Python, built for `cuda` with every op of the row

libaio1's and libaio-dev's .debs come from the row's Debian mirror, checked against its signed
index: the headers let async_io build here; libaio.so.1 travels for the machine to load it.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import paths
from ..errors import BadFile, BadValue, CommandFailed, EnvironmentProblem, ImageUnfit, ResolveError
from ..matrix import REPRODUCIBLE_EPOCH, Image
from ..resolve import debian
from ..stages import lock
from .lockpins import closure, parse_lock

# The archs a lent machine has: H100 and H200 are sm_90. Each more arch adds its cubins to the
# wheel and its compile time here; `--ops-arch` names others (docs/ops.md: what fits 64 MiB).
DEFAULT_ARCHS = "9.0"
LIBAIO = ("libaio1", "libaio-dev")
LIBAIO_SO = "libaio.so.1"


@dataclass(frozen=True)
class OpsWheel:
    path: Path  # the wheel, in a directory of its own
    ops: list[str]
    arch_list: str  # TORCH_CUDA_ARCH_LIST it was compiled for
    torch: str  # torch's version it was built against, as DeepSpeed recorded it
    source: str  # how it came: built here by which Python, or the file given

    def record(self, rel: str) -> dict:
        return {"file": rel, "ops": self.ops, "arch_list": self.arch_list, "torch": self.torch, "source": self.source}


def wheel_facts(wheel: Path) -> dict:
    """What DeepSpeed's wheel says of itself: git_version_info_installed.py's assignments."""
    try:
        with zipfile.ZipFile(wheel) as z:
            text = z.read("deepspeed/git_version_info_installed.py").decode()
            if not [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]:
                raise KeyError("no .dist-info/RECORD")
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise BadFile(f"{wheel}: not a DeepSpeed wheel with its build record ({e})", path=wheel) from None
    ns: dict = {}
    exec(compile(text, str(wheel), "exec"), ns)  # DeepSpeed writes plain assignments there
    return ns


def check(wheel: Path, image: Image, python: str) -> tuple[list[str], str]:
    """(ops, torch version) of a wheel fit for this row and Python, else BadFile naming what is wrong."""
    tag = "cp" + python.replace(".", "")
    m = re.fullmatch(r"deepspeed-([^-]+)-(cp\d+)-(cp\d+|abi3|none)-linux_x86_64\.whl", wheel.name)
    if not m:
        raise BadFile(f"{wheel.name}: expected deepspeed-{image.deepspeed}-{tag}-{tag}-linux_x86_64.whl (a wheel with "
                         "compiled ops is tagged for one Python)", path=wheel)
    if m.group(1) != image.deepspeed or m.group(2) != tag:
        raise BadFile(f"{wheel.name}: the bundle needs DeepSpeed {image.deepspeed} for Python {python} ({tag})", path=wheel)
    ns = wheel_facts(wheel)
    missing = [op for op in image.prebuilt_ops if not ns.get("installed_ops", {}).get(op)]
    if ns.get("accelerator_name") != "cuda" or missing:
        raise BadFile(f"{wheel.name}: built for {ns.get('accelerator_name')!r} without {', '.join(missing) or '-'}; "
                         f"the row's ops are {', '.join(image.prebuilt_ops)} for cuda", path=wheel)
    torch = str(ns.get("torch_info", {}).get("version", "?"))
    if not image.torch.startswith(torch + ".") and image.torch != torch:
        raise BadFile(f"{wheel.name}: built against torch {torch}, the row's is {image.torch}", path=wheel)
    return list(image.prebuilt_ops), torch


def from_file(given: Path, image: Image, python: str, dest: Path) -> OpsWheel:
    """A wheel made before, checked, copied into dest; its ops-facts.json beside it, when there, gives the archs."""
    if not given.is_file():
        raise BadFile(f"--ops-wheel {given}: no such file", path=given)
    ops, torch = check(given, image, python)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(given, dest / given.name)
    facts = given.parent / "ops-facts.json"
    archs = json.loads(facts.read_text()).get("ops_arch_list", "?") if facts.is_file() else "not recorded"
    return OpsWheel(dest / given.name, ops, archs, torch, f"given: {given.name}")


def python_version(exe: str) -> tuple[str, bool] | None:
    """(MAJOR.MINOR, has its C headers) of an interpreter, or None when it does not run."""
    code = ("import os, sys, sysconfig; print('%d.%d' % sys.version_info[:2], "
            "os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))")
    try:
        out = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[0], out[1] == "True") if len(out) == 2 else None


def candidates(python: str) -> list[str]:
    """Where a Python of this version may be: on PATH, then uv's own (`uv python find`), then
    pyenv's versions (a pyenv shim answers only for the versions pyenv has activated)."""
    found = [p for p in (shutil.which(f"python{python}"), shutil.which("python3")) if p]
    uv, pyenv = shutil.which("uv"), shutil.which("pyenv")
    if uv:
        proc = subprocess.run([uv, "python", "find", python], capture_output=True, text=True, timeout=60)
        found += [proc.stdout.strip()] if proc.returncode == 0 and proc.stdout.strip() else []
    if pyenv:
        proc = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=60)
        versions = Path(proc.stdout.strip()) / "versions" if proc.returncode == 0 and proc.stdout.strip() else None
        newest = sorted(versions.glob(f"{python}.*/bin/python{python}") if versions else [], reverse=True,
                        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
        found += [str(p) for p in newest]
    return found


def find_python(python: str, given: str | None) -> str:
    """The interpreter that builds the wheel: the one given, else the first found, of the target
    version and with its headers; EnvironmentProblem (one line) when there is none."""
    if given:
        seen = python_version(given)
        if seen is None:
            raise BadValue(f"--build-python {given}: does not run", name="--build-python")
        if seen[0] != python:
            raise BadValue(f"--build-python {given} is Python {seen[0]}; the bundle is for {python}", name="--build-python")
        if not seen[1]:
            raise EnvironmentProblem(f"--build-python {given} has no C headers (Python.h); install its -dev package")
        return given
    for exe in candidates(python):
        seen = python_version(exe)
        if seen == (python, True):
            return exe
    raise EnvironmentProblem(f"no Python {python} with its headers to build the ops wheel with (looked for python{python} "
                             f"and python3 on PATH, `uv python find {python}` and pyenv's versions): name one with --build-python PATH "
                             f"(e.g. after `uv python install {python}`), or give a wheel built before with --ops-wheel FILE")


def run(cmd: list[str], what: str, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise CommandFailed(f"{what} (log {log})", proc.returncode, lines[-1] if lines else "")


def build_requirements(root: Path, image: Image) -> str:
    """What the build venv installs: torch with everything it needs, DeepSpeed's build and run
    requirements (its setup.py imports torch and them), and the row's CUDA toolkit; all hashed."""
    folder = lock.build_dir(root, image)
    pins = parse_lock((folder / "requirements.lock").read_text())
    keep = closure(pins, ("torch", "deepspeed", "setuptools", "ninja", "packaging"), excluded=None)
    toolkit = (folder / "toolkit.lock").read_text() if (folder / "toolkit.lock").exists() else ""
    if not toolkit.strip():
        raise ImageUnfit(f"{image.name}: the row's toolkit is not from PyPI wheels (no toolkit.lock); build its wheel in "
                         "the image and give it with --ops-wheel", ref=image.name)
    return "".join(p.text for p in keep) + "\n".join(ln for ln in toolkit.splitlines() if not ln.startswith("#")) + "\n"


def build_venv(root: Path, image: Image, exe: str, index: str, ca: str | None, log: Path) -> Path:
    """A venv of exe with the row's torch and toolkit, kept under the state dir by what it holds."""
    reqs = build_requirements(root, image)
    key = hashlib.sha256(f"{os.path.realpath(exe)}\0{reqs}".encode()).hexdigest()[:16]
    venv = paths.STATE_DIR / "gpu-bundle" / f"venv-{image.name}-{key}"
    if (venv / "ready").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a venv whose install was cut
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([exe, "-m", "venv", str(venv)], f"{exe} -m venv", log)
    req = venv / "requirements.txt"
    req.write_text(reqs)
    run([str(venv / "bin" / "python"), "-m", "pip", "--isolated", "install", "--quiet", "--no-deps", "--require-hashes", "--only-binary=:all:",
         "--index-url", index, *(["--cert", ca] if ca else []), "-r", str(req)], "installing the build venv's torch and toolkit", log)
    run([str(venv / "bin" / "python"), str(root / "pytorch_cuda_runtime" / "toolkit.py"), "wheels", "--prefix",
         str(venv / "cuda")], "laying out the toolkit as a CUDA_HOME", log)
    (venv / "ready").write_text(reqs)
    return venv


def deb_members(data: bytes) -> dict[str, bytes]:
    """The members of a .deb (an ar archive) by name."""
    if not data.startswith(b"!<arch>\n"):
        raise ResolveError("not a Debian package (no ar header)")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58].decode().strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def extract_deb(data: bytes, dest: Path) -> None:
    members = deb_members(data)
    name = next((n for n in members if n.startswith("data.tar")), None)
    if name is None:
        raise ResolveError("a Debian package without data.tar")
    with tarfile.open(fileobj=io.BytesIO(members[name])) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(dest, filter="data")
            return
        # Python 3.11.2 (Debian bookworm's, what a runner's setup-python may give) has no extraction
        # filters: refuse what the "data" filter would (a path or a link leaving dest, devices).
        for member in t.getmembers():
            target = (dest / member.name).resolve()
            link = (target.parent / member.linkname).resolve() if member.issym() else \
                (dest / member.linkname).resolve() if member.islnk() else target
            if not (target.is_relative_to(dest.resolve()) and link.is_relative_to(dest.resolve())) or member.isdev():
                raise ResolveError(f"a Debian package member leaves the extraction directory: {member.name}")
        t.extractall(dest)


def libaio(image: Image, root: Path, cache: Path, ca: str | None) -> tuple[Path, str]:
    """(prefix with usr/include/libaio.h and the libraries, "libaio1 VERSION") from the row's mirror,
    at the version the row's lock names, each .deb checked against the signed index."""
    facts = lock.read(root, image)
    base = facts["inputs"]["base"]
    pinned = {name: facts["apt"].get(name) for name in LIBAIO}
    prefix = cache / f"libaio-{pinned['libaio1']}"
    if (prefix / "ready").exists():
        return prefix, f"libaio1 {pinned['libaio1']}"
    debs = debian.debian_toolkit(base["mirror"], base["suite"], ("main",), LIBAIO, ca)
    for deb in debs:
        if pinned[deb.package] and deb.version != pinned[deb.package]:
            raise ResolveError(f"{base['mirror']} {base['suite']} has {deb.package} {deb.version}; the row's lock pins "
                               f"{pinned[deb.package]} (run `build.py lock`)")
    tmp = Path(tempfile.mkdtemp(prefix=prefix.name + ".", dir=cache))
    try:
        for deb in debs:
            extract_deb(debian.fetch_verified(f"{base['mirror'].rstrip('/')}/{deb.filename}", deb.sha256, ca), tmp)
        (tmp / "ready").write_text("\n".join(f"{d.package} {d.version} {d.sha256}" for d in debs) + "\n")
        shutil.rmtree(prefix, ignore_errors=True)
        tmp.rename(prefix)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix, f"libaio1 {debs[0].version}"


def libaio_so(prefix: Path) -> Path:
    found = sorted(prefix.rglob(LIBAIO_SO))
    if not found:
        raise ResolveError(f"libaio1's package holds no {LIBAIO_SO}")
    return found[0].resolve()


def build(root: Path, image: Image, python: str, exe: str, archs: str, sdist: Path, aio: Path, dest: Path,
          ca: str | None, log: Callable[[str], None]) -> OpsWheel:
    """opsbuild.py in the build venv, for archs, with libaio's headers from aio: the wheel in dest."""
    facts = lock.read(root, image)
    logfile = paths.STATE_DIR / "gpu-bundle" / f"ops-build-{image.name}-py{python}.log"  # kept after a failure
    logfile.unlink(missing_ok=True)
    log(f"building DeepSpeed {image.deepspeed}'s ops ({', '.join(image.prebuilt_ops)}) for {archs} with {exe}; log {logfile}")
    venv = build_venv(root, image, exe, facts["inputs"]["index"], ca, logfile)
    key = wheel_key(root, image, venv, sdist, archs)
    cached = paths.STATE_DIR / "gpu-bundle" / "wheels" / key
    if (cached / "ops-facts.json").is_file():
        shutil.copytree(cached, dest, dirs_exist_ok=True)
        log(f"the ops were built before from the same inputs ({key[:16]}): taken from {cached}, nothing compiled")
    else:
        compile_ops(root, image, venv, facts, archs, sdist, aio, dest, logfile)
        tmp = cached.with_name(cached.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dest, tmp)
        tmp.rename(cached)
    wheels = sorted(dest.glob("deepspeed-*.whl"))
    if len(wheels) != 1:
        raise CommandFailed("opsbuild.py", 1, f"expected one DeepSpeed wheel in {dest}, found {len(wheels)}")
    ops, torch = check(wheels[0], image, python)
    return OpsWheel(wheels[0], ops, archs, torch, f"built here by opsbuild.py with Python {python} ({exe})")


def wheel_key(root: Path, image: Image, venv: Path, sdist: Path, archs: str) -> str:
    """Everything the compiled wheel depends on: the build venv (its Python and locked wheels), the
    sdist's bytes, opsbuild.py, the ops, the CPU baseline and the archs."""
    h = hashlib.sha256()
    recipe = root / "pytorch_cuda_runtime" / "opsbuild.py"
    for part in (venv.name, (venv / "ready").read_text(), hashlib.sha256(sdist.read_bytes()).hexdigest(),
                 hashlib.sha256(recipe.read_bytes()).hexdigest(), ",".join(image.prebuilt_ops), image.cpu_arch, archs):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def compile_ops(root: Path, image: Image, venv: Path, facts: dict, archs: str, sdist: Path, aio: Path, dest: Path,
                logfile: Path) -> None:
    lib = next((p.parent for p in aio.rglob("libaio.so*")), aio)
    env = dict(os.environ, CUDA_HOME=str(venv / "cuda"), PYTHONPATH=str(root),
               CPATH=os.pathsep.join(filter(None, [str(aio / "usr" / "include"), os.environ.get("CPATH")])),
               LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib), os.environ.get("LIBRARY_PATH")])),
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")])),
               PATH=os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]))
    run([str(venv / "bin" / "python"), "-m", "pytorch_cuda_runtime.opsbuild", str(sdist), "--ops", ",".join(image.prebuilt_ops),
         "--cpu-arch", image.cpu_arch, "--dist", str(dest), "--toolkit", str(facts.get("cuda_toolkit")),
         "--arch-list", archs, "--epoch", str(REPRODUCIBLE_EPOCH)], "opsbuild.py", logfile, env=env, cwd=dest.parent)
    (dest / "ops-cache-key").unlink(missing_ok=True)  # the images' key, which this wheel (one arch list) is not under


def strip_debug(wheel: Path) -> tuple[int, int]:
    """Rewrite the wheel in place with its ops' debug info stripped (`strip --strip-debug`: DWARF
    only; the code, its symbols and the CUDA fatbins stay) and RECORD's hashes and sizes made
    to match; entry order kept, times fixed. The bundle's 64 MiB needs it: DeepSpeed compiles
    its ops with -g. (bytes before, bytes after)."""
    strip = shutil.which("strip")
    if not strip:
        raise EnvironmentProblem("`strip` (binutils) is needed to fit the ops into the bundle: apt-get install binutils")
    before = wheel.stat().st_size
    tmp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src, tempfile.TemporaryDirectory() as d:
        contents = {i.filename: src.read(i) for i in src.infolist()}
        for name in [n for n in contents if n.endswith(".so")]:
            so = Path(d) / "op.so"
            so.write_bytes(contents[name])
            proc = subprocess.run([strip, "--strip-debug", str(so)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise CommandFailed(f"strip --strip-debug {name}", proc.returncode, proc.stderr.strip())
            contents[name] = so.read_bytes()
        record = next((n for n in contents if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            raise BadFile(f"{wheel.name}: a wheel without RECORD", path=wheel)
        contents[record] = rewrite_record(contents[record].decode(), contents).encode()
        stamp = time.gmtime(max(REPRODUCIBLE_EPOCH, 315532800))[:6]
        with zipfile.ZipFile(tmp, "w") as out:
            for info in src.infolist():
                entry = zipfile.ZipInfo(info.filename, date_time=stamp)
                entry.external_attr, entry.create_system = info.external_attr, 3
                out.writestr(entry, contents[info.filename], compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def rewrite_record(text: str, contents: dict[str, bytes]) -> str:
    """RECORD with each listed file's sha256 and size as in contents (RECORD's own line stays hashless)."""
    lines = []
    for line in text.splitlines():
        path, digest, size = line.rsplit(",", 2) if line.count(",") >= 2 else (line, "", "")
        if digest and path in contents:
            b64 = base64.urlsafe_b64encode(hashlib.sha256(contents[path]).digest()).rstrip(b"=").decode()
            line = f"{path},sha256={b64},{len(contents[path])}"
        lines.append(line)
    return "\n".join(lines) + "\n"
