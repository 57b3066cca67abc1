"""Issue 11, without a daemon: bench empties the build cache only with --yes, a failing
command is one typed line, and verify reads both `docker save` layouts or says why not, and
holds one build on disk at a time."""
from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest
from helpers import ROOT

from pytorch_cuda_build import bench, cli, docker_env, matrix, tag, verify
from pytorch_cuda_build.errors import ArchiveLayoutError, CommandFailed, UsageError


@pytest.fixture
def no_docker(monkeypatch):
    """Every way bench reaches Docker, recorded: a refusal must run none of them."""
    calls = []

    def record(*a, **kw):
        calls.append(a[0] if a else kw)
        raise AssertionError(f"ran {a[0] if a else kw}")
    monkeypatch.setattr(docker_env, "ensure_engine", record)
    monkeypatch.setattr(docker_env, "build_client", record)
    monkeypatch.setattr(bench.subprocess, "run", record)
    return calls


@pytest.mark.parametrize("only", [None, "cold", "matrix", "size,cold"])
def test_bench_full_refuses_to_empty_the_build_cache_without_yes(no_docker, capsys, only):
    argv = ["bench", "--torch", "2.7", "--cuda", "12.1", "--full"] + (["--only", only] if only else [])
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "need an empty build cache" in err and "removes every entry of this daemon's build cache" in err
    assert "--yes" in err and "--only size,opscache,rebuild,rows,banner" in err
    assert no_docker == []  # nothing ran, nothing pruned


def test_bench_full_without_cache_measures_needs_no_yes(no_docker):
    bench.check_consent({"size", "rebuild", "rows", "banner"}, yes=False)
    bench.check_consent(set(bench.MEASURES), yes=True)


def test_bench_full_itself_checks_before_any_command(no_docker, tmp_path):
    with pytest.raises(UsageError, match="--yes"):
        bench.full(None, None, None, tmp_path, None, None, 1, 1, {"cold"}, tmp_path, print)
    assert no_docker == []


def test_a_failing_command_is_a_typed_error_with_its_exit_code():
    with pytest.raises(bench.BenchError) as e:
        bench._run(["sh", "-c", "echo first >&2; echo 'no such image' >&2; exit 125"])
    assert isinstance(e.value, CommandFailed) and e.value.returncode == 125
    assert str(e.value) == "`sh -c 'echo first >&2; echo '\"'\"'no such image'\"'\"' >&2; exit 125'` exited 125: no such image"


def test_a_missing_or_hanging_command_is_a_typed_error_too():
    with pytest.raises(bench.BenchError, match="could not run"):
        bench._run(["/nonexistent/docker", "run"])
    with pytest.raises(bench.BenchError, match="timed out after 0 s"):
        bench._run(["sleep", "5"], timeout=0.2)


def test_cli_bench_prints_a_failed_docker_run_as_one_line(monkeypatch, capsys, tmp_path):
    """The CalledProcessError that once escaped as a traceback from the banner measure."""
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: object())
    monkeypatch.setattr(tag, "current", lambda c, image: {image.refs()[0]: "sha256:x"})
    monkeypatch.setattr(cli, "ROOT", tmp_path)  # no report written into the tree
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 125, "", "docker: Error response from daemon: could not select device driver\n"))
    rc = cli.main(["--matrix", str(ROOT / "matrix.yaml"), "bench", "--torch", "2.7", "--cuda", "12.1", "--runs", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("error: `docker run --rm pytorch-cuda:2.7.1-cuda12.1-runtime true` exited 125: docker: Error response"), err


# ---- verify: docker save layouts ------------------------------------------------------

def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


LAYER = _tar({"etc/hello": b"hi\n"})


@pytest.mark.parametrize("archive", [
    {"manifest.json": json.dumps([{"Layers": ["abc/layer.tar"]}]).encode(), "abc/layer.tar": LAYER},  # Docker < 25
    {"blobs/sha256/cfg": b'{"architecture": "amd64"}', "blobs/sha256/l1": LAYER, "index.json": b"{}",  # OCI, manifest last
     "manifest.json": json.dumps([{"Config": "blobs/sha256/cfg", "Layers": ["blobs/sha256/l1"]}]).encode()},
])
def test_both_save_layouts_are_read(archive):
    order, by_name = verify.read_save(io.BytesIO(_tar(archive)), "img")
    assert by_name[order[0]]["etc/hello"][0][4] == 3  # size of the one file


@pytest.mark.parametrize(("archive", "needle"), [
    ({"abc/layer.tar": LAYER}, "no manifest.json"),
    ({"manifest.json": b'[{"Config": "x"}]'}, "not one image with a Layers list"),
    ({"manifest.json": b'{"Layers": []}'}, "not one image with a Layers list"),
    ({"manifest.json": b"not json"}, "not a readable archive"),
])
def test_an_unexpected_save_layout_is_a_typed_error(archive, needle):
    with pytest.raises(ArchiveLayoutError, match=needle) as e:
        verify.read_save(io.BytesIO(_tar(archive)), "pytorch-cuda-verify:x-1")
    assert e.value.exit_code == 2 and str(e.value).startswith("cannot read `docker save pytorch-cuda-verify:x-1`: ")


def _fake_save(monkeypatch, payload: bytes, rc: int = 0, stderr: bytes = b""):
    class Proc:
        def __init__(self, *a, **kw):
            self.stdout, self.stderr, self.returncode = io.BytesIO(payload), io.BytesIO(stderr), None

        def wait(self):
            self.returncode = rc
    monkeypatch.setattr(verify.subprocess, "Popen", Proc)


def test_a_layer_listed_but_absent_is_a_typed_error_not_a_key_error(monkeypatch):
    _fake_save(monkeypatch, _tar({"manifest.json": json.dumps([{"Layers": ["blobs/sha256/gone"]}]).encode(),
                                  "blobs/sha256/cfg": b"{}"}))
    with pytest.raises(ArchiveLayoutError, match="lists layer blobs/sha256/gone"):
        verify.layer_index("img", docker_cli="docker")


def test_a_failed_save_names_the_command_and_exit_code(monkeypatch):
    _fake_save(monkeypatch, b"", rc=1, stderr=b"Error response from daemon: reference does not exist\n")
    with pytest.raises(CommandFailed) as e:
        verify.layer_index("img:1", docker_cli="docker")
    assert str(e.value) == "`docker save img:1` exited 1: Error response from daemon: reference does not exist"


class _Images:
    """The engine's image store as verify.run sees it: which verify refs exist, and the order of events."""

    def __init__(self, events: list[str]):
        self.events, self.present = events, set()

    def get(self, image_id):
        assert self.present, f"{image_id} read after its build was removed"
        return type("I", (), {"attrs": {"RootFS": {"Layers": ["sha256:l1", "sha256:l2"]}}})()

    def remove(self, ref, force=False):
        self.events.append(f"remove {ref[-1]}")
        self.present.discard(ref)


def _verify_run(monkeypatch, tmp_path, fail_on: int | None = None, room_for_two: bool = False, compile_ops: bool = False):
    events: list[str] = []
    monkeypatch.setattr(verify, "_room_for_two", lambda root, size: room_for_two)
    engine = type("E", (), {"images": _Images(events)})()
    client = type("B", (), {"argv": ["docker"], "export": "oci", "description": "Docker 26"})()
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: engine)
    monkeypatch.setattr(docker_env, "build_client", lambda docker: client)
    monkeypatch.setattr(docker_env, "root_dir", lambda c: str(tmp_path))
    monkeypatch.setattr(verify.build, "check_disk", lambda root: None)
    monkeypatch.setattr(verify.base, "ensure", lambda *a, **kw: "sha256:base")

    def build_run(bc, root, image, log_path, ca, *, no_cache, echo, tag, base_id, ops_seed):
        assert no_cache and base_id == "sha256:base"
        assert ops_seed is not compile_ops, "--compile-ops must keep the host's ops seed out of both builds"
        events.append(f"build {tag[-1]}")
        if fail_on == int(tag[-1]):
            raise CommandFailed("docker buildx build", 1, "boom")
        engine.images.present.add(tag)
        return "sha256:same"

    def layer_index(ref, *, docker_cli):
        events.append(f"index {ref[-1]}")
        return [{"etc/a": (("0", 0o644, 0, 0, 1, "h", ""), 0)}]

    monkeypatch.setattr(verify.build, "run", build_run)
    monkeypatch.setattr(verify, "layer_index", layer_index)
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    return events, lambda: verify.run(tmp_path, row, tmp_path / "verify", None, None, lambda m: None,
                                      compile_ops=compile_ops)


@pytest.mark.parametrize("room_for_two,order", [
    (False, ["build 1", "index 1", "remove 1", "build 2", "index 2", "remove 2"]),
    (True, ["build 1", "index 1", "build 2", "index 2", "remove 1", "remove 2"]),  # both kept to copy files out
])
def test_verify_holds_one_build_at_a_time_unless_the_disk_has_room_and_compares_the_digests(
        monkeypatch, tmp_path, room_for_two, order):
    events, run = _verify_run(monkeypatch, tmp_path, room_for_two=room_for_two)
    comparison, _ = run()
    assert events == order
    assert comparison.reproducible and comparison.byte_identical and comparison.image_ids == ("sha256:same",) * 2
    assert "image digests: identical, sha256:same" in (tmp_path / "verify" / "verdict.txt").read_text()


@pytest.mark.parametrize("room_for_two,order", [
    (False, ["build 1", "index 1", "remove 1", "build 2", "remove 2"]),
    (True, ["build 1", "index 1", "build 2", "remove 1", "remove 2"]),
])
def test_a_failed_second_build_leaves_neither_image_and_no_verdict(monkeypatch, tmp_path, room_for_two, order):
    events, run = _verify_run(monkeypatch, tmp_path, fail_on=2, room_for_two=room_for_two)
    with pytest.raises(CommandFailed):
        run()
    assert events == order
    assert not (tmp_path / "verify" / "verdict.txt").exists()


@pytest.mark.parametrize("compile_ops", [False, True])
def test_the_verdict_says_where_both_builds_took_the_compiled_ops_from(monkeypatch, tmp_path, compile_ops):
    _, run = _verify_run(monkeypatch, tmp_path, compile_ops=compile_ops)
    comparison, _ = run()
    verdict = (tmp_path / "verify" / "verdict.txt").read_text()
    said = "DeepSpeed ops compiled in each build" if compile_ops else "DeepSpeed ops from the host's ops seed"
    assert comparison.ops.startswith(said) and said in verdict.splitlines()[1]


def test_verify_takes_compile_ops_on_its_command_line():
    from pytorch_cuda_build import arguments
    assert arguments.parser().parse_args(["verify", "--torch", "2.7", "--cuda", "12.1", "--compile-ops"]).compile_ops
    assert not arguments.parser().parse_args(["verify", "--torch", "2.7", "--cuda", "12.1"]).compile_ops


@pytest.mark.parametrize("free_gib,keeps", [(16.9, False), (17.1, True), (35, True)])
def test_verify_keeps_the_first_build_where_a_second_of_its_size_fits(monkeypatch, free_gib, keeps):
    """A 6.5 GB image: twice its size and 4 GiB of margin, about 17 GiB, not a cold build's 25 GiB."""
    monkeypatch.setattr(verify.build, "free_bytes", lambda root: (int(free_gib * 1024**3), root))
    assert verify._room_for_two("/var/lib/docker", int(6.5 * 1024**3)) is keeps
