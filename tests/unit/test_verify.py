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
