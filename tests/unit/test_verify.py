"""The reproducibility comparison: content differences fail, time stamps are reported apart."""
from pytorch_cuda_build import verify


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
            def create(self, ref, command, entrypoint):
                assert entrypoint == [] and command == ["true"]  # nothing of the image runs
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
