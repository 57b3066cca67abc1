"""Structure tests run against one image: `--image` (ID or reference) and `--image-name`
(its matrix row). `build.py` runs them against each candidate before tagging."""
from __future__ import annotations

from pathlib import Path

import pytest
import testinfra

from pytorch_cuda_build import lock, matrix, render, test

ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    parser.addoption("--image", help="image ID or reference to test")
    parser.addoption("--image-name", default="2.7.1-cuda12.1-runtime", help="its matrix image name")
    parser.addoption("--matrix", default=str(ROOT / "matrix.yaml"))


@pytest.fixture(scope="session")
def row(request) -> matrix.Image:
    return matrix.load(Path(request.config.getoption("--matrix"))).by_name(request.config.getoption("--image-name"))


@pytest.fixture(scope="session")
def image_ref(request, row, docker_client) -> str:
    ref = request.config.getoption("--image") or row.refs()[0]
    try:
        docker_client.images.get(ref)
    except Exception:
        pytest.skip(f"image {ref} is not built here; build it with build.py first")
    return ref


@pytest.fixture(scope="session")
def image_attrs(docker_client, image_ref) -> dict:
    return docker_client.images.get(image_ref).attrs


@pytest.fixture(scope="session")
def container(docker_client, image_ref):
    """A long-running container of the image, removed at the end."""
    c = docker_client.containers.run(
        image_ref, ["sleep", "infinity"], detach=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"},
        labels={"pytorch-cuda.test": "structure", test.RUN_LABEL: test.RUN_ID},
    )
    yield c
    c.remove(force=True)


@pytest.fixture(scope="session")
def host(container):
    return testinfra.get_host(f"docker://{container.id}")


@pytest.fixture(scope="session")
def root_host(container):
    return testinfra.get_host(f"docker://root@{container.id}")


@pytest.fixture(scope="session")
def lock_meta(row) -> dict:
    return lock.read(ROOT, row)


@pytest.fixture(scope="session")
def expected_labels(row, lock_meta) -> dict:
    return dict(render.labels(row, lock_meta))
