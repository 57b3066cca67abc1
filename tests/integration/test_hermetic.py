"""The default row's digest does not depend on the day it is built, on Debian's mirror or on the
network (on request: two builds of the default row on Docker 26, about 30-40 min on 2 cores).

    PYTORCH_CUDA_TEST_HERMETIC=1 python3 build.py selftest -- tests/integration/test_hermetic.py

From a clone at HEAD, on Docker 26's containerd store (`build.py engine`), with a state directory
and store of its own:

1. the row built as the README builds it: its files fetched into the store, its image ID noted;
2. the machine's clock moved to another day (two days on: `date -s`, put back after, whatever
   happens), and every mirror and index "moved": http_proxy and https_proxy point at a proxy on
   127.0.0.1 that answers every address with 404 and notes it (a mirror that dropped every locked
   version and serves nothing else either);
3. under both, the base rebuilt (`build.py base --rebuild`) and the row built again with
   `--no-cache` (every step run again; the DeepSpeed ops from the host's ops seed).

Asserted: the base has the recorded diff_id; the second build is the first's image (one image ID,
the manifest's digest on this store); the proxy was asked nothing (no step and no stage reached a
mirror or an index). Each build runs with `--network none` in any case (stages/build.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import pytest

from pytorch_cuda_build import matrix

from helpers import ROOT, clone_at, current_engine, needs_root, run_build_py, sources_gone, store_restored

ON_REQUEST = "PYTORCH_CUDA_TEST_HERMETIC"
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.engine26, pytest.mark.root,
              pytest.mark.skipif(os.environ.get(ON_REQUEST) != "1",
                                 reason=f"on request ({ON_REQUEST}=1): two builds of the default row on Docker 26 with the "
                                        "machine's clock moved, about 30-40 min on 2 cores")]
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
DAYS_ON = 2


@contextlib.contextmanager
def clock_moved(days: int):
    """The machine's clock `days` on; put back (by the monotonic time that passed) whatever happens."""
    needs_root("setting the machine's clock")
    wall, mono = time.time(), time.monotonic()
    subprocess.run(["date", "-s", f"@{int(wall + days * 86400)}"], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["date", "-s", f"@{int(wall + time.monotonic() - mono)}"], check=True, capture_output=True)


def image_id(env: dict[str, str]) -> str:
    ref = f"{ROW.repository}-candidate:{ROW.local_name}"
    return subprocess.run([env["PYTORCH_CUDA_DOCKER"], "image", "inspect", "--format", "{{.Id}}", ref], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_another_day_and_a_moved_mirror_give_the_same_image_built_from_the_store(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    checkout = clone_at(tmp_path / "checkout", head)
    with current_engine("containerd") as engine, store_restored(engine):
        env = {**os.environ, **engine, "PYTORCH_CUDA_STATE": str(tmp_path / "state")}
        first = run_build_py(checkout, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--quiet", env=env, timeout=5400)
        assert first.returncode == 0, first.stderr[-3000:]
        built = image_id(env)
        with sources_gone() as (mirror, moved), clock_moved(DAYS_ON):
            cut = {**env, **moved}
            base = run_build_py(checkout, "base", "--torch", "2.7", "--cuda", "12.1", "--rebuild", env=cut, timeout=1800)
            again = run_build_py(checkout, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--no-cache", "--quiet", env=cut,
                                 timeout=5400)
            asked = list(mirror.asked)
        assert base.returncode == 0, base.stderr[-3000:]
        recorded = json.loads((checkout / "images" / ROW.name / "base.json").read_text())["linux/amd64"]["diff_id"]
        assert f"diff_id:     {recorded}" in base.stdout, base.stdout
        assert again.returncode == 0, again.stderr[-3000:]
        assert "already in the store" in again.stderr, again.stderr[-3000:]
        assert image_id(cut) == built, f"another day's build from the store is not the first: {image_id(cut)} vs {built}"
        assert asked == [], f"the build asked a mirror or an index: {asked[:5]}"
    (ROOT / "build-results").mkdir(exist_ok=True)
    (ROOT / "build-results" / "hermetic.json").write_text(json.dumps(
        {"commit": head, "image_id": built, "days_on": DAYS_ON, "base_diff_id": recorded, "mirror_requests": 0}, indent=2) + "\n")


