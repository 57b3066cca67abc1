"""Build DeepSpeed's wheel with its ops compiled for the `cuda` accelerator, then prove it.

    opsbuild.py SDIST --ops cpu_adam,fused_adam,... --cpu-arch x86-64-v3 --dist DIR

DeepSpeed's recipe for a builder without a GPU (its nv-pre-compile-ops workflow):
DS_ACCELERATOR=cuda, TORCH_CUDA_ARCH_LIST and one DS_BUILD_<OP> per op. An op whose
prerequisites are missing is skipped with a warning only, so every op is checked in the
finished wheel. The same script builds the wheel in an image's builder stage and on a
machine without Docker (`python -m pytorch_cuda_runtime.opsbuild`), with torch and a
CUDA toolkit (CUDA_HOME) already installed. Standard library only, apart from torch.
"""
import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, NoReturn

# Patches to DeepSpeed's sources, each (file, old, new, sign the fix is upstream already).
# 1. CPU ops are compiled for the build host's CPU (-march=native, AVX-512 where present);
#    such an op dies with SIGILL on a GPU node without AVX-512: use the matrix's baseline.
#    The sdist has two copies of the builder: op_builder/ (what setup.py compiles the wheel's
#    ops with) and deepspeed/ops/op_builder/ (what the installed DeepSpeed JIT-compiles with:
#    the CPU accelerator's ops, and every op built on first use). Both are patched.
# 2. DeepSpeed < 0.18 (PR #8539): _allgather_params_coalesced waits only on the last async
#    all_gather; on gloo the handles are independent threads, so GatheredParameters can
#    read half-gathered memory (all-NaN weights seen in DeepSpeed's own checkpoint test).
RACE_OLD = "        launch_handles[-1].wait()\n"
RACE_NEW = "        for handle in launch_handles:  # PR #8539: every gloo handle, not the last\n            handle.wait()\n"
RACE_FIXED = "for handle in launch_handles:"
KEY_FILE = "ops-cache-key"


def fail(msg: str) -> NoReturn:
    sys.exit(f"opsbuild: error: {msg}")


# The CPU baselines matrix.yaml may name, each with the SIMD path of DeepSpeed's simd.h it
# allows: AVX-512 needs x86-64-v4; NEON is part of every AArch64 CPU (SVE is not: Neoverse N1 lacks it).
SIMD = {"x86-64-v3": "-D__AVX256__", "x86-64-v4": "-D__AVX512__", "armv8.2-a": "-D__NEON__"}


def simd_define(cpu_arch):
    return SIMD[cpu_arch]


BUILDERS = ("op_builder/builder.py", "deepspeed/ops/op_builder/builder.py")


def patch(src, cpu_arch):
    """Apply both patches and prove each took (or was not needed); return what was done."""
    done, seen = [], set()
    for rel in BUILDERS:
        builder = src / rel
        if not builder.exists():
            fail(f"{builder}: not in the sdist (DeepSpeed changed its layout)")
        if builder.resolve() in seen:
            continue  # a source checkout links the second copy to the first
        seen.add(builder.resolve())
        text = builder.read_text()
        new = text.replace("-march=native", f"-march={cpu_arch}")
        # simd_width's body reads the build host's CPU flags (py-cpuinfo, else lscpu) before it
        # returns a define; any answer but AVX2/AVX-512 gives __SCALAR__. Replaced whole, the ops
        # no longer depend on what the build host reports.
        body = f"    def simd_width(self):\n        return '{simd_define(cpu_arch)}'  # pytorch-cuda: the matrix's CPU baseline\n"
        new = re.sub(r"    def simd_width\(self\):\n.*?(?=\n+    def |\Z)", lambda m: body.rstrip("\n"), new, count=1, flags=re.S)
        if "-march=native" in new or f"-march={cpu_arch}" not in new or body not in new + "\n":
            fail(f"{builder}: the CPU-baseline patch did not apply (DeepSpeed changed its builder)")
        builder.write_text(new)
        done.append(f"{rel}: -march={cpu_arch}, {simd_define(cpu_arch)}")
    pp = src / "deepspeed" / "runtime" / "zero" / "partition_parameters.py"
    text = pp.read_text()
    if RACE_OLD in text:
        pp.write_text(text.replace(RACE_OLD, RACE_NEW))
        if RACE_OLD in pp.read_text() or RACE_FIXED not in pp.read_text():
            fail(f"{pp}: the all_gather wait patch did not apply")
        done.append("partition_parameters.py: wait on every all_gather handle (PR #8539)")
    elif RACE_FIXED not in text:
        fail(f"{pp}: neither the racy wait nor its fix found; check DeepSpeed PR #8539 against this version")
    return done


def arch_list():
    """TORCH_CUDA_ARCH_LIST: every arch the installed torch was built for that this nvcc can
    compile, PTX of the newest one on top so newer GPUs run the ops through the driver's JIT."""
    import torch

    torch_archs = sorted({int(a.split("_")[1]) for a in torch._C._cuda_getArchFlags().split() if a.startswith("sm_")})
    if not torch_archs:
        fail("this torch reports no CUDA architectures; is it a CUDA build?")
    out = subprocess.run([nvcc(), "--list-gpu-code"], capture_output=True, text=True, check=True).stdout
    nvcc_archs = {int(m) for m in re.findall(r"sm_(\d+)\b", out)}
    kept = [a for a in torch_archs if a in nvcc_archs]
    dropped = [a for a in torch_archs if a not in nvcc_archs]
    if not kept:
        fail(f"nvcc compiles none of torch's architectures {torch_archs}")
    fmt = lambda a: f"{a // 10}.{a % 10}"  # noqa: E731
    return ";".join(fmt(a) for a in kept) + "+PTX", [fmt(a) for a in dropped]


def nvcc():
    home = os.environ.get("CUDA_HOME")
    if not home or not os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        fail(f"CUDA_HOME ({home}) has no bin/nvcc")
    return os.path.join(home, "bin", "nvcc")


def no_driver_link(tmp):
    """async_io links -lcuda, the driver, which a builder without a GPU lacks and none of its code
    calls. Link against an empty stand-in with --as-needed, so the op records no libcuda.so.1 and
    loads on any host; check_wheel proves no op needs the driver, the image's load test the rest."""
    stubs = Path(tmp) / "stubs"
    stubs.mkdir()
    subprocess.run(["gcc", "-shared", "-x", "c", "-o", str(stubs / "libcuda.so"), "/dev/null"], check=True)
    return {"LIBRARY_PATH": os.pathsep.join(filter(None, [str(stubs), os.environ.get("LIBRARY_PATH")])),
            "LDFLAGS": " ".join(filter(None, ["-Wl,--as-needed", os.environ.get("LDFLAGS")]))}


def build_vars(src, ops):
    """DS_BUILD_<X> of each op, read from DeepSpeed's own builders (async_io is DS_BUILD_AIO)."""
    code = ("import json, sys; sys.path.insert(0, '.'); from op_builder.all_ops import ALL_OPS; "
            "print(json.dumps({n: b.BUILD_VAR for n, b in ALL_OPS.items()}))")
    env = dict(os.environ, DS_ACCELERATOR="cuda")
    found = json.loads(subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
    unknown = [op for op in ops if op not in found]
    if unknown:
        fail(f"DeepSpeed has no op {', '.join(unknown)}; it has {', '.join(sorted(found))}")
    return {found[op]: "1" for op in ops}


# Registers a baseline must not use, as objdump prints them: AVX-512's zmm; SVE's z0-z31 and p0-p15.
BEYOND = {"x86-64-v3": (r"\bzmm\d", "AVX-512"), "armv8.2-a": (r"\bz\d+\.[bhsdq]\b|\bp\d+/[mz]\b", "SVE")}


def check_wheel(wheel, ops, cpu_arch):
    """Every op is in the wheel, recorded as installed for `cuda`; CPUAdam stays in the CPU baseline."""
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
        z.extractall(d)
        info = Path(d) / "deepspeed" / "git_version_info_installed.py"
        ns: dict[str, Any] = {}
        exec(info.read_text(), ns)  # DeepSpeed writes plain assignments there
        missing = [op for op in ops if not ns.get("installed_ops", {}).get(op)]
        if missing or ns.get("accelerator_name") != "cuda":
            fail(f"wheel built for {ns.get('accelerator_name')!r} without {', '.join(missing) or '-'}; "
                 "DeepSpeed skipped them (see the warnings above)")
        runtime_builder = Path(d) / "deepspeed" / "ops" / "op_builder" / "builder.py"
        if "-march=native" in runtime_builder.read_text():
            fail(f"the wheel's {runtime_builder.relative_to(d)} still compiles for -march=native; "
                 "ops JIT-built from it would be tied to the build host's CPU")
        sos = {op: sorted(Path(d).rglob(f"{op}_op*.so")) for op in ops}
        empty = [op for op, found in sos.items() if not found]
        if empty:
            fail(f"no shared object for {', '.join(empty)} in {wheel.name}")
        for op, found in sos.items():
            needed = subprocess.run(["objdump", "-p", str(found[0])], capture_output=True, text=True, check=True).stdout
            if re.search(r"NEEDED\s+libcuda\.so", needed):
                fail(f"{op} needs the CUDA driver (libcuda.so) to load; it must load on hosts without one")
        beyond = BEYOND.get(cpu_arch)
        if beyond and "cpu_adam" in ops:
            dis = subprocess.run(["objdump", "-d", str(sos["cpu_adam"][0])], capture_output=True, text=True, check=True)
            if not dis.stdout.strip():
                fail("objdump printed nothing for cpu_adam; cannot check its instruction set")
            if re.search(beyond[0], dis.stdout):
                fail(f"CPUAdam contains {beyond[1]} instructions beyond {cpu_arch}")
        return {op: str(found[0].relative_to(d)) for op, found in sos.items()}, ns.get("torch_info", {})


def main(argv=None):
    p = argparse.ArgumentParser(prog="opsbuild.py", description=__doc__)
    p.add_argument("sdist", type=Path)
    p.add_argument("--ops", required=True, help="comma list of DeepSpeed op names")
    p.add_argument("--cpu-arch", required=True, choices=sorted(SIMD))
    p.add_argument("--dist", type=Path, required=True, help="where the wheel and ops-facts.json go")
    p.add_argument("--toolkit", required=True, help="the CUDA toolkit's version, recorded in the facts")
    p.add_argument("--cache", type=Path, help="keep built wheels here, keyed by every input of the compile")
    p.add_argument("--seed", type=Path, help="read-only wheels built before, keyed the same way (the host's "
                   "copy: a --no-cache build gets an empty cache mount)")
    p.add_argument("--epoch", type=int, help="rewrite the wheel's archive with every entry at this time "
                   "(the image's SOURCE_DATE_EPOCH), so two compiles give one wheel; see canonical_wheel")
    p.add_argument("--arch-list", help="TORCH_CUDA_ARCH_LIST to compile for, e.g. 9.0: a check of one machine "
                   "(gpucheck.py) pays one arch; default: every arch of torch's that this nvcc compiles")
    a = p.parse_args(argv)
    if a.arch_list and (a.cache or a.seed):
        # The cache and the seed hold the images' wheels, keyed without an arch list: a wheel
        # for fewer archs must never be taken for one of those, nor take their place.
        fail("--arch-list builds a wheel for one machine; it goes without --cache and --seed")
    if a.arch_list and not re.fullmatch(r"\d+\.\d+a?(\+PTX)?(;\d+\.\d+a?(\+PTX)?)*", a.arch_list):
        fail(f"--arch-list {a.arch_list!r}: expected e.g. 9.0 or 8.0;9.0+PTX")
    ops = [o for o in a.ops.split(",") if o]
    a.dist.mkdir(parents=True, exist_ok=True)
    key = cache_key(a.sdist, ops, a.cpu_arch)
    cached = a.cache / key if a.cache else None
    found = next((d for d in (cached, a.seed / key if a.seed else None) if d and (d / "ops-facts.json").exists()), None)
    if found:
        for f in found.iterdir():
            shutil.copy2(f, a.dist / f.name)
        where = "the ops cache" if found == cached else f"the host's ops seed ({a.seed})"
        print(f"opsbuild: inputs {key[:16]} built before; wheel taken from {where}, nothing compiled", flush=True)
    else:
        build(a, ops)
    # The key travels with the wheel, so the host can file an exported copy under it.
    (a.dist / KEY_FILE).write_text(key + "\n")
    wheels = sorted(a.dist.glob("deepspeed-*.whl"))
    if len(wheels) != 1:
        fail(f"expected one DeepSpeed wheel in {a.dist}, found {len(wheels)}")
    if a.epoch is not None:
        canonical_wheel(wheels[0], a.epoch)  # a cached wheel too: one made before this step was added
    check_wheel(wheels[0], ops, a.cpu_arch)  # a cached wheel is proved again, like a new one
    if cached and not cached.exists():
        tmp = cached.with_name(cached.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(a.dist, tmp)
        tmp.rename(cached)


def canonical_wheel(wheel, epoch):
    """Rewrite the wheel's zip archive so it depends on its files' contents alone.

    bdist_wheel stamps each entry with its file's mtime, the compile's wall clock for the ops,
    so two compiles with byte-identical files gave two archives. pip writes the archive's
    sha256 into the installed dist-info (direct_url.json, and RECORD with it), so the image's
    digest changed with every compile. Entry order, names and contents are kept (RECORD holds
    the files' hashes, not the archive's, and stays valid); times become `epoch`, modes 0644 or
    0755, and every entry is deflated at one level, so the bytes are the same on any machine
    with this Python. An already canonical wheel is left untouched.
    """
    stamp = time.gmtime(max(epoch, 315532800))[:6]  # zip cannot hold a time before 1980
    tmp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as out:
        for info in src.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=stamp)
            entry.create_system = 3  # unix: the mode below is read by pip
            mode = 0o755 if info.external_attr >> 16 & 0o111 else 0o644
            entry.external_attr = (0o040000 | mode if info.is_dir() else 0o100000 | mode) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(entry, src.read(info), compresslevel=6)
    if tmp.read_bytes() == wheel.read_bytes():
        tmp.unlink()
    else:
        tmp.replace(wheel)


def cache_key(sdist, ops, cpu_arch):
    """Everything the compiled ops depend on: sources, this recipe, torch, the compiler, the ops."""
    import torch

    h = hashlib.sha256()
    for part in (sha256_file(sdist), sha256_file(Path(__file__)), torch.__version__, str(torch.version.cuda),
                 torch._C._cuda_getArchFlags(), subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout,
                 ",".join(ops), cpu_arch):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# Objects record the directory they were compiled in (debug info; nvcc's _INTERNAL_<hash> names
# hash the source's path), so a random temporary directory gives other op bytes on every build
# and another image digest. One fixed directory, held under a lock, keeps a rebuild identical.
BUILD_DIR = Path("/tmp/pytorch-cuda-opsbuild")


@contextlib.contextmanager
def build_dir(path=BUILD_DIR):
    """path, empty, for this build alone; removed afterwards. A second build waits for the first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(path, ignore_errors=True)  # left by a build that was killed
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def nvcc_flags():
    """nvcc names its intermediate files tmpxft_<pid>_..., and those names land in the objects;
    --objdir-as-tempdir (CUDA 12.3 on) names them after the object instead."""
    flags = [f"--threads {os.cpu_count() or 1}"]  # each .cu once per arch, in parallel only when asked
    if "--objdir-as-tempdir" in subprocess.run([nvcc(), "--help"], capture_output=True, text=True).stdout:
        flags.append("--objdir-as-tempdir")
    else:
        print("opsbuild: warning: this nvcc has no --objdir-as-tempdir; two compiles give other op bytes", flush=True)
    return " ".join(filter(None, [os.environ.get("NVCC_APPEND_FLAGS"), *flags]))


def arch_scope(given, dropped):
    """What the arch list covers, for the log: --arch-list narrows it on purpose (the GPU bundle
    compiles for the one GPU it runs on), which is not torch's list."""
    if given:
        return "the archs --arch-list names, not every torch arch"
    return "not compiled by this nvcc: " + ", ".join(dropped) if dropped else "every torch arch"


def build(a, ops):
    with build_dir() as tmp:
        with tarfile.open(a.sdist) as t:
            t.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(tmp)
        src = next(Path(tmp).iterdir())
        patches = patch(src, a.cpu_arch)
        given = getattr(a, "arch_list", None)
        archs, dropped = (given, []) if given else arch_list()
        env = dict(os.environ, DS_ACCELERATOR="cuda", DS_BUILD_OPS="0", DS_ENABLE_NINJA="1", TORCH_CUDA_ARCH_LIST=archs,
                   MAX_JOBS=str(os.cpu_count() or 1), PYTHONHASHSEED="0", **build_vars(src, ops), **no_driver_link(tmp))
        env["NVCC_APPEND_FLAGS"] = nvcc_flags()
        print(f"opsbuild: {', '.join(ops)} for TORCH_CUDA_ARCH_LIST={archs} with {nvcc()} ({a.toolkit}); "
              f"{arch_scope(bool(given), dropped)}", flush=True)
        t0 = time.monotonic()
        # DeepSpeed's setup.py lists extras from sets: PYTHONHASHSEED=0 keeps METADATA stable.
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--wheel-dir", str(a.dist), "."], cwd=src, env=env, check=True)
        seconds = round(time.monotonic() - t0, 1)
    wheels = sorted(a.dist.glob("deepspeed-*.whl"))
    if len(wheels) != 1:
        fail(f"expected one DeepSpeed wheel in {a.dist}, found {len(wheels)}")
    files, torch_info = check_wheel(wheels[0], ops, a.cpu_arch)
    facts = {"ops_accelerator": "cuda", "prebuilt_ops": ops, "op_files": files, "cuda_toolkit": a.toolkit,
             "ops_arch_list": archs, "ops_arch_not_compiled": dropped, "patches": patches,
             "ops_torch_info": torch_info}
    (a.dist / "ops-facts.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    print(f"opsbuild: {wheels[0].name}: {', '.join(ops)} prebuilt for cuda in {seconds} s", flush=True)


if __name__ == "__main__":
    main()
