"""`record` and `verify --record` on the tested default image: its own record compares as the
same image, and a record of an image that differs in one file's bytes and one label names that
file, its layer and the label, with no access to the recorded image."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pytorch_cuda_build.tools import record

from helpers import ROOT, default_image, one_error_line, run_build_py, shown

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.second_lane]

ROW = ("--torch", "2.7", "--cuda", "12.1")


@pytest.fixture(scope="module")
def own_record(tmp_path_factory) -> tuple[str, Path]:
    ref = default_image()
    out = tmp_path_factory.mktemp("record") / "v2.7.json.xz"
    proc = run_build_py(ROOT, "record", *ROW, "--image", ref, "--output", str(out), timeout=1800)
    assert proc.returncode == 0, shown(proc)
    assert f"{out}: image " in proc.stdout and " layers, " in proc.stdout, proc.stdout
    return ref, out


def test_the_images_own_record_reads_as_the_same_image(own_record):
    ref, path = own_record
    rec = record.load(path)
    assert len(rec.layers) == len(rec.config["rootfs"]["diff_ids"]) and all(layer.entries for layer in rec.layers[:-1])
    assert "DEBIAN_MIRROR" in str(rec.config["history"])  # the mirror's host is not in a record
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(path), "--against", ref, timeout=1800)
    assert proc.returncode == 0, shown(proc)
    assert "verdict: THE SAME IMAGE" in proc.stdout and "config digest and layer diff_ids: identical" in proc.stdout


def test_a_record_that_differs_in_one_file_and_one_label_names_both(own_record, tmp_path):
    ref, path = own_record
    rec = record.load(path)
    layer = max(range(len(rec.layers)), key=lambda i: sum(1 for e in (rec.layers[i].entries or {}).values() if e[0] == "0"))
    name, entry = next((p, e) for p, e in sorted((rec.layers[layer].entries or {}).items()) if e[0] == "0" and e[3] > 0)
    assert rec.layers[layer].entries is not None
    rec.layers[layer].entries[name] = (*entry[:5], hashlib.sha256(b"built elsewhere").hexdigest())
    rec.layers[layer].diff_id = "sha256:" + "0" * 64
    rec.config = {**rec.config, "config": {**rec.config["config"], "Labels": {**rec.config["config"]["Labels"], "io.pytorch-cuda.torch": "9.9"}}}
    rec.config_digest = "sha256:" + "1" * 64
    other = tmp_path / "elsewhere.json.xz"
    record.write(rec, other)
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(other), "--against", ref, timeout=1800)
    assert proc.returncode == 1, shown(proc)
    assert f"differing layers: {layer} (by diff_id)" in proc.stdout, proc.stdout
    assert f"layer {layer}: {name}: content" in proc.stdout, proc.stdout
    assert "label io.pytorch-cuda.torch: '9.9' -> '2.7.1'" in proc.stdout
    assert "CONTENT DIFFERS in 1 file(s)" in proc.stdout and proc.stdout.rstrip().endswith("verdict: DIFFERENT")


def test_a_row_that_is_not_built_here_is_one_line(own_record):
    _, path = own_record
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(path), "--against", "pytorch-cuda:no-such-tag", timeout=600)
    one_error_line(proc, 2, "no local image pytorch-cuda:no-such-tag: build the row first")
