"""`build.py --torch X --require-gpu` through the real CLI path, with every Docker call
replaced at the function level: an earlier CPU pass never lets a GPU-less machine move
the tags, and an unchanged image with unchanged tests is not tested again."""
from __future__ import annotations

import json
from types import SimpleNamespace

import certifi
import pytest

from pytorch_cuda_build import cli, paths
from pytorch_cuda_build import pipeline as row_pipeline
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.stages import base, build, gate, lock, render, sbom, security, tag

ID = "sha256:" + "c" * 64
ROW = SimpleNamespace(name="2.7.1-cuda12.1-runtime", repository="pytorch-cuda", platform="linux/amd64", platforms=("linux/amd64",),
                      local_name="2.7.1-cuda12.1-runtime", refs=lambda: ["pytorch-cuda:2.7.1-cuda12.1-runtime"])
ROW.on = lambda platform: ROW
ARGS = ["--torch", "2.7", "--cuda", "12.1", "--ca-bundle", certifi.where(), "--quiet"]


class FakeDaemon:
    """A daemon with no NVIDIA runtime that remembers what would have changed."""

    def __init__(self):
        self.removed: list[str] = []
        self.images = SimpleNamespace(get=lambda ref: SimpleNamespace(id=ID, attrs={"Size": 1}), remove=lambda ref, **kw: self.removed.append(ref))

    def info(self):
        return {"Runtimes": {"runc": {}}, "DockerRootDir": "/"}


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """Every stage before the test gate faked; what the gate and the tagger did is recorded."""
    daemon, seen = FakeDaemon(), {"promoted": [], "tested": 0}
    monkeypatch.setattr(tag, "TESTED", tmp_path / "state" / "tested.json")
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # leave pytest's handlers alone
    monkeypatch.setattr(cli.matrix, "load", lambda path: SimpleNamespace(select=lambda *a: ROW))
    monkeypatch.setattr(lock, "check", lambda *a: None)
    monkeypatch.setattr(render, "check", lambda *a: None)
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(row_pipeline, "results_dir", lambda root, image: tmp_path / "results")
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log: daemon)
    monkeypatch.setattr(docker_env, "build_client", lambda d: SimpleNamespace(description="a fake client", argv=("docker", "build")))
    monkeypatch.setattr(build, "check_disk", lambda root: None)
    monkeypatch.setattr(lock, "build_inputs", lambda root, image: SimpleNamespace(all=list, base=()))  # nothing to fetch
    monkeypatch.setattr(base, "ensure", lambda *a, **kw: "sha256:base")
    monkeypatch.setattr(build, "run", lambda *a, **kw: ID)
    monkeypatch.setattr(sbom, "generate", lambda c, i: {"components": []})
    monkeypatch.setattr(security, "record", lambda *a: {"python": [], "counts": {}})  # no network in a unit test
    monkeypatch.setattr(tag, "promote", lambda c, image, i: seen["promoted"].append(i) or image.refs())
    real_run = gate.run

    def counted_run(*a, **kw):
        seen["tested"] += 1
        return real_run(*a, **kw)
    monkeypatch.setattr(gate, "run", counted_run)
    return seen


def test_require_gpu_after_a_cpu_pass_fails_without_a_gpu(pipeline, capsys):
    tag.record_pass(ROW, ID, {"gpus": 0}, gate.code_hash(cli.ROOT))
    before = tag.TESTED.read_text()
    assert cli.main([*ARGS, "--require-gpu"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert errors == ["error: --require-gpu: this Docker daemon has no NVIDIA runtime and no CDI nvidia.com/gpu device "
                      "(install the NVIDIA Container Toolkit)"]
    assert pipeline == {"promoted": [], "tested": 1}
    assert tag.TESTED.read_text() == before  # still only the CPU pass


def test_unchanged_image_and_tests_are_not_tested_again(pipeline, capsys):
    tag.record_pass(ROW, ID, {"gpus": 0}, gate.code_hash(cli.ROOT))
    assert cli.main(ARGS) == 0
    err = capsys.readouterr().err
    assert "already passed its tests (cpu) and the test code is unchanged" in err
    assert pipeline == {"promoted": [ID], "tested": 0}


def test_edited_tests_run_again(pipeline, monkeypatch):
    tag.record_pass(ROW, ID, {"gpus": 2}, "the hash of older test code")
    monkeypatch.setattr(gate, "smoke", lambda *a: {"gpus": 0, "summary": {"PASS": 3}})
    monkeypatch.setattr(gate, "structure", lambda *a: None)
    assert cli.main(ARGS) == 0
    assert pipeline == {"promoted": [ID], "tested": 1}
    recs = json.loads(tag.TESTED.read_text())[ID]
    assert [(r["mode"], r["code"]) for r in recs] == [("gpu", "the hash of older test code"), ("cpu", gate.code_hash(cli.ROOT))]
