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
