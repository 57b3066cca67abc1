"""A dated immutable tag never moves, against a real registry on 127.0.0.1.

Two tiny imported images (one small file each) carry the labels the dated tag is made
of, the same commit day and lock, so both claim the same tag, and name a third tiny image as
the base they were built on (publish pushes it first); each has a pass record in
a throwaway state directory, and the matrix is a copy whose repository is unique to the
test, so nothing public moves and no real image is needed.
"""
from __future__ import annotations

import io
import json
import subprocess
import tarfile
import uuid

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import render, sbom

from helpers import config_of, image_exists, project_copy, run_build_py, shown
from registry import LocalRegistry, require_binary

pytestmark = [pytest.mark.docker]

LOCK = "7904bf67" + "1" * 56
LABELS = {"org.opencontainers.image.created": "2026-11-22T10:00:00Z", "io.pytorch-cuda.lock-sha256": LOCK}


def _import(tmp_path, ref: str, content: bytes, labels: dict[str, str]) -> str:
    """A one-file image under ref, with these labels; returns its ID."""
    tarball = tmp_path / f"{uuid.uuid4().hex}.tar"
    with tarfile.open(tarball, "w") as t:
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mtime = len(content), 0
        t.addfile(info, io.BytesIO(content))
    cmd = ["docker", "import"] + [a for k, v in labels.items() for a in ("--change", f"LABEL {k}={v}")] + [str(tarball), ref]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, shown(proc)
    return proc.stdout.strip()


def _tested(state, image_ids: list[str], name: str) -> None:
    """Pass records in tag.py's format, as `build.py test` writes them."""
    state.mkdir(exist_ok=True)
    records = {i: [{"image": name, "mode": "cpu", "code": "issue11-test", "passed_at": 0}] for i in image_ids}
    (state / "tested.json").write_text(json.dumps(records))


def _reported(project, name: str) -> None:
    """A clean vulnerabilities.json, as the pipeline writes it after the SBOM (publish reads it)."""
    from pytorch_cuda_build.stages import security

    security.write_report(name, [], [], project / "build-results" / name / security.REPORT, {"test": "no advisories"})


def _sbom(project, name: str) -> None:
    """An SBOM where the build writes it (a push attaches it beside the image)."""
    (project / "build-results" / name / sbom.FILE).write_text(json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5",
                                                                           "components": []}))


def test_a_dated_tag_held_by_another_image_is_refused_and_nothing_moves(tmp_path, docker_client):
    require_binary()
    project = project_copy(tmp_path / "project")
    repo = f"pytorch-cuda-issue11-{uuid.uuid4().hex[:8]}"
    text = (project / "matrix.yaml").read_text()
    assert "\nrepository: pytorch-cuda\n" in text
    (project / "matrix.yaml").write_text(text.replace("\nrepository: pytorch-cuda\n", f"\nrepository: {repo}\n"))
    row = matrix.load(project / "matrix.yaml").select("2.7", "12.1")
    dated = f"{row.name}-20261122-7904bf67"
    tags = [dated, *row.tags]
    local = f"{repo}:{row.name}"
    state = tmp_path / "state"
    _reported(project, row.name)
    reg = LocalRegistry(tmp_path / "registry").start()
    made: list[str] = []

    def publish() -> subprocess.CompletedProcess:
        return run_build_py(project, "publish", "--torch", "2.7", "--cuda", "12.1", "--registry", reg.address("ns"),
                            "--push", "--retries", "2",
                            env={"PYTORCH_CUDA_STATE": str(state), "PYTORCH_CUDA_RETRY_BACKOFF": "0.2"}, timeout=300)

    def remote() -> dict[str, tuple[str, str] | None]:
        """tag -> (manifest digest, config digest), read with the registry's HTTP API."""
        out = {}
        for t in tags:
            found = reg.manifest(f"ns/{repo}", t)
            out[t] = (found[0], found[1]["config"]["digest"]) if found else None
        return out

    try:
        base = _import(tmp_path, f"{repo}-base:1", b"the base\n", {})
        made.append(base)
        labels = {**LABELS, "org.opencontainers.image.base.digest": base}
        first = _import(tmp_path, local, b"first image\n", labels)
        made.append(first)
        # a name of its own: the containerd store drops an image whose last name moves away (below)
        docker_client.images.get(first).tag(repo, "first")
        _tested(state, [first], row.name)
        proc = publish()  # without the SBOM the push would attach: refused before the registry is contacted
        assert proc.returncode == 2 and "the SBOM a push attaches" in proc.stderr and "nothing pushed" in proc.stderr, shown(proc)
        assert all(v is None for v in remote().values())
        _sbom(project, row.name)
        proc = publish()
        assert proc.returncode == 0, shown(proc)
        assert proc.stdout.count("pushed, verified") == 5, shown(proc)  # the base, then the row's four
        assert "no provenance for" in proc.stdout and "Docker 20.10's BuildKit writes none" in proc.stdout, shown(proc)
        assert reg.manifest(f"ns/{repo}-rootfs", render.rootfs_ref(row).split(":")[1] + "-" + base[7:19])[1]["config"]["digest"] == \
            config_of(docker_client, base)
        assert proc.stderr.index(f"pushing {reg.address('ns')}/{repo}:{dated} ") < proc.stderr.index(f":{row.name} ("), proc.stderr
        before = remote()
        digest = before[dated][0]
        assert all(v == (digest, config_of(docker_client, first)) for v in before.values()), before

        second = _import(tmp_path, local, b"second image, same day, same lock\n", labels)  # the local tag moves to it
        made.append(second)
        assert second != first
        _tested(state, [first, second], row.name)
        proc = publish()
        assert proc.returncode == 2, shown(proc)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert f"{reg.address('ns')}/{repo}:{dated} is immutable" in lines[0], lines[0]
        assert digest in lines[0] and first in lines[0] and second in lines[0], lines[0]
        assert remote() == before  # no tag moved, the moving ones neither
        assert not docker_client.images.list(name=f"{reg.host}/ns/{repo}")  # no local push tag left

        docker_client.images.get(first).tag(repo, row.name)  # the same image again: nothing to do
        proc = publish()
        assert proc.returncode == 0, shown(proc)
        assert proc.stdout.count("already there") == 5 and "pushing" not in proc.stderr, shown(proc)
        assert remote() == before
    finally:
        reg.stop()
        for image_id in made:
            for ref in docker_client.images.get(image_id).tags if image_exists(docker_client, image_id) else []:
                docker_client.images.remove(ref, noprune=True)
            if image_exists(docker_client, image_id):
                docker_client.images.remove(image_id, force=True)


