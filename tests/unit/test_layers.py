"""The layout of the locked wheels in layers: the rule on the lock, on the rendered Dockerfiles,
and which wheel file of a pin the lock records (wheel_files). Offline: a stand-in index."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.buildkit import layers
from pytorch_cuda_build.errors import LockError, ResolveError
from pytorch_cuda_build.resolve import wheel_files
from pytorch_cuda_build.stages import lock, render

from helpers import ROOT, project_copy

MATRIX = matrix.load(ROOT / "matrix.yaml")
H = {c: c * 64 for c in "abcdef0123"}  # stand-in sha256 values


def lock_text(*blocks: tuple[str, str, list[str]]) -> str:
    return "# header\n" + "".join(f"{n}=={v} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hs) + "\n" for n, v, hs in blocks)


def wheels(**sizes: int) -> dict[str, dict]:
    return {n.replace("_", "-"): {"file": f"{n}-1-py3-none-any.whl", "sha256": H["a"], "size": s} for n, s in sizes.items()}


def test_large_wheels_get_their_own_layer_largest_first_and_the_rest_share_one():
    image = MATRIX.select("2.11", "13.0")
    text = lock_text(("torch", "1", [H["a"]]), ("nvidia-cublas", "1", [H["a"]]), ("six", "1", [H["a"]]),
                     ("jupyterlab", "1", [H["a"]]), ("numpy", "1", [H["a"]]))
    got = layers.plan(image, text, wheels(torch=500_000_000, nvidia_cublas=400_000_000, six=10_000, jupyterlab=17_000_000,
                                          numpy=17_000_000))
    assert got.names == ["torch", "nvidia-cublas", "jupyterlab", "numpy"]  # equal sizes: by name
    assert got.rest == ("six",) and got.rest_bytes == 10_000
    assert got.own[0].requirement == f"torch==1 --hash=sha256:{H['a']}"


def test_the_layer_count_is_capped_and_null_means_one_layer():
    image = MATRIX.select("2.11", "13.0")
    text = lock_text(*[(f"p{i}", "1", [H["a"]]) for i in range(6)])
    sizes = {f"p{i}": (i + 1) * 10_000_000 for i in range(6)}
    capped = dataclasses.replace(image, layers=matrix.Layers(own_layer_min_mb=5, max_own_layers=2))
    assert layers.plan(capped, text, wheels(**sizes)).names == ["p5", "p4"]
    single = dataclasses.replace(image, layers=matrix.Layers(own_layer_min_mb=None))
    got = layers.plan(single, text, wheels(**sizes))
    assert got.own == () and len(got.rest) == 6


def test_a_pin_without_its_wheel_file_is_refused():
    image = MATRIX.select("2.11", "13.0")
    with pytest.raises(LockError, match=r"names no linux/amd64 wheel file for six; run `python build.py lock`"):
        layers.plan(image, lock_text(("six", "1", [H["a"]])), {})


@pytest.mark.parametrize("image", [i.on(p) for i in MATRIX.images for p in i.platforms], ids=lambda i: i.local_name)
def test_every_rendered_dockerfile_installs_exactly_the_rule_s_own_layers_in_order(image):
    """The committed Dockerfile of each row and platform: one RUN per wheel the rule picks, pinned
    to the file lock.json names, largest first, then one RUN for the rest; and no wheel of the
    rule's size left in the rest."""
    meta = lock.read(ROOT, image)
    text = (lock.build_dir(ROOT, image) / "requirements.lock").read_text()
    files = layers.wheels_of(meta, image.platform)
    env = (lock.build_dir(ROOT, image) / "Dockerfile").read_text()
    env = env[env.index("AS python-env"):env.index("# ---- ops-builder")]
    pinned = re.findall(r"python -B /tmp/wheellayer.py --epoch \d+ --owner 1000:0 --wheels /wheels \\\n\s+'([^=]+)==(\S+) --hash=sha256:([0-9a-f]{64})'", env)
    assert [p[0] for p in pinned] == layers.plan(image, text, files).names
    # each layer's step reads its one locked file, from the context's inputs/ (the store)
    mounted = re.findall(r"--mount=type=bind,source=inputs/wheels/(\S+),target=/wheels/(\S+) ", env)
    assert [m[0] for m in mounted] == [m[1] for m in mounted] == [files[n]["file"] for n, _, _ in pinned]
    assert [files[n]["sha256"] for n, _, _ in pinned] == [p[2] for p in pinned]
    sizes = [files[n]["size"] for n, _, _ in pinned]
    assert sizes == sorted(sizes, reverse=True) and len(pinned) <= image.layers.max_own_layers
    floor = image.layers.own_layer_min_mb * layers.MB
    rest = set(files) - {p[0] for p in pinned}
    assert all(files[n]["size"] < floor for n in rest) or len(pinned) == image.layers.max_own_layers
    assert env.count("--rest /opt/pytorch-cuda/requirements.lock") == 1
    assert env.index("COPY requirements.lock") > env.rindex("--hash=sha256:")  # a refresh keeps the wheel layers' cache
    assert len(re.findall(r"^(RUN|COPY|ADD) ", (lock.build_dir(ROOT, image) / "Dockerfile").read_text(), re.M)) < 64


def test_the_cuda_13_rows_give_torch_and_the_nvidia_libraries_their_own_layers():
    image = MATRIX.select("2.11", "13.0")
    meta = lock.read(ROOT, image)
    names = layers.plan(image, (lock.image_dir(ROOT, image) / "requirements.lock").read_text(), meta["wheels"]).names
    assert names[0] == "torch" and {"triton", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(names)
    assert "six" not in names and "jupyterlab" in names


class FakeIndex:
    url = "https://index.example/simple/"

    def __init__(self, files: dict[str, list[tuple[str, str, int | None, str]]]):
        self._files, self.sized = files, []

    def files(self, project):
        return self._files.get(project, [])

    def size(self, url):
        self.sized.append(url)
        return 42


def test_the_recorded_wheel_is_the_best_the_os_installs_among_the_lock_s_hashes():
    text = lock_text(("debugpy", "1.8", [H["a"], H["b"], H["c"]]), ("torch", "2.11.0", [H["d"], H["e"]]))
    index = FakeIndex({
        "debugpy": [("debugpy-1.8-py2.py3-none-any.whl", H["a"], 5, "u1"),
                    ("debugpy-1.8-cp311-cp311-manylinux_2_34_x86_64.whl", H["b"], 3, "u2"),
                    ("debugpy-1.8-cp311-cp311-manylinux_2_39_x86_64.whl", H["c"], 3, "u3"),  # newer than the OS's glibc
                    ("debugpy-1.8-cp311-cp311-manylinux_2_17_x86_64.whl", H["f"], 3, "u4")],  # a hash the lock lacks
        "torch": [("torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl", H["d"], None, "u5"),
                  ("torch-2.11.0-cp311-cp311-manylinux_2_28_aarch64.whl", H["e"], 9, "u6"),
                  ("torch-2.11.0.tar.gz", H["d"], 1, "u7")]})
    got = wheel_files.wheel_files(text, "3.11", "linux/amd64", index, glibc="2.36")
    assert got["debugpy"] == {"file": "debugpy-1.8-cp311-cp311-manylinux_2_34_x86_64.whl", "sha256": H["b"], "size": 3, "url": "u2"}
    assert got["torch"] == {"file": "torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl", "sha256": H["d"], "size": 42, "url": "u5"}
    assert index.sized == ["u5"]  # no size from the index: the download's Content-Length
    # without the OS's glibc, the level uv resolved for (manylinux_2_28): the pure wheel
    assert wheel_files.wheel_files(text, "3.11", "linux/amd64", index)["debugpy"]["sha256"] == H["a"]
    assert wheel_files.wheel_files(text, "3.11", "linux/arm64", index, glibc="2.36")["torch"]["sha256"] == H["e"]


def test_a_pin_with_no_installable_wheel_is_one_error_naming_it():
    text = lock_text(("sdistonly", "1.0", [H["a"]]), ("six", "1", [H["b"]]))
    index = FakeIndex({"sdistonly": [("sdistonly-1.0.tar.gz", H["a"], 1, "u")],
                       "six": [("six-1-py2.py3-none-any.whl", H["b"], 1, "u")]})
    with pytest.raises(ResolveError, match=r"has no linux/amd64 wheel for Python 3.11 with a hash the lock lists: sdistonly==1.0$"):
        wheel_files.wheel_files(text, "3.11", "linux/amd64", index)


def test_glibc_comes_from_the_lock_s_libc6_pin():
    assert wheel_files.glibc_of({"libc6": "2.36-9+deb12u7"}) == "2.36"
    assert wheel_files.glibc_of({}) is None


def test_wheel_files_that_do_not_match_the_lock_make_it_stale(tmp_path):
    root = project_copy(tmp_path / "p")
    image = MATRIX.select("2.7", "12.1")
    path = lock.image_dir(root, image) / "lock.json"
    meta = json.loads(path.read_text())
    assert lock.problems(root, image) == []
    meta["wheels"]["six"]["sha256"] = H["0"]
    path.write_text(json.dumps(meta))
    assert lock.problems(root, image) == [f"{image.name}: lock.json's linux/amd64 wheel file of six is not one "
                                          "requirements.lock allows; run `python build.py lock`"]
    del meta["wheels"]["six"]
    path.write_text(json.dumps(meta))
    assert "are not requirements.lock's pins (six)" in lock.problems(root, image)[0]
    del meta["wheels"]
    path.write_text(json.dumps(meta))
    assert lock.problems(root, image) == [f"{image.name}: lock.json records no linux/amd64 wheel files; run `python build.py lock`"]
    with pytest.raises(LockError, match="no wheel files for linux/amd64"):
        render.render_image(root, image)


def test_a_build_step_s_script_that_imports_a_module_beside_it_runs_with_dash_b():
    """Python caches an imported module's byte-code beside it (a __pycache__ in the layer), stamped
    with the source file's mtime, which is the checkout's: two clones of one commit would build two
    images (seen: /tmp/__pycache__/lockfile.cpython-311.pyc). A script run as a build step that
    imports a sibling runs with -B; the script itself, run as __main__, is never cached."""
    runtime = ROOT / "pytorch_cuda_runtime"
    siblings = {p.stem for p in runtime.glob("*.py")}
    run = re.compile(r"\bpython3?((?: -[A-Za-z]+)*) (/\S+/(\w+)\.py)\b")
    checked = 0
    for dockerfile in ROOT.glob("images/**/Dockerfile"):
        for flags, path, stem in run.findall(dockerfile.read_text()):
            source = (runtime / f"{stem}.py").read_text()
            imported = set(re.findall(r"^\s*(?:import|from) (\w+)", source, re.M)) & (siblings - {stem})
            if imported:
                checked += 1
                assert "-B" in flags.split(), f"{dockerfile.relative_to(ROOT)}: python{flags} {path} imports {sorted(imported)}"
    assert checked, "no build step runs a script that imports a sibling: the test reads nothing"
