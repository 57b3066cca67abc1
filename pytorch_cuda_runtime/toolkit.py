"""Lay out the row's CUDA toolkit as one CUDA_HOME (bin/, nvvm/, include/, lib64/) in a builder stage.

    toolkit.py debs LOCK --debs DIR --prefix DIR    .debs of a Debian suite, sha256-checked, unpacked
    toolkit.py wheels --prefix DIR                  NVIDIA's wheels, already pip-installed in this venv

Both end with the layout NVIDIA's own installer makes, so torch's cpp_extension and DeepSpeed
find everything from CUDA_HOME alone, and both prove the compiler works by building a kernel.
The .debs come from DIR, where the build bind-mounts them from the host's store: nothing is
downloaded here. Standard library only (and lockfile.py beside it): it runs before anything but
Python is in the stage.
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from pytorch_cuda_runtime import lockfile
except ImportError:  # run as a script in a build step, with lockfile.py copied beside it
    import lockfile  # type: ignore[no-redef]

# Debian splits the toolkit over /usr/bin, /usr/lib/nvidia-cuda-toolkit and the multiarch
# library directory; NVIDIA's layout keeps it under one prefix with its own nvcc.profile.
NVCC_PROFILE = """\
TOP              = $(_HERE_)/..
CICC_PATH        = $(TOP)/nvvm/bin
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(CICC_PATH):$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
"""
DEBIAN_TOOLS = ("ptxas", "fatbinary", "cudafe++", "nvlink", "bin2c", "cuobjdump", "nvdisasm", "nvprune", "cu++filt")
KEEP_STATIC = ("libcudart_static.a", "libcudadevrt.a", "libculibos.a")
PROBE_KERNEL = "__global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }\nint main() { return 0; }\n"


def fail(msg):
    sys.exit(f"toolkit: error: {msg}")


def read_lock(path):
    """The .debs of a Debian toolkit.lock."""
    try:
        debs = lockfile.debs(Path(path).read_text(), str(path))
    except lockfile.LockFormatError as e:
        fail(str(e))
    if not debs:
        fail(f"{path} lists no .deb")
    return debs


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def locked_file(deb, folder):
    """The .deb from the folder of locked files, checked against its sha256."""
    path = Path(folder) / deb.file
    if not path.is_file():
        fail(f"{deb.file} is not in {folder}: the build stages every locked .deb there from the host's store")
    got = sha256_file(path)
    if got != deb.sha256:
        fail(f"{path}: sha256 {got} is not the locked {deb.sha256}")
    return path


def copy_tree(src, dest, skip=lambda name: False):
    """Files and symlinks of src into dest, keeping links as links; names `skip` accepts are left out."""
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (Path(dest) / rel).mkdir(parents=True, exist_ok=True)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            if skip(name):
                continue
            s, d = Path(root) / name, Path(dest) / rel / name
            if s.is_symlink():
                d.unlink(missing_ok=True)
                d.symlink_to(os.readlink(s))
            else:
                shutil.copy2(s, d)


def layout_debs(staging, prefix):
    usr = Path(staging) / "usr"
    own = usr / "lib" / "nvidia-cuda-toolkit"
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(own / "bin" / "nvcc", prefix / "bin" / "nvcc")
    shutil.copytree(own / "bin" / "crt", prefix / "bin" / "crt")
    for tool in DEBIAN_TOOLS:
        shutil.copy2(usr / "bin" / tool, prefix / "bin" / tool)
    (prefix / "nvvm" / "bin").mkdir(parents=True)
    shutil.copy2(own / "bin" / "cicc", prefix / "nvvm" / "bin" / "cicc")
    shutil.copytree(own / "libdevice", prefix / "nvvm" / "libdevice")
    copy_tree(usr / "include", prefix / "include")
    # Static archives are most of nvidia-cuda-dev's 2.5 GB; extensions link dynamically. nvcc
    # itself links every program with the small static runtime and device runtime.
    copy_tree(usr / "lib" / "x86_64-linux-gnu", prefix / "lib64", skip=lambda n: n.endswith(".a") and n not in KEEP_STATIC)
    (prefix / "bin" / "nvcc.profile").write_text(NVCC_PROFILE)


def drop_dangling(lib):
    """-dev symlinks to libraries of packages we did not unpack (cuBLAS, cuFFT, ...): torch's
    wheels carry those at run time; a link library that points nowhere would only mislead."""
    gone = []
    for p in sorted(Path(lib).rglob("*")):
        if p.is_symlink() and not p.exists():
            p.unlink()
            gone.append(p.name)
    return gone


def cmd_debs(args):
    prefix = Path(args.prefix)
    if prefix.exists():
        fail(f"{prefix} exists already")
    with tempfile.TemporaryDirectory() as staging:
        for deb in read_lock(args.lock):
            subprocess.run(["dpkg-deb", "-x", str(locked_file(deb, args.debs)), staging], check=True)
            print(f"toolkit: unpacked {deb.package}={deb.version}", flush=True)
        layout_debs(staging, prefix)
    gone = drop_dangling(prefix / "lib64")
    print(f"toolkit: left out link libraries of packages not unpacked: {' '.join(gone) or 'none'}")
    prove(prefix)


def cmd_wheels(args):
    """NVIDIA's wheels already are a CUDA_HOME (nvidia/cuXY/{bin,nvvm,include,lib}); add lib64
    and the unversioned link names the linker looks for, and point the prefix at it."""
    import site

    homes = [p.parent.parent for sp in site.getsitepackages() for p in Path(sp).glob("nvidia/cu*/bin/nvcc")]
    if len(homes) != 1:
        fail(f"expected one nvidia/cu*/bin/nvcc in site-packages, found {len(homes)}; is toolkit.lock installed?")
    home = homes[0]
    lib = home / "lib"
    if not (home / "lib64").exists():
        (home / "lib64").symlink_to("lib")
    for so in sorted(lib.glob("lib*.so.*")):
        link = lib / (so.name.split(".so.")[0] + ".so")
        if not link.exists():
            link.symlink_to(so.name)
    prefix = Path(args.prefix)
    if prefix.is_symlink() or prefix.exists():
        fail(f"{prefix} exists already")
    prefix.symlink_to(home)
    prove(prefix)


def prove(prefix):
    """nvcc runs, finds cicc, headers and libraries: compile and link a kernel for two archs."""
    nvcc = prefix / "bin" / "nvcc"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    if version.returncode != 0:
        fail(f"{nvcc} --version failed: {version.stderr.strip()}")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cu"
        src.write_text(PROBE_KERNEL)
        cmd = [str(nvcc), "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
               "-o", str(Path(d) / "probe"), str(src), "-lcudart"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{nvcc} cannot build a kernel: {(r.stderr or r.stdout).strip()[-800:]}")
    print(f"toolkit: {prefix}: {version.stdout.strip().splitlines()[-1]}; compiles and links for sm_80 and sm_90")


def main(argv=None):
    p = argparse.ArgumentParser(prog="toolkit.py", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("debs")
    d.add_argument("lock")
    d.add_argument("--debs", required=True, help="the folder of the locked .debs (read only)")
    d.add_argument("--prefix", required=True)
    w = sub.add_parser("wheels")
    w.add_argument("--prefix", required=True)
    args = p.parse_args(argv)
    (cmd_debs if args.cmd == "debs" else cmd_wheels)(args)


if __name__ == "__main__":
    main()
