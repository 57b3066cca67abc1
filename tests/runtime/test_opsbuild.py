"""opsbuild.py's patches to DeepSpeed's sources: each applies, or the build stops (pure, no torch)."""
from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from pytorch_cuda_runtime import opsbuild

BUILDER = """\
    def simd_width(self):
        cpu_info = get_cpu_info()
        if 'avx512' in cpu_info['flags']:
            return '-D__AVX512__'
        elif 'avx2' in cpu_info['flags']:
            return '-D__AVX256__'
        return '-D__SCALAR__'

    def cpu_arch(self):
        return '-march=native'
"""
RACY = "    def _allgather_params_coalesced(self):\n        launch_handles[-1].wait()\n        return\n"
FIXED = "    def _allgather_params_coalesced(self):\n        for handle in launch_handles:\n            handle.wait()\n"


def tree(tmp_path: Path, builder: str = BUILDER, pp: str = RACY, runtime_copy: bool = True) -> Path:
    """An sdist's layout: the builder setup.py uses, and the copy the installed DeepSpeed uses."""
    (tmp_path / "op_builder").mkdir(parents=True)
    (tmp_path / "op_builder" / "builder.py").write_text(builder)
    if runtime_copy:
        (tmp_path / "deepspeed" / "ops" / "op_builder").mkdir(parents=True)
        (tmp_path / "deepspeed" / "ops" / "op_builder" / "builder.py").write_text(builder)
    zero = tmp_path / "deepspeed" / "runtime" / "zero"
    zero.mkdir(parents=True)
    (zero / "partition_parameters.py").write_text(pp)
    return tmp_path


def test_both_patches_apply_to_an_old_deepspeed(tmp_path):
    src = tree(tmp_path)
    done = opsbuild.patch(src, "x86-64-v3")
    # Both copies: the wheel's ops are compiled with the first, the image's JIT builds (the CPU
    # accelerator's ops) with the second, which once stayed at -march=native.
    for rel in ("op_builder/builder.py", "deepspeed/ops/op_builder/builder.py"):
        builder = (src / rel).read_text()
        assert "-march=native" not in builder and "-march=x86-64-v3" in builder, rel
        assert "-D__AVX512__" not in builder, rel
        # the host's CPU flags are no longer read: one define, whatever py-cpuinfo reports
        assert "def simd_width(self):\n        return '-D__AVX256__'" in builder and "avx512" not in builder, rel
        assert "def cpu_arch(self):" in builder, "the methods after simd_width stay"
    pp = (src / "deepspeed" / "runtime" / "zero" / "partition_parameters.py").read_text()
    assert "launch_handles[-1].wait()" not in pp and "for handle in launch_handles:" in pp
    assert len(done) == 3


def test_a_deepspeed_with_the_fix_needs_only_the_cpu_patch(tmp_path):
    assert len(opsbuild.patch(tree(tmp_path, pp=FIXED), "x86-64-v4")) == 2
    assert "-D__AVX512__" in (tmp_path / "op_builder" / "builder.py").read_text()


def test_a_linked_runtime_copy_is_patched_through_its_target(tmp_path):
    """A source checkout links deepspeed/ops/op_builder to op_builder: one file, patched once."""
    src = tree(tmp_path, runtime_copy=False)
    (src / "deepspeed" / "ops").mkdir(parents=True)
    (src / "deepspeed" / "ops" / "op_builder").symlink_to("../../op_builder")
    assert len(opsbuild.patch(src, "x86-64-v3")) == 2
    assert "-march=x86-64-v3" in (src / "deepspeed" / "ops" / "op_builder" / "builder.py").read_text()


def test_unknown_sources_stop_the_build(tmp_path):
    with pytest.raises(SystemExit, match="neither the racy wait nor its fix"):
        opsbuild.patch(tree(tmp_path / "a", pp="def other(): pass\n"), "x86-64-v3")
    with pytest.raises(SystemExit, match="CPU-baseline patch did not apply"):
        opsbuild.patch(tree(tmp_path / "b", builder="def nothing(): pass\n"), "x86-64-v3")
    with pytest.raises(SystemExit, match="CPU-baseline patch did not apply"):
        src = tree(tmp_path / "c")
        (src / "deepspeed" / "ops" / "op_builder" / "builder.py").write_text("def nothing(): pass\n")
        opsbuild.patch(src, "x86-64-v3")


# ---- where the wheel comes from: the cache mount, the host's ops seed, or a compile ----------

@pytest.fixture
def no_compile(monkeypatch):
    """main() with the compile and the wheel's proof stubbed out: which source it took."""
    built = []
    monkeypatch.setattr(opsbuild, "cache_key", lambda sdist, ops, cpu_arch: "k" * 64)
    monkeypatch.setattr(opsbuild, "check_wheel", lambda wheel, ops, cpu_arch: ({}, {}))

    def build(a, ops):
        built.append(ops)
        (a.dist / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").write_bytes(b"compiled")
        (a.dist / "ops-facts.json").write_text("{}\n")
    monkeypatch.setattr(opsbuild, "build", build)
    return built


def entry(d: Path, key: str, wheel: bytes) -> Path:
    (d / key).mkdir(parents=True)
    (d / key / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").write_bytes(wheel)
    (d / key / "ops-facts.json").write_text("{}\n")
    return d / key


def main(tmp_path: Path, *extra: str) -> Path:
    dist = tmp_path / "dist"
    opsbuild.main(["sdist.tar.gz", "--ops", "cpu_adam", "--cpu-arch", "x86-64-v3", "--toolkit", "12.4.131",
                   "--dist", str(dist), "--cache", str(tmp_path / "cache"), *extra])
    return dist


def test_a_seed_with_the_same_key_is_taken_and_fills_the_empty_cache_mount(tmp_path, no_compile, capsys):
    entry(tmp_path / "seed", "k" * 64, b"from the host")
    dist = main(tmp_path, "--seed", str(tmp_path / "seed"))
    assert no_compile == []
    assert (dist / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").read_bytes() == b"from the host"
    assert (dist / opsbuild.KEY_FILE).read_text() == "k" * 64 + "\n"
    assert "host's ops seed" in capsys.readouterr().out
    assert (tmp_path / "cache" / ("k" * 64) / "ops-facts.json").exists()


def test_a_seed_under_another_key_is_ignored_and_the_ops_compile(tmp_path, no_compile):
    entry(tmp_path / "seed", "0" * 64, b"stale inputs")
    dist = main(tmp_path, "--seed", str(tmp_path / "seed"))
    assert no_compile == [["cpu_adam"]]
    assert (dist / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").read_bytes() == b"compiled"
    assert (dist / opsbuild.KEY_FILE).read_text() == "k" * 64 + "\n"


def test_the_cache_mount_comes_before_the_seed(tmp_path, no_compile, capsys):
    entry(tmp_path / "cache", "k" * 64, b"cache mount")
    entry(tmp_path / "seed", "k" * 64, b"seed")
    dist = main(tmp_path, "--seed", str(tmp_path / "seed"))
    assert (dist / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").read_bytes() == b"cache mount"
    assert "taken from the ops cache, nothing compiled" in capsys.readouterr().out and no_compile == []


# ---- what makes two compiles of the same inputs give the same bytes --------------------------

def test_the_build_directory_is_one_path_emptied_first_removed_after_and_held_by_one_build(tmp_path):
    """Objects record the directory they were compiled in, so every build uses the same one;
    a second build on the host waits for the first rather than sharing it."""
    import subprocess
    import sys

    d = tmp_path / "build"
    d.mkdir()
    (d / "left-by-a-killed-build").write_text("x")
    with opsbuild.build_dir(d) as got:
        assert got == d and list(d.iterdir()) == []
        (d / "a.o").write_text("x")
        waiter = subprocess.run(
            [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); "
             "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", f"{d}.lock"], capture_output=True, text=True)
        assert waiter.returncode != 0 and "BlockingIOError" in waiter.stderr, "the lock is not held"
    assert not d.exists()


@pytest.mark.parametrize("has_flag", [True, False])
def test_nvcc_names_its_temporary_files_after_the_object_where_it_can(tmp_path, monkeypatch, capsys, has_flag):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho '--threads <number>'\n" + ("echo '--objdir-as-tempdir  (-objtemp)'\n" if has_flag else ""))
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    flags = opsbuild.nvcc_flags().split()
    assert flags[0] == "-lineinfo" and "--threads" in flags
    assert ("--objdir-as-tempdir" in flags) is has_flag
    assert ("no --objdir-as-tempdir" in capsys.readouterr().out) is not has_flag


def test_the_arm64_baseline_takes_deepspeeds_neon_path_and_sve_is_caught(tmp_path):
    """armv8.2-a: -march=armv8.2-a and __NEON__ in both builders; objdump lines with SVE's z/p
    registers are what check_wheel refuses, NEON's v registers are not."""
    src = tree(tmp_path)
    opsbuild.patch(src, "armv8.2-a")
    for rel in opsbuild.BUILDERS:
        text = (src / rel).read_text()
        assert "-march=armv8.2-a" in text and "-march=native" not in text
        assert "def simd_width(self):\n        return '-D__NEON__'" in text
    pattern, what = opsbuild.BEYOND["armv8.2-a"]
    assert what == "SVE"
    assert re.search(pattern, "  4005d4:\t04a00000 \tadd\tz0.s, z0.s, z0.s")
    assert re.search(pattern, "  4005d8:\t2598e3e0 \tptrue\tp0.s\n  4005dc:\ta540a000 \tld1w\t{z0.s}, p0/z, [x0]")
    assert not re.search(pattern, "  4005d4:\t4e20d400 \tfadd\tv0.4s, v0.4s, v0.4s\n  4005d8:\tfd400000 \tldr\td0, [x0]")


# ---- the wheel's archive: one set of files gives one archive ---------------------------------

def wheel_of(path: Path, times: tuple, mode: int, order: list[str]) -> Path:
    """A wheel as bdist_wheel writes one: each entry stamped with its file's mtime."""
    files = {"deepspeed/ops/adam/fused_adam_op.so": b"\x7fELF op", "deepspeed/__init__.py": b"x = 1\n",
             "deepspeed-0.17.6.dist-info/RECORD": b"deepspeed/__init__.py,sha256=abc,6\n"}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name in order:
            info = zipfile.ZipInfo(name, date_time=times)
            info.external_attr = (0o100000 | (mode if name.endswith(".so") else 0o644)) << 16
            z.writestr(info, files[name], compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return path


ORDER = ["deepspeed/__init__.py", "deepspeed/ops/adam/fused_adam_op.so", "deepspeed-0.17.6.dist-info/RECORD"]


def test_two_compiles_with_the_same_files_give_one_wheel(tmp_path):
    """The Docker 26 `verify --compile-ops` of 2026-11-28 differed only in pip's record of the
    wheel archive's hash: bdist_wheel had stamped each entry with its compile's time."""
    a = wheel_of(tmp_path / "a.whl", (2026, 11, 28, 0, 31, 2), 0o755, ORDER)
    b = wheel_of(tmp_path / "b.whl", (2026, 11, 28, 0, 52, 40), 0o775, ORDER)
    assert a.read_bytes() != b.read_bytes()
    for w in (a, b):
        opsbuild.canonical_wheel(w, 1767225600)
    assert a.read_bytes() == b.read_bytes()
    with zipfile.ZipFile(a) as z:
        assert [i.filename for i in z.infolist()] == ORDER, "pip wants RECORD where bdist_wheel put it"
        assert {i.date_time for i in z.infolist()} == {(2026, 1, 1, 0, 0, 0)}
        assert z.getinfo("deepspeed/ops/adam/fused_adam_op.so").external_attr >> 16 == 0o100755
        assert z.getinfo("deepspeed/__init__.py").external_attr >> 16 == 0o100644
        assert z.read("deepspeed/ops/adam/fused_adam_op.so") == b"\x7fELF op"
        assert z.testzip() is None


def test_a_canonical_wheel_is_left_alone_and_other_contents_stay_other(tmp_path):
    a = wheel_of(tmp_path / "a.whl", (2026, 11, 28, 0, 31, 2), 0o755, ORDER)
    opsbuild.canonical_wheel(a, 1767225600)
    before = a.stat().st_mtime_ns, a.read_bytes()
    opsbuild.canonical_wheel(a, 1767225600)
    assert (a.stat().st_mtime_ns, a.read_bytes()) == before
    assert not list(tmp_path.glob("*.part"))
    # A real difference in the files must still give another archive.
    c = wheel_of(tmp_path / "c.whl", (2026, 11, 28, 0, 31, 2), 0o755, ORDER[::-1])
    opsbuild.canonical_wheel(c, 1767225600)
    assert c.read_bytes() != a.read_bytes()


def test_with_epoch_a_wheel_from_the_seed_is_made_canonical_too(tmp_path, no_compile):
    """The host's seed and the ops cache hold wheels made before the rewrite: taking one must
    give the archive a fresh compile gives, or two machines' images differ."""
    seeded = wheel_of(tmp_path / "w.whl", (2026, 11, 20, 9, 0, 0), 0o755, ORDER).read_bytes()
    entry(tmp_path / "seed", "k" * 64, seeded)
    dist = main(tmp_path, "--seed", str(tmp_path / "seed"), "--epoch", "1767225600")
    fresh = wheel_of(tmp_path / "fresh.whl", (2026, 11, 28, 1, 0, 0), 0o755, ORDER)
    opsbuild.canonical_wheel(fresh, 1767225600)
    assert (dist / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").read_bytes() == fresh.read_bytes()
    assert (tmp_path / "cache" / ("k" * 64) / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").read_bytes() == fresh.read_bytes()


@pytest.mark.parametrize("given, dropped, says", [
    (True, [], "the archs --arch-list names, not every torch arch"),
    (False, [], "every torch arch"),
    (False, ["sm_50", "sm_60"], "not compiled by this nvcc: sm_50, sm_60"),
])
def test_the_log_says_what_the_arch_list_covers(given, dropped, says):
    assert opsbuild.arch_scope(given, dropped) == says
