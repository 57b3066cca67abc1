"""Pass records (tag.py): an image ID counts as tested only in the mode and with the test
code that really ran; a damaged record file is no record, never a traceback."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pytorch_cuda_build.stages import gate, tag

from helpers import ROOT

ID = "sha256:" + "a" * 64
ROW = SimpleNamespace(name="2.7.1-cuda12.1-runtime")
CPU, GPU = {"gpus": 0}, {"gpus": 2}


@pytest.fixture(autouse=True)
def tested(tmp_path, monkeypatch):
    """A record file of this test's own, whatever PYTORCH_CUDA_STATE was at import."""
    path = tmp_path / "state" / "tested.json"
    monkeypatch.setattr(tag, "TESTED", path)
    return path


def test_round_trip(tested):
    assert tag.passed(ID) is None
    assert tag.record_pass(ROW, ID, CPU, "h1") == "cpu"
    rec = tag.passed(ID)
    assert rec["mode"] == "cpu" and rec["code"] == "h1" and rec["image"] == ROW.name
    assert isinstance(rec["passed_at"], int)
    assert json.loads(tested.read_text()) == {ID: [rec]}


@pytest.mark.parametrize(("report", "mode"), [
    ({"gpus": 1}, "gpu"), ({"gpus": 8}, "gpu"), ({"gpus": 0}, "cpu"), ({}, "cpu"),
    ({"gpus": None}, "cpu"), ({"gpus": "2"}, "cpu"), ({"gpus": True}, "cpu"), ({"gpus": -1}, "cpu"),
])
def test_mode_is_gpu_only_when_the_report_counts_gpus(report, mode):
    assert tag.mode_of(report) == mode


def test_cpu_pass_does_not_satisfy_require_gpu():
    tag.record_pass(ROW, ID, CPU, "h1")
    assert not tag.needs_test(ID, require_gpu=False, code="h1")
    assert tag.needs_test(ID, require_gpu=True, code="h1")


def test_gpu_pass_satisfies_both():
    tag.record_pass(ROW, ID, GPU, "h1")
    assert not tag.needs_test(ID, require_gpu=False, code="h1")
    assert not tag.needs_test(ID, require_gpu=True, code="h1")
    assert tag.reusable_pass(ID, True, "h1")["mode"] == "gpu"


def test_changed_test_code_or_image_means_test_again():
    tag.record_pass(ROW, ID, GPU, "h1")
    assert tag.needs_test(ID, require_gpu=False, code="h2")
    assert tag.needs_test("sha256:" + "b" * 64, require_gpu=False, code="h1")


def test_both_modes_and_code_versions_are_kept_one_record_each():
    tag.record_pass(ROW, ID, CPU, "h1")
    tag.record_pass(ROW, ID, GPU, "h1")
    tag.record_pass(ROW, ID, CPU, "h2")
    tag.record_pass(ROW, ID, CPU, "h1")  # again: replaces, not duplicates
    recs = json.loads(tag.TESTED.read_text())[ID]
    assert sorted((r["mode"], r["code"]) for r in recs) == [("cpu", "h1"), ("cpu", "h2"), ("gpu", "h1")]
    assert tag.passed(ID, "gpu", "h1") and tag.passed(ID, "cpu", "h2")
    assert tag.passed(ID, "gpu", "h2") is None


def test_records_per_image_are_bounded():
    for n in range(tag.KEEP_PER_ID + 3):
        tag.record_pass(ROW, ID, CPU, f"h{n}")
    recs = json.loads(tag.TESTED.read_text())[ID]
    assert len(recs) == tag.KEEP_PER_ID and recs[-1]["code"] == f"h{tag.KEEP_PER_ID + 2}"


VALID = json.dumps({ID: [{"image": ROW.name, "mode": "gpu", "code": "h1", "passed_at": 1}]}, indent=2)
DAMAGED = {
    "empty": b"",
    "truncated": VALID[: len(VALID) // 2].encode(),
    "not json": b"tested: yes\n",
    "a list": b"[]",
    "null": b"null",
    "entry not a list": json.dumps({ID: "passed"}).encode(),
    "record not a dict": json.dumps({ID: [1, "x", None]}).encode(),
    "unknown mode": json.dumps({ID: [{"mode": "tpu", "code": "h1"}]}).encode(),
    "no code hash": json.dumps({ID: [{"mode": "gpu"}]}).encode(),
    "old format (no code hash)": json.dumps({ID: {"image": ROW.name, "passed_at": 1, "mode": "gpu"}}).encode(),
    "not utf-8": b"\xff\xfe\x00garbage",
    "deeply nested": b"[" * 100000,
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_file_is_no_record_and_is_replaced(tested, content):
    tested.parent.mkdir(parents=True)
    tested.write_bytes(content)
    assert tag.passed(ID) is None
    assert tag.needs_test(ID, require_gpu=False, code="h1")
    tag.record_pass(ROW, ID, GPU, "h1")
    assert not tag.needs_test(ID, require_gpu=True, code="h1")
    data = json.loads(tested.read_text())
    assert [(r["mode"], r["code"]) for r in data[ID]] == [("gpu", "h1")]


def test_other_images_records_survive_a_new_pass(tested):
    other = "sha256:" + "b" * 64
    tag.record_pass(ROW, other, CPU, "h1")
    tag.record_pass(ROW, ID, GPU, "h1")
    assert tag.passed(other, "cpu", "h1") and tag.passed(ID, "gpu", "h1")


# ---- the test-code hash ------------------------------------------------------------

def fake_tree(root, order=("a", "b")):
    """A project whose package and smoke suite both live under root (a checkout)."""
    files = {"pytorch_cuda_build/stages/gate.py": "gate", "pytorch_cuda_build/checks/conftest.py": "fixtures",
             "pytorch_cuda_runtime/smoke/cli.py": "smoke"}
    files.update({f"pytorch_cuda_build/checks/test_{n}.py": f"def test_{n}(): pass\n" for n in order})
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def code_hash(root):
    return gate.code_hash(root, package_home=root)


def test_code_hash_is_stable_and_independent_of_creation_order(tmp_path):
    a = fake_tree(tmp_path / "a", ("a", "b"))
    b = fake_tree(tmp_path / "b", ("b", "a"))
    assert code_hash(a) == code_hash(a) == code_hash(b)


@pytest.mark.parametrize("rel", ["pytorch_cuda_build/checks/test_a.py", "pytorch_cuda_build/checks/conftest.py",
                                 "pytorch_cuda_build/stages/gate.py", "pytorch_cuda_runtime/smoke/cli.py"])
def test_code_hash_changes_with_any_test_file(tmp_path, rel):
    root = fake_tree(tmp_path)
    before = code_hash(root)
    (root / rel).write_text((root / rel).read_text() + "# edited\n")
    assert code_hash(root) != before


def test_code_hash_sees_new_and_renamed_files_but_not_caches(tmp_path):
    root = fake_tree(tmp_path)
    checks = root / "pytorch_cuda_build/checks"
    before = code_hash(root)
    (checks / "__pycache__").mkdir()
    (checks / "__pycache__/test_a.cpython-312.pyc").write_bytes(b"\0compiled")
    assert code_hash(root) == before
    (checks / "test_a.py").rename(checks / "test_c.py")
    assert code_hash(root) != before
    (checks / "test_c.py").rename(checks / "test_a.py")
    (checks / "extra.txt").write_text("")
    assert code_hash(root) != before


def test_code_hash_reads_the_checks_from_the_package_not_the_project(tmp_path):
    """An installed tool: the package (gate and checks) in one place, the project (smoke suite) in another."""
    home = fake_tree(tmp_path / "site-packages")
    project = fake_tree(tmp_path / "project")
    before = gate.code_hash(project, package_home=home)
    (project / "pytorch_cuda_build/checks/test_a.py").write_text("a copy the gate never runs\n")
    assert gate.code_hash(project, package_home=home) == before
    (home / "pytorch_cuda_build/checks/test_a.py").write_text("the check the gate runs, edited\n")
    assert gate.code_hash(project, package_home=home) != before
    (project / "pytorch_cuda_runtime/smoke/cli.py").write_text("smoke, edited\n")
    assert gate.code_hash(project, package_home=home) != gate.code_hash(home, package_home=home)


def test_code_hash_of_this_project_covers_the_packaged_checks():
    assert len(gate.code_hash(ROOT)) == 64
    names = {rel for rel, _ in gate._test_files(ROOT)}
    assert {"pytorch_cuda_build/stages/gate.py", "pytorch_cuda_build/checks/conftest.py",
            "pytorch_cuda_build/checks/test_image.py", "pytorch_cuda_build/checks/test_devel.py"} <= names
    assert any(n.startswith("pytorch_cuda_runtime/smoke/") for n in names)
    assert not any(n.startswith("tests/") for n in names), "the gate runs nothing from the repository's tests/"
