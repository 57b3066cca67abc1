"""`record` and `verify --record` on small images (a few files FROM scratch, built by Docker 20.10)
labelled as build.py labels the default row: an image's own record compares as the same image, and
the record of an image that differs in one file and one label names that file, its layer and the
label, with no access to the recorded image; a local image that is not there is one line."""
from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from pytorch_cuda_build.commands import record
from pytorch_cuda_build.stages import build

from helpers import ROOT, one_error_line, run_build_py, shown
from registry import small_image

pytestmark = [pytest.mark.docker]

DOCKER = "/usr/bin/docker"
ROW = ("--torch", "2.7", "--cuda", "12.1")


def small(tmp: Path, motd: str, torch: str = "2.7.1") -> str:
    labels = {"org.opencontainers.image.revision": build.source(ROOT).revision, "io.pytorch-cuda.image": "2.7.1-cuda12.1-runtime",
              "io.pytorch-cuda.torch": torch}
    return small_image(tmp, {"/etc/motd": motd, "/etc/os-release": "ID=test\n"}, labels)


@pytest.fixture(scope="module")
def images(tmp_path_factory, docker_client):
    tmp = tmp_path_factory.mktemp("record")
    made = uuid.uuid4().hex[:8]
    here, elsewhere = small(tmp, f"built here {made}\n"), small(tmp, f"built elsewhere {made}\n", torch="9.9")
    try:
        yield tmp, here, elsewhere
    finally:
        subprocess.run([DOCKER, "image", "rm", "--force", here, elsewhere], capture_output=True)


def write_record(tmp: Path, ref: str, name: str) -> Path:
    out = tmp / f"{name}.json.xz"
    proc = run_build_py(ROOT, "record", *ROW, "--image", ref, "--output", str(out), "--docker", DOCKER, timeout=600)
    assert proc.returncode == 0, shown(proc)
    assert f"{out}: image " in proc.stdout and "2 layers, " in proc.stdout, proc.stdout
    return out


def test_an_images_own_record_reads_as_the_same_image(images):
    tmp, here, _ = images
    path = write_record(tmp, here, "here")
    rec = record.load(path)
    assert [sorted(layer.entries or {}) for layer in rec.layers] == [["etc", "etc/motd"], ["etc", "etc/os-release"]]
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(path), "--against", here, "--docker", DOCKER, timeout=600)
    assert proc.returncode == 0, shown(proc)
    assert "config digest and layer diff_ids: identical" in proc.stdout and proc.stdout.rstrip().endswith("verdict: THE SAME IMAGE")


def test_another_machines_record_names_the_differing_file_its_layer_and_the_label(images):
    tmp, here, elsewhere = images
    path = write_record(tmp, elsewhere, "elsewhere")
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(path), "--against", here, "--docker", DOCKER, timeout=600)
    assert proc.returncode == 1, shown(proc)
    out = proc.stdout
    # Docker 20.10 keeps build-time file times, so the other layer's diff_id may differ too; only the
    # file whose bytes differ is named, one that differs in its mtime alone is counted apart.
    assert "differing layers: 0" in out, out
    named = out.split("CONTENT DIFFERS in 1 file(s):\n", 1)[1].splitlines()[0]
    assert named == "  layer 0: etc/motd: size, content", out
    assert "label io.pytorch-cuda.torch: '9.9' -> '2.7.1'" in out, out
    assert out.rstrip().endswith("verdict: DIFFERENT")


def test_a_local_image_that_is_not_there_is_one_line(images):
    tmp, here, _ = images
    path = write_record(tmp, here, "absent")
    proc = run_build_py(ROOT, "verify", *ROW, "--record", str(path), "--against", f"pcb-small-test:absent-{uuid.uuid4().hex[:8]}",
                        "--docker", DOCKER, timeout=600)
    one_error_line(proc, 2, "no local image pcb-small-test:absent-")
