"""The gate's packaged structure checks (pytorch_cuda_build/checks) against the default row's
built image, called as build.py calls them: every check runs, none fails, and the container
they used is gone. build.py skips a re-test of an image already tested with this test code,
so this is where the suite runs them whatever the pass records say."""
from __future__ import annotations

import docker.errors
import pytest

from pytorch_cuda_build.stages import gate, matrix

from helpers import ROOT, missing

pytestmark = pytest.mark.docker

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


def test_packaged_checks_pass_on_the_default_image(docker_client, tmp_path):
    ref = DEFAULT.refs()[0]
    try:
        image_id = docker_client.images.get(ref).id
    except docker.errors.ImageNotFound:
        missing(f"image {ref} is not built here; build it with build.py first")
    gate.structure(ROOT, DEFAULT, image_id, tmp_path, ROOT / "matrix.yaml")  # raises TestFailure on any failure
    counts = gate.junit_counts(tmp_path / "structure.xml")
    assert counts.passed > 20 and counts.failed == 0, counts
    left = docker_client.containers.list(all=True, filters={"label": f"{gate.RUN_LABEL}={gate.RUN_ID}"})
    assert not left, [c.name for c in left]
