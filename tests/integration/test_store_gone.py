"""A build whose store lacks a locked file that no source serves any more stops before building or
tagging anything, in one line naming the file and the ways on (docs/reproducibility.md, "What a
build reads"). The sources here are a proxy on 127.0.0.1 that serves nothing: every mirror and the
package index gone, as for a commit built years later on a machine without its store."""
from __future__ import annotations

import docker
import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import lock, tag

from helpers import ROOT, run_build_py, sources_gone

pytestmark = [pytest.mark.docker, pytest.mark.second_lane]
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


def test_an_empty_store_and_no_source_is_one_line_and_nothing_built_or_tagged(tmp_path, docker_client):
    before = {ref: _id(docker_client, ref) for ref in tag.refs(ROW)}
    images = {i.id for i in docker_client.images.list(all=True)}
    store = tmp_path / "store"
    with sources_gone() as (gone, cut):
        proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", env={"PYTORCH_CUDA_STORE": str(store), **cut},
                            timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert " is not in the store" in errors[0] and "build.py fetch --from DIR" in errors[0] and "relock" in errors[0], errors
    assert gone.asked, "no source was asked"
    assert {ref: _id(docker_client, ref) for ref in tag.refs(ROW)} == before  # no tag moved
    assert {i.id for i in docker_client.images.list(all=True)} == images  # nothing built, not even the base
    assert not list(store.glob("sha256/*")) and not [p for p in store.glob("partial/*") if p.stat().st_size]  # nothing half-written


def test_fetch_from_a_folder_without_the_file_names_what_it_lacks(tmp_path):
    """`fetch --from` an air-gapped host's folder that lacks files: one line, how many and one of them."""
    (tmp_path / "usb").mkdir()
    proc = run_build_py(ROOT, "fetch", "--torch", "2.7", "--cuda", "12.1", "--from", str(tmp_path / "usb"),
                        env={"PYTORCH_CUDA_STORE": str(tmp_path / "store")}, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    n = len(lock.build_inputs(ROOT, ROW).all())
    assert proc.returncode == 1 and errors == [f"error: {tmp_path / 'usb'} lacks {n} of {ROW.name} (linux/amd64)'s {n} files, "
                                               f"{errors[0].split(', ')[-1].removesuffix(' among them')} among them"], proc.stderr


def _id(c: docker.DockerClient, ref: str) -> str | None:
    try:
        return c.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None

