"""Fixtures of the structure checks, run against one image: `--image` (ID or reference),
`--image-name` (its matrix row), `--matrix` (the matrix file) and `--root` (the project
holding `images/<image>/`, which the image must equal). `gate.structure` passes all four
for each candidate before tagging it."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import docker.errors
import pytest
import testinfra

from pytorch_cuda_build import matrix
from pytorch_cuda_build.checks import support
from pytorch_cuda_build.checks.support import Container, Host
from pytorch_cuda_build.engine import containers
from pytorch_cuda_build.stages import lock, render


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--image", help="image ID or reference to test")
    parser.addoption("--image-name", default="2.7.1-cuda12.1-runtime", help="its matrix image name")
    parser.addoption("--root", default=".", help="the project: matrix.yaml and images/<image>/ (default: the current directory)")
    parser.addoption("--matrix", help="matrix file (default: ROOT/matrix.yaml)")
    parser.addoption("--platform", default="linux/amd64", help="the OS platform the image was built for (its CPU baseline)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: needs a Docker daemon")


@pytest.fixture(scope="session")
def project_root(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.getoption("--root")).resolve()


@pytest.fixture(scope="session")
def row(request: pytest.FixtureRequest, project_root: Path) -> matrix.Image:
    path = request.config.getoption("--matrix") or project_root / "matrix.yaml"
    return matrix.load(Path(path)).by_name(request.config.getoption("--image-name")).on(request.config.getoption("--platform"))


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    c, why = support.daemon()
    if c is None:
        pytest.skip(f"no Docker daemon: {why}")  # every check skipped: the gate counts 0 run as a failure
    return c


@pytest.fixture(scope="session")
def image_ref(request: pytest.FixtureRequest, row: matrix.Image, docker_client: docker.DockerClient) -> str:
    ref = request.config.getoption("--image") or row.refs()[0]
    try:
        docker_client.images.get(ref)
    except docker.errors.ImageNotFound:
        pytest.skip(f"image {ref} is not built here; build it with build.py first")
    return ref


@pytest.fixture(scope="session")
def image_attrs(docker_client: docker.DockerClient, image_ref: str) -> dict:
    return docker_client.images.get(image_ref).attrs


@pytest.fixture(scope="session")
def container(docker_client: docker.DockerClient, image_ref: str) -> Iterator[Container]:
    """A long-running container of the image, removed at the end."""
    c = docker_client.containers.run(
        image_ref, ["sleep", "infinity"], detach=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"},
        labels=containers.labels("structure"),
    )
    yield c
    c.remove(force=True)


@pytest.fixture(scope="session")
def host(container: Container) -> Host:
    return testinfra.get_host(f"docker://{container.id}")


@pytest.fixture(scope="session")
def root_host(container: Container) -> Host:
    return testinfra.get_host(f"docker://root@{container.id}")


@pytest.fixture(scope="session")
def lock_meta(row: matrix.Image, project_root: Path) -> dict:
    return lock.read(project_root, row)


@pytest.fixture(scope="session")
def expected_labels(row: matrix.Image, lock_meta: dict) -> dict:
    return dict(render.labels(row, lock_meta))
