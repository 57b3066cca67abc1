"""The reproducibility comparison: content differences fail, time stamps are reported apart;
`docker save` read in both layouts or a typed error saying why not; one build on disk at a time."""
from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import verify
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import ArchiveLayoutError, CommandFailed

from helpers import ROOT


def entry(content="a", mode=0o644, size=1):
    return (b"0", mode, 0, 0, size, content, "")


def test_identical_content_with_other_mtimes_is_reproducible():
    a = [{"etc/x": (entry(), 100)}, {"opt/y": (entry("b"), 100)}]
    b = [{"etc/x": (entry(), 200)}, {"opt/y": (entry("b"), 100)}]
    c = verify.compare(a, b, same_layer_ids=False)
    assert c.reproducible and c.mtime_only == 1 and c.files == 2
    text = verify.verdict(c, "old BuildKit")
    assert "verdict: REPRODUCIBLE" in text and "1 file(s) differ in mtime alone" in text and "old BuildKit" in text


def test_content_mode_and_missing_files_are_named():
    a = [{"etc/x": (entry("a"), 1), "etc/only1": (entry(), 1), "bin/t": (entry(mode=0o755), 1)}]
    b = [{"etc/x": (entry("z"), 1), "bin/t": (entry(mode=0o700), 1)}]
    c = verify.compare(a, b, same_layer_ids=False)
    assert not c.reproducible
    assert c.content == ["layer 0: bin/t: mode", "layer 0: etc/only1: only in build 1", "layer 0: etc/x: content"]
    assert "verdict: NOT REPRODUCIBLE" in verify.verdict(c, "")


def test_different_layer_counts_are_not_reproducible():
    assert not verify.compare([{}], [{}, {}], same_layer_ids=False).reproducible


def test_where_file_times_are_rewritten_only_equal_digests_are_reproducible():
    """The containerd store with rewrite-timestamp promises byte-identical images: equal
    content under two digests breaks that promise, and the verdict says so."""
    a = [{"etc/x": (entry(), 100)}]
    c = verify.compare(a, a, same_layer_ids=True)
    c.image_ids, c.byte_identical = ("sha256:" + "1" * 64, "sha256:" + "2" * 64), True
    assert not c.reproducible
    text = verify.verdict(c, "rewrite-timestamp")
    assert "image digests: differ" in text and text.endswith("verdict: NOT REPRODUCIBLE: the digests differ")
    c.image_ids = ("sha256:" + "1" * 64,) * 2
    assert c.reproducible
    text = verify.verdict(c, "rewrite-timestamp")
    assert f"image digests: identical, sha256:{'1' * 64}" in text and text.endswith("verdict: REPRODUCIBLE: byte-identical images")


def test_only_regular_files_in_both_builds_are_listed_to_be_kept():
    a = [{"x.o": (entry("a"), 1), "only1": (entry(), 1), "t": (entry(mode=0o755), 1), "d/": (entry(""), 1)}]
    b = [{"x.o": (entry("b"), 1), "t": (entry(mode=0o700), 1), "d/": (entry("", mode=0o700), 1)}]
    assert verify.compare(a, b, same_layer_ids=False).differing_files == ["x.o"]  # mode-only and dirs: nothing to diff


class FakeContainer:
    def __init__(self, files, removed):
        self.files, self.removed = files, removed

    def get_archive(self, path):
        import io
        import tarfile
        data = self.files[path]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.rsplit("/", 1)[-1])
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        raw = buf.getvalue()
        return iter([raw[:100], raw[100:]]), {"size": 0 if data is None else len(data)}

    def remove(self, force=False):
        self.removed.append(self)


class FakeClient:
    """docker-py's containers.create and images.get over two images' files."""

    def __init__(self, images):
        import docker.errors
        self.images_, self.removed, self.errors = images, [], docker.errors

    @property
    def containers(self):
        outer = self

        class Containers:
            def create(self, ref, command, entrypoint, labels):
                assert entrypoint == [] and command == ["true"]  # nothing of the image runs
                assert labels["pytorch-cuda.test"] == "verify" and labels["pytorch-cuda.pid"]  # the next run sweeps it if we die
                return FakeContainer(outer.images_[ref], outer.removed)
        return Containers()

    @property
    def images(self):
        outer = self

        class Images:
            def get(self, ref):
                if ref not in outer.images_:
                    raise outer.errors.ImageNotFound(ref)
                return ref
        return Images()


def test_differing_files_are_copied_out_of_both_builds_and_every_container_removed(tmp_path, monkeypatch):
    images = {"v:1": {"/home/t/a.o": b"one", "/big": b"x" * 10, "/gone": None},
              "v:2": {"/home/t/a.o": b"two!", "/big": b"y" * 10, "/gone": None}}
    client = FakeClient(images)
    monkeypatch.setattr(verify, "KEEP_FILE_BYTES", 8)  # /big is over it
    (tmp_path / "differing" / "stale").mkdir(parents=True)  # an earlier run's copies go first
    kept = verify.keep_differing(client, ("v:1", "v:2"), ["home/t/a.o", "big", "gone"], tmp_path / "differing")
    assert kept == 1
    assert (tmp_path / "differing" / "build1" / "home/t/a.o").read_bytes() == b"one"
    assert (tmp_path / "differing" / "build2" / "home/t/a.o").read_bytes() == b"two!"
    assert not (tmp_path / "differing" / "stale").exists() and not (tmp_path / "differing" / "build1" / "big").exists()
    assert len(client.removed) == 6  # one container per file and build, none left behind


def test_without_both_builds_the_verdict_says_why_nothing_was_kept(tmp_path):
    client = FakeClient({"v:2": {}})
    said = verify._keep(client, ("v:1", "v:2"), ["a.o"], tmp_path / "differing", log=print)
    assert said == "differing files not kept (no disk for both builds at once)"
    c = verify.compare([{"a.o": (entry("a"), 1)}], [{"a.o": (entry("b"), 1)}], same_layer_ids=False)
    c.kept = said
    assert said in verify.verdict(c, "")


# ---- docker save layouts, and one build on disk at a time --------------------------

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
    monkeypatch.setattr(subprocess, "Popen", Proc)  # verify saves through record.read_saved


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
    engine = type("E", (), {"images": _Images(events), "ping": lambda self: True})()  # a failed build: the daemon still answers
    client = type("B", (), {"argv": ["docker"], "export": "oci", "description": "Docker 26"})()
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: engine)
    monkeypatch.setattr(docker_env, "build_client", lambda docker: client)
    monkeypatch.setattr(docker_env, "root_dir", lambda c: str(tmp_path))
    monkeypatch.setattr(verify.build, "check_disk", lambda root: None)
    monkeypatch.setattr(verify.base, "ensure", lambda *a, **kw: "sha256:base")

    sources = iter([verify.build.Source("abc", 1), verify.build.Source("abc-dirty", 1)])  # the checkout edited after build 1 began
    monkeypatch.setattr(verify.build, "source", lambda root: next(sources))

    def build_run(bc, root, image, log_path, ca, *, no_cache, echo, tag, base_id, ops_seed, src):
        assert no_cache and base_id == "sha256:base"
        assert src == verify.build.Source("abc", 1), "both builds' labels must name the commit read at the start"
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
    from pytorch_cuda_build import cli
    assert cli.parser().parse_args(["verify", "--torch", "2.7", "--cuda", "12.1", "--compile-ops"]).compile_ops
    assert not cli.parser().parse_args(["verify", "--torch", "2.7", "--cuda", "12.1"]).compile_ops


@pytest.mark.parametrize("free_gib,keeps", [(16.9, False), (17.1, True), (35, True)])
def test_verify_keeps_the_first_build_where_a_second_of_its_size_fits(monkeypatch, free_gib, keeps):
    """A 6.5 GB image: twice its size and 4 GiB of margin, about 17 GiB, not a cold build's 25 GiB."""
    monkeypatch.setattr(verify.build, "free_bytes", lambda root: (int(free_gib * 1024**3), root))
    assert verify._room_for_two("/var/lib/docker", int(6.5 * 1024**3)) is keeps
