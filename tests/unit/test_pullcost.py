"""The pull measure's arithmetic and its refresh, offline: what a node pulls is the blobs of the
new image it does not hold; a registry keeps each blob once; the refresh moves exactly one pin
and leaves a lock that `lock --check` accepts."""
from __future__ import annotations

import json

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import BadValue
from pytorch_cuda_build.stages import lock
from pytorch_cuda_build.tooling import pullcost

from helpers import ROOT, project_copy

MATRIX = matrix.load(ROOT / "matrix.yaml")


def man(config: str, *layers: tuple[str, int]) -> dict:
    return {"config": (config, 10), "layers": list(layers), "media_types": []}


def test_a_node_pulls_the_blobs_it_lacks_and_a_registry_keeps_each_once():
    base, cublas, torch_a, torch_b, tail_a, tail_b = ("base", 100), ("cublas", 400), ("ta", 500), ("tb", 510), ("ra", 40), ("rb", 41)
    a, b = man("ca", base, cublas, torch_a, tail_a), man("cb", base, cublas, torch_b, tail_b)
    assert pullcost.pulled(a, b) == 510 + 41 + 10 and pullcost.total(b) == 100 + 400 + 510 + 41 + 10
    assert pullcost.pulled(a, a) == 0
    assert pullcost.stored([a, b]) == 100 + 400 + 500 + 510 + 40 + 41 + 20
    refresh = man("cr", base, cublas, torch_a, ("rr", 42))
    f = pullcost.figures({"layered": {"r1": a, "r2": b, "r1-refresh": refresh}}, ["r1", "r2"], "certifi")["layered"]
    assert f["refresh"]["pulled"] == 42 + 10 and f["neighbours"] == [{"held": "r1", "next": "r2", "pulled": 561, "image": 1061}]
    assert f["registry"]["stored"] == pullcost.stored([a, b]) and f["registry"]["sum_of_images"] == 1050 + 1061 and f["layers"] == {"r1": 4, "r2": 4}


def test_the_cuda_13_rows_are_measured_oldest_first():
    names = [i.name for i in pullcost.rows(MATRIX)]
    assert names[0] == "2.11.0-cuda13.0-runtime" and names[-1] == "2.15.0-cuda13.2-runtime" and len(names) == 5
    assert [i.name for i in pullcost.rows(MATRIX, 2)] == names[:2]  # --pull-rows 2: the two oldest, neighbours
    for n in (1, 6):
        with pytest.raises(BadValue, match=f"--pull-rows takes 2 to 5 .*not {n}"):
            pullcost.rows(MATRIX, n)


def test_the_report_names_a_subset_of_rows_and_its_command():
    r = {"date": "d", "cpus": 2, "engine": "e", "rows": ["r1", "r2"], "of_rows": 5, "refreshed": "certifi", "refreshed_to": "1",
         "pull_s": {lay: {"gzip": 1.0, "zstd": 2.0} for lay in pullcost.LAYOUTS}, "build_s": {lay: {"r1": 1.0} for lay in pullcost.LAYOUTS}}
    a, b = man("ca", ("x", 100)), man("cb", ("x", 100), ("y", 10))
    r["figures"] = pullcost.figures({lay: {"r1": a, "r2": b, "r1-refresh": b} for lay in pullcost.LAYOUTS}, ["r1", "r2"], "certifi")
    text = pullcost.markdown(r)
    assert "`python3 build.py bench --full --only pull --pull-rows 2`" in text and "the first 2 of the matrix's 5 CUDA 13 rows" in text
    assert "registry bytes for these 2 CUDA 13 rows together" in text
    r["of_rows"] = 2
    assert "`python3 build.py bench --full --only pull`" in pullcost.markdown(r)
    assert text.startswith("Measured d (commit not recorded) on this machine")
    assert pullcost.markdown({**r, "commit": "abc1234"}).startswith("Measured d at commit abc1234 on this machine")


class FakeIndex:
    url = "https://index.example/simple/"

    def files(self, project):
        assert project == pullcost.REFRESHED
        return [("certifi-2026.9.1-py3-none-any.whl", "a" * 64, 150_000, "u1"),
                ("certifi-2026.10.1-py3-none-any.whl", "b" * 64, 151_000, "u2"),
                ("certifi-2026.10.1.tar.gz", "c" * 64, 1, "u3"),
                ("certifi-2026.10.18-py3-none-any.whl", "d" * 64, 152_000, "https://files.example/certifi-2026.10.18-py3-none-any.whl"),
                ("certifi-2026.10.19.post1-py3-none-any.whl", "f" * 64, 152_500, "u6"),
                ("certifi-2027.1.1-py3-none-any.whl", "e" * 64, 153_000, "u5")]


def test_the_refresh_moves_one_pin_to_its_previous_release_and_the_lock_stays_consistent(tmp_path):
    root = project_copy(tmp_path / "p")
    image = MATRIX.select("2.11", "13.0")
    before = lock.read(root, image)
    assert before["pins"]["certifi"] == "2026.10.19.post1", "the committed lock moved: pick the fake index's versions again"
    assert pullcost.refresh_lock(root, image, FakeIndex()) == "2026.10.18"
    after = lock.read(root, image)
    assert {k: v for k, v in after["pins"].items() if before["pins"][k] != v} == {"certifi": "2026.10.18"}
    assert after["wheels"]["certifi"] == {"file": "certifi-2026.10.18-py3-none-any.whl", "sha256": "d" * 64, "size": 152_000, "url": "https://files.example/certifi-2026.10.18-py3-none-any.whl"}
    req = (lock.image_dir(root, image) / "requirements.lock").read_text()
    assert "certifi==2026.10.18 \\\n    --hash=sha256:" + "d" * 64 + "\n" in req and "certifi==2026.10.19.post1" not in req
    assert lock.problems(root, image) == []


def test_the_one_layer_copy_renders_every_wheel_into_one_layer(tmp_path):
    copy = pullcost.layout_copy(ROOT, tmp_path / "one", "one layer", {}, print)
    text = (copy / "images" / "2.11.0-cuda13.0-runtime" / "Dockerfile").read_text()
    env = text[text.index("AS python-env"):text.index("# ---- ops-builder")]
    assert env.count("RUN ") == 1 and "--rest /opt/pytorch-cuda/requirements.lock" in env
    assert "layers: {own_layer_min_mb: null}" in (copy / "matrix.yaml").read_text()


def test_the_report_puts_both_layouts_side_by_side():
    a = man("ca", ("base", 100), ("env", 900))
    r = {"date": "d", "cpus": 2, "engine": "e", "rows": ["r1", "r2"], "refreshed": "certifi", "refreshed_to": "1",
         "build_s": {lay: {"r1": 1.0} for lay in pullcost.LAYOUTS}, "pull_s": {lay: {"gzip": 1.0, "zstd": 2.0} for lay in pullcost.LAYOUTS},
         "figures": pullcost.figures({lay: {"r1": a, "r2": a, "r1-refresh": a} for lay in pullcost.LAYOUTS}, ["r1", "r2"], "certifi")}
    text = pullcost.markdown(r)
    assert "| figure | one layer | layered | goal |" in text and "<= 3%" in text and "<= 35%" in text
    json.dumps(r)


def test_the_refresh_reads_which_python_env_steps_ran_from_a_rawjson_log(tmp_path):
    def status(**kw):
        return json.dumps(kw, indent=2) + "\n"
    ran, kept, other = ("sha256:" + c * 64 for c in "abc")
    log = tmp_path / "build.log"
    log.write_text("$ docker buildx build --load --progress=rawjson --file Dockerfile .\n" + status(vertexes=[
        {"digest": kept, "name": "[python-env 2/3] RUN python /tmp/wheellayer.py torch", "cached": True,
         "started": "2026-01-01T00:00:00Z", "completed": "2026-01-01T00:00:00Z"},
        {"digest": ran, "name": "[python-env 3/3] RUN python /tmp/wheellayer.py certifi", "started": "2026-01-01T00:00:00Z",
         "completed": "2026-01-01T00:00:09Z"},
        {"digest": other, "name": "[runtime 1/2] RUN pip check", "started": "2026-01-01T00:00:09Z", "completed": "2026-01-01T00:00:10Z"}]))
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM base AS python-env\nCOPY a /a\nRUN python /tmp/wheellayer.py torch\n"
                          "RUN python /tmp/wheellayer.py certifi\nFROM python-env AS runtime\nRUN pip check\n")
    assert pullcost.rebuilt(log, dockerfile) == {"python_env_steps": 3, "ran": ["RUN python /tmp/wheellayer.py certifi"]}
