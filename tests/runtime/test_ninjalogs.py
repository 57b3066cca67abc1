"""ninjalogs: the image's baked torch extensions carry ninja logs that are the same on every
build and still tell ninja that nothing needs compiling. The real-ninja tests build a small
C project with the host's ninja and gcc (Debian's ninja-build), so they check ninja's own
reading of the rewritten logs, not only our reading of the formats."""
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import require

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pytorch_cuda_runtime import ninjalogs  # noqa: E402

FUTURE = ninjalogs.FUTURE_NS

BUILD_NINJA = """\
rule cc
  command = gcc -MD -MF $out.d -c $in -o $out
  depfile = $out.d
  deps = gcc
rule link
  command = gcc -shared $in -o $out
build a.o: cc a.c
build b.o: cc b.c
build lib.so: link a.o b.o
default lib.so
"""


def deps_log(records) -> bytes:
    """A v4 deps log from ("path", name) and ("deps", out_id, mtime, [ids]) records, as ninja writes it."""
    out, next_id = bytearray(ninjalogs.DEPS_HEADER + struct.pack("<i", 4)), 0
    for rec in records:
        if rec[0] == "path":
            raw = rec[1].encode() + b"\0" * (-len(rec[1]) % 4)
            out += struct.pack("<I", len(raw) + 4) + raw + struct.pack("<I", ~next_id & 0xFFFFFFFF)
            next_id += 1
        else:
            _, out_id, mtime, ids = rec
            out += struct.pack("<I", (4 * (3 + len(ids))) | 0x80000000)
            out += struct.pack(f"<iII{len(ids)}i", out_id, mtime & 0xFFFFFFFF, mtime >> 32, *ids)
    return bytes(out)


def test_build_log_times_are_zeroed_and_entries_sorted_by_output_last_entry_wins():
    log = ("# ninja log v7\n"
           "1200\t5300\t1763900000123456789\tb.o\t9f86d081884c7d65\n"
           "1100\t4800\t1763900000111111111\ta.o\t1111111111111111\n"
           "5400\t5900\t1763900000999999999\ta.o\t2222222222222222\n")
    assert ninjalogs.normalize_build_log(log) == (
        "# ninja log v7\n"
        f"0\t0\t{FUTURE}\ta.o\t2222222222222222\n"
        f"0\t0\t{FUTURE}\tb.o\t9f86d081884c7d65\n")


@pytest.mark.parametrize("text", ["", "# ninja log v4\n", "# ninja log v8\n", "not a log\n",
                                  "# ninja log v7\n1\t2\t3\tb.o\n"])
def test_build_log_of_an_unknown_form_is_an_error_not_a_guess(text):
    with pytest.raises(ninjalogs.NinjaLogError):
        ninjalogs.normalize_build_log(text)


def test_deps_logs_from_either_completion_order_become_the_same_bytes():
    # Two parallel compiles finishing in either order: ids differ, times differ, content does not.
    a_first = deps_log([("path", "a.o"), ("path", "a.c"), ("path", "common.h"), ("deps", 0, 111, [1, 2]),
                        ("path", "b.o"), ("path", "b.c"), ("deps", 3, 222, [4, 2])])
    b_first = deps_log([("path", "b.o"), ("path", "b.c"), ("path", "common.h"), ("deps", 0, 333, [1, 2]),
                        ("path", "a.o"), ("path", "a.c"), ("deps", 3, 444, [4, 2])])
    assert a_first != b_first
    assert ninjalogs.normalize_deps_log(a_first) == ninjalogs.normalize_deps_log(b_first)
    records = list(ninjalogs._read_deps(ninjalogs.normalize_deps_log(a_first)))
    assert [r for r in records if r[0] == "deps"] == [("deps", 0, FUTURE, [1, 2]), ("deps", 3, FUTURE, [4, 2])]
    assert [r[2] for r in records if r[0] == "path"] == ["a.o", "a.c", "common.h", "b.o", "b.c"]


def test_deps_inputs_are_what_each_output_read_not_the_outputs():
    data = deps_log([("path", "a.o"), ("path", "a.c"), ("path", "common.h"), ("deps", 0, 111, [1, 2]),
                     ("path", "b.o"), ("path", "b.c"), ("deps", 3, 222, [4, 2])])
    assert ninjalogs.deps_inputs(data) == {"a.c", "b.c", "common.h"}
    assert ninjalogs.deps_inputs(ninjalogs.normalize_deps_log(data)) == {"a.c", "b.c", "common.h"}
    with pytest.raises(ninjalogs.NinjaLogError):
        ninjalogs.deps_inputs(b"not a deps log")


def test_deps_log_keeps_the_last_record_of_an_output_as_ninja_does():
    data = deps_log([("path", "a.o"), ("path", "old.h"), ("deps", 0, 1, [1]),
                     ("path", "new.h"), ("deps", 0, 2, [2])])
    deps = [r for r in ninjalogs._read_deps(ninjalogs.normalize_deps_log(data)) if r[0] == "deps"]
    paths = [r[2] for r in ninjalogs._read_deps(ninjalogs.normalize_deps_log(data)) if r[0] == "path"]
    assert deps == [("deps", 0, FUTURE, [1])] and paths == ["a.o", "new.h"]


@pytest.mark.parametrize("damage", ["version", "checksum", "truncated", "header"])
def test_deps_log_of_an_unknown_or_damaged_form_is_an_error(damage):
    data = bytearray(deps_log([("path", "a.o"), ("path", "a.c"), ("deps", 0, 1, [1])]))
    if damage == "version":
        data[12:16] = struct.pack("<i", 3)
    elif damage == "checksum":
        data[16 + 4 + 4] ^= 0xFF
    elif damage == "truncated":
        del data[-3:]
    else:
        data[:2] = b"//"
    with pytest.raises(ninjalogs.NinjaLogError):
        ninjalogs.normalize_deps_log(bytes(data))


def test_main_says_what_is_wrong_and_exits_nonzero(tmp_path, capsys):
    assert ninjalogs.main([]) == 2
    assert ninjalogs.main([str(tmp_path / "missing")]) == 2
    assert ninjalogs.main([str(tmp_path)]) == 1
    assert "no ninja log under" in capsys.readouterr().err
    (tmp_path / "op").mkdir()
    (tmp_path / "op" / ".ninja_log").write_text("# ninja log v9\n")
    assert ninjalogs.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ninjalogs: error: ninja build log v9")
    assert (tmp_path / "op" / ".ninja_log").read_text() == "# ninja log v9\n"


# ---- with the real ninja ----------------------------------------------------------------------

@pytest.fixture
def ninja_and_gcc():
    require(shutil.which("ninja") and shutil.which("gcc"), "needs ninja and gcc (Debian: ninja-build, gcc)")


needs_ninja = pytest.mark.usefixtures("ninja_and_gcc")


def ninja(d: Path, *args) -> str:
    return subprocess.run(["ninja", "-C", str(d), *args], check=True, capture_output=True, text=True).stdout


def project(d: Path) -> Path:
    d.mkdir()
    (d / "common.h").write_text("#define K 2\n")
    (d / "a.c").write_text('#include "common.h"\nint a(void) { return K; }\n')
    (d / "b.c").write_text('#include "common.h"\nint b(void) { return K + 1; }\n')
    (d / "build.ninja").write_text(BUILD_NINJA)
    return d


def clamp_times(d: Path):
    """What BuildKit's rewrite-timestamp does to a layer: every file time set to SOURCE_DATE_EPOCH,
    which is newer than the system headers of the layers below (a minute ago, here)."""
    seconds = int(time.time()) - 60
    for p in d.rglob("*"):
        os.utime(p, (seconds, seconds))


@needs_ninja
def test_two_builds_give_identical_logs_and_ninja_finds_nothing_to_do(tmp_path):
    logs = []
    for n in (1, 2):
        d = project(tmp_path / "p")
        ninja(d, "-j2")
        assert ninjalogs.main([str(d)]) == 0
        assert "no work to do" in ninja(d, "-n")
        logs.append(((d / ".ninja_log").read_bytes(), (d / ".ninja_deps").read_bytes()))
        shutil.rmtree(d)
        time.sleep(0.02)
    assert logs[0] == logs[1]
    assert f"\t{FUTURE}\t".encode() in logs[0][0]


@needs_ninja
def test_with_every_file_time_clamped_ninja_still_finds_nothing_to_do(tmp_path):
    d = project(tmp_path / "p")
    ninja(d, "-j2")
    ninjalogs.main([str(d)])
    clamp_times(d)
    assert "no work to do" in ninja(d, "-n")


@needs_ninja
def test_without_the_rewrite_clamped_times_and_an_old_log_make_ninja_rebuild(tmp_path):
    """The reason the module exists: a log that records a time older than the inputs on disk
    (what an earlier SOURCE_DATE_EPOCH or a dropped entry gives) makes ninja compile again."""
    d = project(tmp_path / "p")
    ninja(d, "-j2")
    log = (d / ".ninja_log").read_text().splitlines()
    (d / ".ninja_log").write_text("\n".join([log[0]] + [f"0\t0\t1\t{line.split(chr(9))[3]}\t{line.split(chr(9))[4]}"
                                                        for line in log[1:]]) + "\n")
    assert "no work to do" not in ninja(d, "-n")


@needs_ninja
def test_an_edited_source_or_changed_command_is_still_rebuilt_after_the_rewrite(tmp_path):
    """The far-future time in the logs must not hide real changes: ninja still compares the
    files on disk, and the command hashes are kept."""
    d = project(tmp_path / "p")
    ninja(d, "-j2")
    ninjalogs.main([str(d)])
    clamp_times(d)
    (d / "common.h").write_text("#define K 3\n")
    out = ninja(d, "-n")
    assert "a.o" in out and "b.o" in out
    clamp_times(d)
    (d / "build.ninja").write_text(BUILD_NINJA.replace("gcc -MD", "gcc -O2 -MD"))
    os.utime(d / "build.ninja", (time.time() - 60,) * 2)
    out = ninja(d, "-n")
    assert "no work to do" not in out and "a.o" in out
