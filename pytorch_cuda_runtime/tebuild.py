"""Build Transformer Engine's PyTorch extension against the image's torch, then prove it.

    tebuild.py build SDIST --dist DIR --epoch N [--cache DIR] [--seed DIR]

PyPI has transformer-engine-torch only as an sdist; installed as it is, it compiles for 20 minutes
or more on each machine, after trying to download a wheel from GitHub. Here it is compiled once, in
the train flavor's builder stage, into a wheel the image installs (docs/train.md):
- the sdist is the locked file (extras-build.lock), which the build bind-mounts from the host's
  store, where it entered only with the lock's sha256: nothing is downloaded here;
- NVTE_PYTORCH_FORCE_BUILD: no download; NVTE_BUILD_USE_NVIDIA_WHEELS: the headers of NVIDIA's
  wheels (CUDA, cuDNN, NCCL, CCCL) that the image itself carries, not a toolkit's;
- the extension is C++ only (no device code: the GPU kernels are in transformer-engine-cu13's
  prebuilt core library), so it needs no GPU and no GPU architecture list; the check proves it
  has no CUDA device code and needs no libcuda.so.1, so it loads on hosts without a driver.
As opsbuild.py does for DeepSpeed, the wheel is kept in a cache under the key of every input of the
compile, and taken from the host's seed (a --no-cache build's empty cache) when the key matches.
Standard library only, apart from torch (for the key).
"""
import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sysconfig
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

KEY_FILE = "te-cache-key"
FACTS = "te-facts.json"
NAME = "transformer-engine-torch"
# Objects record the directory they were compiled in: one fixed directory keeps a rebuild identical.
BUILD_DIR = Path("/tmp/pytorch-cuda-tebuild")
# One g++ of TE's largest files peaks at 2.6 GiB (measured): jobs are capped by memory, not cores only.
GIB_PER_JOB = 3
# The recipe: how the sdist is compiled. Part of the cache key (a change compiles again), where
# the rest of this file (fetching, checking) is not.
RECIPE = {"NVTE_FRAMEWORK": "pytorch", "NVTE_PYTORCH_FORCE_BUILD": "TRUE", "NVTE_BUILD_USE_NVIDIA_WHEELS": "1",
          "PYTHONHASHSEED": "0"}
PIP_WHEEL = ("wheel", "--no-deps", "--no-build-isolation", "--no-index")


def fail(msg):
    sys.exit(f"tebuild: error: {msg}")


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def environment_versions():
    """The versions of what the extension is compiled against: torch, NVIDIA's wheels, TE's core."""
    keep = re.compile(r"^(torch|nvidia-.*|cuda-toolkit|transformer-engine.*)$")
    found = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in importlib.metadata.distributions()}
    return {k: v for k, v in sorted(found.items()) if keep.match(k)}


def cache_key(sdist):
    """Every input of the compile: the sources, this recipe, the machine, torch's build, the headers' wheels, the compiler."""
    import torch

    h = hashlib.sha256()
    # The machine too: the cache mount is one for every platform, and torch, Python and g++ report
    # the same versions on x86-64 and aarch64 (an arm64 build once took the x86-64 wheel).
    for part in (sha256_file(sdist), json.dumps([RECIPE, PIP_WHEEL, str(BUILD_DIR)]), platform.machine(), sysconfig.get_platform(),
                 torch.__version__, str(torch.version.cuda),
                 json.dumps(environment_versions(), sort_keys=True), sys.version,
                 subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def jobs():
    """Parallel compiles: the cores, at most one per GIB_PER_JOB of memory."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return max(1, min(os.cpu_count() or 1, int(mem // GIB_PER_JOB)))


@contextlib.contextmanager
def build_dir(path=BUILD_DIR):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def build(sdist, dist, epoch):
    """Compile the wheel into dist; the seconds it took and the jobs it ran."""
    n = jobs()
    with build_dir() as tmp:
        with tarfile.open(sdist) as t:
            t.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(tmp)  # 3.11.2 lacks filters
        src = next(Path(tmp).iterdir())
        env = dict(os.environ, **RECIPE, MAX_JOBS=str(n), SOURCE_DATE_EPOCH=str(epoch))
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # torch's BuildExtension runs the venv's ninja
        print(f"tebuild: compiling {sdist.name} against torch with {n} jobs", flush=True)
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "pip", *PIP_WHEEL, "--wheel-dir", str(dist), str(src)], env=env, check=True)
        return round(time.monotonic() - t0, 1), n


# readelf -h's Machine line for each platform.machine() this builds on.
ELF_MACHINES = {"x86_64": "Advanced Micro Devices X86-64", "aarch64": "AArch64"}


def needed(path):
    """The shared libraries an ELF file names (DT_NEEDED), whether it has CUDA device code, and its machine."""
    dyn = subprocess.run(["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    sections = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    header = subprocess.run(["readelf", "-h", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    machine = re.search(r"^\s*Machine:\s*(.+?)\s*$", header, re.M)
    return (re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn), ".nv_fatbin" in sections,
            machine.group(1) if machine else "?")


def check_wheel(wheel):
    """One extension module, with no device code, needing no driver; what it needs."""
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
        z.extractall(d)
        sos = sorted(Path(d).rglob("transformer_engine_torch*.so"))
        if len(sos) != 1:
            fail(f"{wheel.name} holds {len(sos)} transformer_engine_torch extension modules, not one")
        libs, device_code, machine = needed(sos[0])
        want = ELF_MACHINES.get(platform.machine(), platform.machine())
        if machine != want:
            fail(f"{sos[0].name} is built for {machine}, not this machine ({want})")
        if any(lib.startswith("libcuda.so") for lib in libs):
            fail(f"{sos[0].name} needs the CUDA driver (libcuda.so) to load; it must load on hosts without one")
        if device_code:
            fail(f"{sos[0].name} carries CUDA device code; it was expected to be C++ only")
        return {"module": str(sos[0].relative_to(d)), "needed": libs}


def main(argv=None):
    p = argparse.ArgumentParser(prog="tebuild.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile SDIST into a wheel in DIST, or take it from the cache or the seed")
    b.add_argument("sdist", type=Path)
    b.add_argument("--dist", type=Path, required=True)
    b.add_argument("--cache", type=Path)
    b.add_argument("--seed", type=Path)
    b.add_argument("--epoch", type=int, required=True, help="SOURCE_DATE_EPOCH for the wheel's file times")
    a = p.parse_args(argv)
    build_or_take(a.sdist, a.dist, a.cache, a.seed, a.epoch)


def build_or_take(sdist, dist, cache, seed, epoch):
    """The wheel in dist: from the cache or the seed when its key is there, else compiled; proved either way."""
    dist.mkdir(parents=True, exist_ok=True)
    key = cache_key(sdist)
    cached = cache / key if cache else None
    found = next((d for d in (cached, seed / key if seed else None) if d and (d / FACTS).exists()), None)
    if found:
        for f in found.iterdir():
            shutil.copy2(f, dist / f.name)
        print(f"tebuild: inputs {key[:16]} built before; wheel taken from {'the cache' if found == cached else 'the host seed'}, "
              "nothing compiled", flush=True)
    else:
        seconds, n = build(sdist, dist, epoch)
        wheels = sorted(dist.glob("transformer_engine_torch-*.whl"))
        if len(wheels) != 1:
            fail(f"expected one {NAME} wheel in {dist}, found {len(wheels)}")
        facts = {"transformer_engine_torch": re.sub(r"^transformer_engine_torch-|\.tar\.gz$", "", sdist.name),
                 "sdist_sha256": sha256_file(sdist), "compile_seconds": seconds, "compile_jobs": n,
                 "compiled_against": environment_versions(), **check_wheel(wheels[0])}
        (dist / FACTS).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        print(f"tebuild: {wheels[0].name} compiled in {seconds} s with {n} jobs", flush=True)
    (dist / KEY_FILE).write_text(key + "\n")
    wheels = sorted(dist.glob("transformer_engine_torch-*.whl"))
    if len(wheels) != 1:
        fail(f"expected one {NAME} wheel in {dist}, found {len(wheels)}")
    check_wheel(wheels[0])  # a cached wheel is proved again, like a new one
    if cached and not cached.exists():
        tmp = cached.with_name(cached.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dist, tmp)
        tmp.rename(cached)


if __name__ == "__main__":
    main()
