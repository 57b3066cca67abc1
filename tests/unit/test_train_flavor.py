"""The train flavor: matrix.yaml's `train:` extras, their lock over the runtime's, the rendered
stages, the TE seed and the security pins. Pure: no daemon, no network."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_matrix import VALID, load, problems

from pytorch_cuda_build import matrix, paths
from pytorch_cuda_build.buildkit import layers, opsseed
from pytorch_cuda_build.errors import BuildError, LockError
from pytorch_cuda_build.resolve import pypi as resolve_pypi
from pytorch_cuda_build.stages import lock, render, security

from helpers import ROOT, project_copy

M = matrix.load(ROOT / "matrix.yaml")
TRAIN = M.select("2.11", "13.0", "train")
DEFAULT_TRAIN = M.select("2.7", "12.1", "train")
EXTRAS = """\
train:
  te:
    purpose: FP8
    requirement: transformer-engine[pytorch]==2.20.2
    build: transformer-engine-torch
    wheel_cuda: ">=13.0"
    cudnn: ">=9.12"
    source: TE's docs
  ao:
    purpose: float8
    requirement: torchao=={version}
    versions: {"2.7": 0.12.0}
    source: torchao's table
"""


def train_matrix(tmp_path, extras=EXTRAS, flavors="[runtime, train]"):
    text = VALID.replace("    default: true\n", f"    default: true\n    flavors: {flavors}\n") + extras
    return text


# ---- matrix ---------------------------------------------------------------------------------


def test_a_train_row_gets_the_extras_it_can_use_and_says_why_not_the_others(tmp_path):
    m = load(tmp_path, train_matrix(tmp_path))
    train = m.select("2.7", None, "train")
    assert train.name == "2.7.1-cuda12.1-train" and train.tags == ["2.7.1-cuda12.1-train", "v2.7-cuda12.1-train", "v2.7-train"]
    assert train.extras == (("ao", "torchao==0.12.0"),) and train.extras_pins == {"ao": "0.12.0"}
    (name, why), = train.extras_left_out
    assert name == "te" and "CUDA >=13.0, cuDNN >=9.12" in why and "CUDA 12.6, cuDNN 9.5.1.17" in why and "TE's docs" in why
    assert train.extras_built == ()  # TE is left out, so is its compile
    assert m.extras == ("te", "ao")
    assert m.select("2.7", None).extras == ()  # the runtime flavor has none


def test_train_needs_the_runtime_flavor_and_one_extra_that_works(tmp_path):
    lines = problems(tmp_path, train_matrix(tmp_path, flavors="[train]"))
    assert any("rows[0].flavors" in ln and "list runtime too" in ln for ln in lines), lines
    lines = problems(tmp_path, train_matrix(tmp_path, EXTRAS.replace('versions: {"2.7": 0.12.0}', 'versions: {"2.8": 0.13.0}')))
    assert any("no train extra can work on this row" in ln and "lists no release for torch 2.7" in ln for ln in lines), lines


@pytest.mark.parametrize("bad, says", [
    ("requirement: torchao>=0.12", "must pin one version with =="),
    ("requirement: torchao=={version}\n    versions: {}", "no versions are listed"),
    ('cudnn: "9.12"', "is not a version specifier"),
    ("build: flash-attn", "transformer-engine-torch"),
])
def test_a_bad_extra_is_named(tmp_path, bad, says):
    extra = f"train:\n  x:\n    purpose: p\n    source: s\n    {bad}\n"
    if "requirement" not in bad:
        extra += "    requirement: torchao==0.12.0\n"
    lines = problems(tmp_path, train_matrix(tmp_path, extra))
    assert any("train.x" in ln and says in ln for ln in lines), lines


def test_the_project_matrix_gives_the_2_11_row_every_extra_and_the_default_row_liger_and_torchao():
    assert [n for n, _ in TRAIN.extras] == ["transformer-engine", "flash-attn-4", "liger-kernel", "torchao"]
    assert TRAIN.extras_built == ("transformer-engine-torch",) and TRAIN.platforms == ("linux/amd64", "linux/arm64")
    assert DEFAULT_TRAIN.default and DEFAULT_TRAIN.extras_pins == {"liger-kernel": "0.8.5", "torchao": "0.11.0"}
    assert {n for n, _ in DEFAULT_TRAIN.extras_left_out} == {"transformer-engine", "flash-attn-4"}


# ---- lock -----------------------------------------------------------------------------------


def test_the_committed_train_locks_hold_the_runtime_files_byte_for_byte_and_move_no_runtime_pin():
    for image in (TRAIN, DEFAULT_TRAIN):
        assert lock.problems(ROOT, image) == []
        d, runtime = lock.image_dir(ROOT, image), lock.image_dir(ROOT, lock.runtime_of(image))
        for name in lock.LOCK_FILES:
            assert (d / name).read_bytes() == (runtime / name).read_bytes()
        meta = lock.read(ROOT, image)
        runtime_pins = resolve_pypi.pins((runtime / "requirements.lock").read_text())
        for platform in image.platforms:
            extras = meta["extras"][platform]
            assert not set(extras["pins"]) & set(runtime_pins)  # added packages only
            for name, version in image.extras_pins.items():
                assert extras["pins"].get(name) == version
            assert set(extras["built"]) == set(image.extras_built)
            text = (lock.build_dir(ROOT, image.on(platform)) / "extras.lock").read_text()
            assert all("--hash=sha256:" in block for block in text.split("\n\\\n") if "==" in block)


def test_an_edited_extras_lock_or_a_moved_runtime_lock_is_stale(tmp_path):
    root = project_copy(tmp_path / "p")
    d = lock.image_dir(root, TRAIN)
    (d / "extras.lock").write_text((d / "extras.lock").read_text() + "evil==1.0\n")
    assert any("extras files: one was edited" in p for p in lock.problems(root, TRAIN))
    root = project_copy(tmp_path / "q")
    runtime = lock.image_dir(root, lock.runtime_of(TRAIN)) / "requirements.lock"
    runtime.write_text(runtime.read_text().replace("DO NOT EDIT.", "DO NOT EDIT!", 1))
    assert any("runtime lock files are not 2.11.0-cuda13.0-runtime's" in p for p in lock.problems(root, TRAIN))


def test_extras_that_move_a_runtime_pin_or_lack_the_compiled_sdist_are_refused():
    runtime = "torch==2.11.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"
    moved = "torch==2.12.0 \\\n    --hash=sha256:" + "b" * 64 + "\nliger-kernel==0.8.5 \\\n    --hash=sha256:" + "c" * 64 + "\n"
    with pytest.raises(LockError, match="moved the runtime's torch 2.11.0 to 2.12.0"):
        lock.split_extras(TRAIN, moved, runtime, "linux/amd64")
    no_sdist = "liger-kernel==0.8.5 \\\n    --hash=sha256:" + "c" * 64 + "\n"
    with pytest.raises(LockError, match="without transformer-engine-torch"):
        lock.split_extras(TRAIN, no_sdist, runtime, "linux/amd64")
    added, built = lock.split_extras(TRAIN, runtime + no_sdist + "transformer-engine-torch==2.20.2 \\\n    --hash=sha256:"
                                     + "d" * 64 + "\n", runtime, "linux/amd64")
    assert resolve_pypi.pins(added) == {"liger-kernel": "0.8.5"} and resolve_pypi.pins(built) == {"transformer-engine-torch": "2.20.2"}


def test_a_train_lock_needs_a_current_runtime_lock_first(tmp_path):
    root = project_copy(tmp_path / "p")
    (lock.image_dir(root, lock.runtime_of(TRAIN)) / "lock.json").unlink()
    with pytest.raises(LockError, match="locked over 2.11.0-cuda13.0-runtime, whose lock is not current"):
        lock.committed_runtime(root, TRAIN)


def test_the_extras_resolve_with_every_runtime_pin_as_a_constraint(monkeypatch):
    seen = {}

    def fake_run_uv(image, requirements, what, exclude_newer, ca, *extra, platform):
        seen["requirements"], seen["extra"] = requirements, extra
        seen["constraints"] = Path(extra[extra.index("--constraint") + 1]).read_text()
        return ""

    monkeypatch.setattr(resolve_pypi, "_run_uv", fake_run_uv)
    runtime = (lock.image_dir(ROOT, TRAIN) / "requirements.lock").read_text()
    resolve_pypi.compile_extras(TRAIN, runtime, None)
    assert "transformer-engine[core-cu13,pytorch]==2.20.2" in seen["requirements"]
    assert "torch==2.11.0\n" in seen["constraints"] and "--hash" not in seen["constraints"]
    assert len(seen["constraints"].splitlines()) == len(resolve_pypi.pins(runtime))


# ---- render ---------------------------------------------------------------------------------


def test_the_train_dockerfile_shares_the_runtime_stages_and_adds_its_own_after_them():
    runtime = (lock.image_dir(ROOT, lock.runtime_of(TRAIN)) / "Dockerfile").read_text()
    train = (lock.image_dir(ROOT, TRAIN) / "Dockerfile").read_text()
    head = runtime.split("FROM python-env AS runtime")[0]
    assert "FROM python-env AS te-builder" in train and "FROM python-env AS train" in train
    before_train = train.split("FROM python-env AS train")[0]
    # every runtime instruction before the image stage is in the train Dockerfile too, in order
    steps = [s for s in head.split("\n\n") if s.startswith(("FROM", "RUN", "COPY", "ENV", "ARG"))]
    assert all(s in before_train for s in steps)
    layout = layers.plan(TRAIN, (lock.image_dir(ROOT, TRAIN) / "extras.lock").read_text(),
                         layers.extras_wheels_of(lock.read(ROOT, TRAIN), "linux/amd64"))
    assert "transformer-engine-cu13" in layout.names and len(layout.own) >= 3
    for own in layout.own:
        assert f"'{own.requirement}'" in train
    assert "COPY --from=te-builder /dist /te/" in train  # the seed's export
    assert "LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib" in train
    default_train = (lock.image_dir(ROOT, DEFAULT_TRAIN) / "Dockerfile").read_text()
    assert "te-builder" not in default_train and "LD_LIBRARY_PATH" not in default_train


def test_labels_and_manifest_name_the_extras_and_what_is_left_out():
    meta = lock.read(ROOT, DEFAULT_TRAIN)
    labels = dict(render.labels(DEFAULT_TRAIN, meta))
    assert labels["io.pytorch-cuda.extras"] == "liger-kernel==0.8.5,torchao==0.11.0"
    assert "transformer-engine: needs torch >=2.11" in labels["io.pytorch-cuda.extras-left-out"]
    manifest = json.loads((lock.image_dir(ROOT, TRAIN) / "manifest.json").read_text())
    assert manifest["extras"]["transformer-engine"] == "2.20.2" and manifest["extras_built"] == ["transformer-engine-torch"]
    assert "io.pytorch-cuda.extras" not in dict(render.labels(lock.runtime_of(TRAIN), meta))


def test_the_matrix_table_lists_each_train_image_and_why_an_extra_is_left_out():
    table = render.matrix_table(ROOT, M)
    assert "| train image | transformer-engine | flash-attn-4 | liger-kernel | torchao |" in table
    assert "| `2.11.0-cuda13.0-train` | 2.20.2 | 4.0.0b36 | 0.8.5 | 0.18.0 |" in table
    assert "| `2.7.1-cuda12.1-train` | left out: needs torch >=2.11,<2.15" in table


def test_the_vulnerability_check_covers_the_extras():
    pins = security.python_packages(ROOT, TRAIN)
    assert pins["transformer-engine-cu13"] == "2.20.2" and pins["transformer-engine-torch"] == "2.20.2"
    assert pins["torch"] == "2.11.0"


# ---- the TE seed ----------------------------------------------------------------------------


@pytest.fixture
def own_store(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")


def _export(ops_key="a" * 64, te_key="b" * 64, te=True):
    d = opsseed.export_dir()
    (d / "deepspeed-0.19.8-cp311-cp311-linux_x86_64.whl").write_bytes(b"ds")
    (d / "ops-facts.json").write_text("{}\n")
    (d / opsseed.KEY_FILE).write_text(ops_key + "\n")
    if te:
        (d / "te").mkdir()
        (d / "te" / "transformer_engine_torch-2.20.2-cp311-cp311-linux_x86_64.whl").write_bytes(b"te")
        (d / "te" / "te-facts.json").write_text("{}\n")
        (d / "te" / "te-cache-key").write_text(te_key + "\n")
    return d


def test_a_train_export_files_the_te_wheel_apart_and_a_no_cache_build_gets_both(own_store, tmp_path):
    runtime = lock.runtime_of(TRAIN)
    assert opsseed.save(_export(te=False), runtime) == "a" * 64
    assert opsseed.save(_export(), TRAIN) == "a" * 64
    assert sorted(p.name for p in (opsseed.store() / "wheels").iterdir()) == ["a" * 64]  # shared with the runtime
    assert not (opsseed.store() / "wheels" / ("a" * 64) / "te").exists()
    ctx = tmp_path / "ctx"
    (ctx / opsseed.CONTEXT_DIR).mkdir(parents=True)
    assert opsseed.stage(TRAIN, ctx, use=True) == "a" * 64
    staged = ctx / opsseed.CONTEXT_DIR / "te" / ("b" * 64) / "transformer_engine_torch-2.20.2-cp311-cp311-linux_x86_64.whl"
    assert staged.read_bytes() == b"te"
    assert opsseed.prune({runtime.name}) == (1, 2 + 3 + 65)  # the TE entry (wheel, facts, key) no image names any more
    assert opsseed.stage(TRAIN, tmp_path / "ctx2", use=True) is None  # no half seed: it compiles and exports again


def test_a_train_export_without_its_te_part_is_refused(own_store):
    with pytest.raises(BuildError, match="te/ has no te-cache-key"):
        opsseed.save(_export(te=False), TRAIN)


# ---- tebuild.py (in the image's builder stage) ---------------------------------------------

sys.path.insert(0, str(ROOT))
from pytorch_cuda_runtime import lockfile, tebuild  # noqa: E402


def test_the_te_sdist_is_the_locked_file_from_the_context_and_jobs_are_capped_by_memory():
    """The sdist tebuild compiles is the one file extras-build.lock pins, recorded with its address
    in lock.json and bind-mounted from the context's inputs/extras-build/ (the store): no step of
    te-builder downloads anything."""
    text = (lock.image_dir(ROOT, TRAIN) / "extras-build.lock").read_text()
    (pin,) = lockfile.pins(text)
    recorded = lock.read(ROOT, TRAIN)["extras"]["linux/amd64"]["sdists"]["transformer-engine-torch"]
    assert pin.version == "2.20.2" and recorded["sha256"] in pin.hashes and recorded["file"] == "transformer_engine_torch-2.20.2.tar.gz"
    docker = (lock.image_dir(ROOT, TRAIN) / "Dockerfile").read_text()
    te = docker[docker.index("AS te-builder"):docker.index("# ---- ops-builder")]
    assert "--mount=type=bind,source=inputs/extras-build,target=/sdists" in te and "tebuild.py build /sdists/" in te
    assert "download" not in te and "--index" not in te and "type=secret" not in te
    assert 1 <= tebuild.jobs()


def _so(tmp_path, name, link=()):
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 1; }\n")
    out = tmp_path / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *link], check=True)
    return out


def _wheel(tmp_path, so):
    whl = tmp_path / "transformer_engine_torch-2.20.2-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(so, f"transformer_engine/wheel_lib/{so.name}")
    return whl


def test_tebuild_refuses_an_extension_that_needs_the_driver(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    subprocess.run(["gcc", "-shared", "-o", str(stub / "libcuda.so"), "-x", "c", "/dev/null"], check=True)
    good = _so(tmp_path, "transformer_engine_torch.cpython-311-x86_64-linux-gnu.so")
    facts = tebuild.check_wheel(_wheel(tmp_path, good))
    assert facts["module"].endswith("transformer_engine_torch.cpython-311-x86_64-linux-gnu.so") and not any("libcuda" in n for n in facts["needed"])
    (tmp_path / "w").mkdir()
    bad = _so(tmp_path / "w", "transformer_engine_torch.cpython-311-x86_64-linux-gnu.so",
              ["-Wl,--no-as-needed", f"-L{stub}", "-lcuda"])
    with pytest.raises(SystemExit, match="needs the CUDA driver"):
        tebuild.check_wheel(_wheel(tmp_path / "w", bad))


# ---- gpu-bundle ----------------------------------------------------------------------------


def test_a_train_bundle_carries_liger_and_torchao_and_says_why_not_te_and_fa4(tmp_path):
    from pytorch_cuda_build.commands import gpubundle, lockpins

    manifest = gpubundle.bundle_manifest(lock.image_dir(ROOT, TRAIN) / "manifest.json", ["liger-kernel", "torchao"])
    assert manifest["extras"] == {"liger-kernel": "0.8.5", "torchao": "0.18.0"}
    assert set(manifest["extras_not_carried"]) == {"transformer-engine", "flash-attn-4"}
    assert "64 MiB" in manifest["extras_not_carried"]["transformer-engine"]
    pins = lockpins.closure(lockpins.parse_lock((lock.image_dir(ROOT, TRAIN) / "extras.lock").read_text()),
                            gpubundle.CARRIED_EXTRAS, gpubundle.EXCLUDED)
    assert {p.name for p in pins} == {"liger-kernel", "torchao"}  # triton and torch: the machine's own
    runtime = gpubundle.bundle_manifest(lock.image_dir(ROOT, lock.runtime_of(TRAIN)) / "manifest.json", [])
    assert "extras" not in runtime and "extras_not_carried" not in runtime


# ---- the smoke suite's extras step (pure parts) ---------------------------------------------


@pytest.mark.parametrize("raised, gpu, status", [
    (None, False, "PASS"),
    (RuntimeError("0 active drivers ([]). There should only be one."), False, "SKIPPED"),
    (RuntimeError("0 active drivers ([]). There should only be one."), True, "FAIL"),
    (ImportError("no module named triton"), False, "FAIL"),
])
def test_a_module_that_needs_tritons_driver_is_skipped_only_for_that_and_only_without_a_gpu(monkeypatch, raised, gpu, status):
    from pytorch_cuda_runtime.smoke import extras
    from pytorch_cuda_runtime.smoke.results import Recorder

    def fake_import(name):
        if raised:
            raise raised

    monkeypatch.setattr(extras.importlib, "import_module", fake_import)
    rec = Recorder(None, "cpu", 0)
    extras.import_needing_driver(rec, "liger_kernel.transformers", gpu)
    (record,) = rec.records
    assert record["check"] == "extras.import.liger_kernel.transformers" and record["status"] == status


def test_tebuild_refuses_a_wheel_built_for_another_machine(tmp_path, monkeypatch):
    """The TE cache mount serves every platform: a wheel of the wrong architecture must never pass."""
    good = _so(tmp_path, "transformer_engine_torch.cpython-311-x86_64-linux-gnu.so")
    monkeypatch.setattr(tebuild.platform, "machine", lambda: "aarch64")
    with pytest.raises(SystemExit, match="is built for Advanced Micro Devices X86-64, not this machine \\(AArch64\\)"):
        tebuild.check_wheel(_wheel(tmp_path, good))


def test_the_te_cache_key_differs_by_machine_and_by_sdist(tmp_path, monkeypatch):
    """One cache mount serves every platform; torch, Python and g++ report the same versions on both."""
    import types

    fake = types.SimpleNamespace(__version__="2.11.0+cu130", version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setitem(sys.modules, "torch", fake)
    sdist = tmp_path / "transformer_engine_torch-2.20.2.tar.gz"
    sdist.write_bytes(b"sources")
    here = tebuild.cache_key(sdist)
    assert tebuild.cache_key(sdist) == here  # the same inputs, the same key
    monkeypatch.setattr(tebuild.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(tebuild.sysconfig, "get_platform", lambda: "linux-aarch64")
    assert tebuild.cache_key(sdist) != here
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "torch", fake)
    sdist.write_bytes(b"other sources")
    assert tebuild.cache_key(sdist) != here
