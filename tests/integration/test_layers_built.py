"""The wheel layout in built images.

- The default row's image (CI's README build, Docker 20.10): its history has one layer per wheel
  the rule gives its own, in the lock's order, then the rest, each made by wheellayer.py.
- Docker 26's containerd store, the way it builds every published image (buildx, an OCI export
  with rewrite-timestamp): the python-env steps rendered from templates/python_env.j2 with tiny
  wheels of this test's own. Two "rows" that install one wheel file in different company share
  its layer blob; a refresh that moves one small package takes every large wheel's layer from the
  build cache and changes only the last layer's blob.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.buildkit import layers
from pytorch_cuda_build.matrix import REPRODUCIBLE_EPOCH
from pytorch_cuda_build.stages import lock, render

from helpers import ROOT, base_in_current_engine, current_engine, make_wheel, shown

pytestmark = [pytest.mark.docker]

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


@pytest.mark.slow
def test_the_default_image_has_a_layer_per_large_wheel_in_the_lock_s_order(default_build, docker_client):
    image = docker_client.images.get(ROW.refs()[0])
    steps = [h for h in reversed(image.history()) if "/tmp/wheellayer.py" in (h.get("CreatedBy") or "")]
    meta = lock.read(ROOT, ROW)
    plan = layers.plan(ROW, (lock.image_dir(ROOT, ROW) / "requirements.lock").read_text(), meta["wheels"])
    pinned = [re.search(r"'([^=']+)==(\S+) --hash=sha256:([0-9a-f]{64})'", h["CreatedBy"]) for h in steps[:-1]]
    assert [(m.group(1), m.group(3)) for m in pinned] == [(w.name, w.sha256) for w in plan.own]
    assert "--rest /opt/pytorch-cuda/requirements.lock" in steps[-1]["CreatedBy"]
    assert all(h["Size"] > 0 for h in steps), [(h["CreatedBy"][-60:], h["Size"]) for h in steps]
    # the largest wheel's layer holds it: torch's is the largest layer of the image
    assert max(steps, key=lambda h: h["Size"]) is steps[0] and plan.own[0].name == "torch"


# ---- blob sharing on Docker 26's containerd store ------------------------------------------------

WHEELS = {  # name -> (version, files): "big" ones get layers of their own, "small" ones share the last
    "bigalpha": ("1.0", {"bigalpha/__init__.py": "X = 'a' * 10\n", "bigalpha/include/a.h": "#pragma once\n"}),
    "bigbeta": ("1.0", {"bigbeta/__init__.py": "X = 'b'\n"}),
    "shared": ("2.0", {"shared/__init__.py": "S = 2\n", "shared/data.txt": "s" * 4000}),
    "tiny": ("1.0", {"tiny/__init__.py": "T = 1\n"}),
    "tiny@1.1": ("1.1", {"tiny/__init__.py": "T = 11\n"}),
}


def _wheels(house: Path) -> dict[str, tuple[str, str]]:
    """The wheels made in house: key -> (pin, sha256)."""
    out = {}
    for key, (version, files) in WHEELS.items():
        name = key.split("@")[0]
        out[key] = (f"{name}=={version}", make_wheel(house, name, version, files))
    return out


def _dockerfile(base: str, cache_id: str, own: list[tuple[str, str]], rest: list[tuple[str, str]]) -> str:
    """Python on the row's base rootfs, then the python-env stage exactly as the product's template
    renders it, for these wheels (read from the context's inputs/, as a row's are: _inputs)."""
    layout = layers.Layout(own=tuple(layers.OwnLayer(p.split("==")[0], p.split("==")[1], _file(p), h, 1) for p, h in own),
                           rest=tuple(p.split("==")[0] for p, _ in rest), rest_bytes=1)
    env = render._env(ROOT).get_template("python_env.j2").render(layout=layout, cache_id=cache_id, reproducible_epoch=REPRODUCIBLE_EPOCH)
    return (f"FROM {base} AS base\n"
            "RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/* "
            "&& python3 -m venv /opt/venv\n"
            "ENV PATH=/opt/venv/bin:$PATH PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1\n" + env)


def _file(pin: str) -> str:
    """make_wheel's file name for a pin."""
    name, version = pin.split("==")
    return f"{name}-{version}-py3-none-any.whl"


def _inputs(ctx: Path, house: Path, own: list[tuple[str, str]], rest: list[tuple[str, str]]) -> None:
    """The context's inputs/ as build.stage_inputs lays a row's out: each own layer's wheel in
    inputs/wheels/, the rest's in inputs/rest/ (this build's only)."""
    for folder, pins in (("wheels", own), ("rest", rest)):
        d = ctx / "inputs" / folder
        if d.exists():
            for old in d.iterdir():
                old.unlink()
        d.mkdir(parents=True, exist_ok=True)
        for p, _ in pins:
            (d / _file(p)).write_bytes((house / _file(p)).read_bytes())


def _build(env: dict, ctx: Path, dockerfile: str, name: str, cache_ok: bool = True) -> tuple[list[str], str]:
    """buildx with rewrite-timestamp to an OCI tarball, as build.py exports on this store; the
    layer blob digests (in order) and the build's log."""
    (ctx / f"{name}.Dockerfile").write_text(dockerfile)
    tarball = ctx / f"{name}.tar"
    reqs = ctx / "requirements.lock"
    proc = subprocess.run([env["PYTORCH_CUDA_DOCKER"], "buildx", "build", "--progress=plain", "--provenance=false",
                           "--network", "host", "-f", str(ctx / f"{name}.Dockerfile"), "--target", "python-env",
                           "--output", f"type=oci,dest={tarball},rewrite-timestamp=true", str(ctx)],
                          env={**os.environ, **env, "SOURCE_DATE_EPOCH": str(REPRODUCIBLE_EPOCH)}, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, shown(proc)
    assert reqs.exists()
    with tarfile.open(tarball) as t:
        index = json.load(t.extractfile("index.json"))
        manifest = json.load(t.extractfile(f"blobs/sha256/{index['manifests'][0]['digest'].split(':')[1]}"))
    return [layer["digest"] for layer in manifest["layers"]], proc.stderr


def _lock(ctx: Path, pins: list[tuple[str, str]]) -> None:
    (ctx / "requirements.lock").write_text("# test lock\n" + "".join(f"{p} \\\n    --hash=sha256:{h}\n" for p, h in pins))


@pytest.fixture(scope="module")
def current():
    with current_engine() as env:
        yield env


@pytest.mark.engine26
def test_a_wheel_shares_its_layer_blob_across_rows_and_a_refresh_changes_only_the_last_layer(current, docker_client, tmp_path):
    base = base_in_current_engine(current, docker_client, ROW, tmp_path / "base")
    ctx, house = tmp_path / "ctx", tmp_path / "house"
    house.mkdir()
    w = _wheels(house)
    (ctx / "pytorch_cuda_runtime").mkdir(parents=True)
    for name in ("wheellayer.py", "lockfile.py"):  # what its steps bind-mount (wheellayer_mounts.j2)
        (ctx / "pytorch_cuda_runtime" / name).write_bytes((ROOT / "pytorch_cuda_runtime" / name).read_bytes())
    cache_id = f"pytorch-cuda-test-wheels-{uuid.uuid4().hex[:12]}"

    def build(own: list[tuple[str, str]], rest: list[tuple[str, str]], name: str) -> tuple[list[str], str]:
        _lock(ctx, own + rest)
        _inputs(ctx, house, own, rest)
        return _build(current, ctx, _dockerfile(base, cache_id, own, rest), name)

    row_a, _ = build([w["bigalpha"], w["shared"]], [w["tiny"]], "a")
    row_b, _ = build([w["bigbeta"], w["shared"]], [w["tiny"]], "b")
    # layers: rootfs, apt+venv, own..., COPY lock, rest
    own_a, own_b = row_a[2:4], row_b[2:4]
    assert own_a[0] != own_b[0]  # bigalpha and bigbeta
    assert own_a[1] == own_b[1], "the same wheel file after another first layer: the same blob"

    refresh, log = build([w["bigalpha"], w["shared"]], [w["tiny@1.1"]], "a-refresh")
    assert refresh[2:4] == row_a[2:4], "the large wheels' layers: the same blobs"
    assert refresh[-1] != row_a[-1]  # the last layer (the rest, with tiny 1.1) is new
    own_steps = re.findall(r"^#(\d+) \[python-env \d+/\d+\] RUN .*wheellayer\.py --epoch \d+ --owner \d+:\d+ --wheels /wheels +'.*$", log, re.M)
    assert len(own_steps) == 2, log[-3000:]
    steps = "\n".join(ln for ln in log.splitlines() if re.match(r"^#\d+ (\[|CACHED|DONE)", ln))
    assert all(re.search(rf"^#{n} CACHED$", log, re.M) for n in own_steps), f"the large wheels' steps ran again:\n{steps}"
