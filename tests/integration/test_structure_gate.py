"""The gate's packaged structure checks (pytorch_cuda_build/checks) against the default row's
built image, as build.py ran them in the session's build of it (conftest.default_build passes
--retest, so they ran in this session whatever the pass records say): every check ran, none
failed, and the containers they used are gone."""
from __future__ import annotations

import pytest

from pytorch_cuda_build.stages import gate

pytestmark = pytest.mark.docker


def test_packaged_checks_passed_on_the_default_image(docker_client, default_build):
    junit = default_build.results / "structure.xml"
    assert junit.is_file(), f"the session's build wrote no {junit.name}:\n{default_build.stderr[-3000:]}"
    counts = gate.junit_counts(junit)
    assert counts.passed > 20 and counts.failed == 0, counts
    left = docker_client.containers.list(all=True, filters={"label": f"{gate.RUN_LABEL}={gate.RUN_ID}"})
    assert not left, [c.name for c in left]
