"""matrix.yaml: parse -> validate -> complete, and every bad input named at once."""
from __future__ import annotations

from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import fanout
from pytorch_cuda_build.errors import BadFile, MatrixError, NoSuchRow

ROOT = Path(__file__).resolve().parents[2]

VALID = """\
repository: pytorch-cuda
defaults:
  {os: debian-bookworm, prebuilt_ops: [cpu_adam, fused_adam]}
oses:
  debian-bookworm: {kind: debootstrap, suite: bookworm, mirror: http://deb.debian.org/debian, python: "3.11"}
platforms:
  "12.1": {driver_min: "525.60.13"}
  "12.6": {driver_min: "525.60.13"}
rows:
  - torch: 2.7.1
    cuda: "12.1"
    wheel_cuda: "12.6"
    cudnn: 9.5.1.17
    nccl: 2.26.2
    deepspeed: 0.17.6
    default: true
    note: the 12.6 wheel runs on 12.1 drivers
  - torch: 2.7.1
    cuda: "12.6"
    wheel_cuda: "12.6"
    cudnn: 9.5.1.17
    nccl: 2.26.2
    deepspeed: 0.17.6
toolkits:
  "12": {source: debian, mirror: http://deb.debian.org/debian, suite: trixie, components: [non-free],
         packages: [nvidia-cuda-toolkit], version: 12.4.131~12.4.1-2}
"""


def load(tmp_path: Path, text: str) -> matrix.Matrix:
    p = tmp_path / "matrix.yaml"
    p.write_text(text)
    return matrix.load(p)


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(MatrixError) as e:
        load(tmp_path, text)
    return e.value.lines()


def test_valid_matrix_completes(tmp_path):
    m = load(tmp_path, VALID)
    assert [i.name for i in m.images] == ["2.7.1-cuda12.1-runtime", "2.7.1-cuda12.6-runtime"]
    default = m.images[0]
    assert default.refs() == ["pytorch-cuda:2.7.1-cuda12.1-runtime", "pytorch-cuda:v2.7-cuda12.1", "pytorch-cuda:v2.7"]
    assert default.require_cuda == "cuda>=12.1" and default.driver_min == "525.60.13"
    assert m.images[0].lock_key == m.images[1].lock_key  # same torch lock: shared layers


def test_project_matrix_is_valid_and_has_the_required_rows():
    m = matrix.load(ROOT / "matrix.yaml")
    minors = {i.torch_minor for i in m.images}
    assert {f"2.{n}" for n in range(4, 16)} <= minors
    default = m.select("2.7", None)
    assert (default.cuda, default.wheel_cuda, default.default) == ("12.1", "12.6", True)
    assert m.select("2.7", "12.6").wheel_cuda == "12.6"


def test_selection_errors_list_what_exists(tmp_path):
    m = load(tmp_path, VALID)
    with pytest.raises(NoSuchRow, match=r"rows for torch 2.7: cuda 12.1 \(runtime, default\), cuda 12.6"):
        m.select("2.7", "12.4")
    with pytest.raises(NoSuchRow, match="no row for torch 3.1; torch versions in matrix.yaml: 2.7"):
        m.select("3.1", None)
    with pytest.raises(NoSuchRow, match="unknown --flavor 'slim'"):
        m.select("2.7", "12.1", "slim")
    assert m.select("2.7.1", None).cuda == "12.1"


def test_malformed_yaml_names_the_line(tmp_path):
    (line,) = problems(tmp_path, VALID.replace("rows:\n", "rows: [\n"))
    assert "malformed YAML" in line and "line " in line


def test_unknown_key_and_missing_field_with_lines(tmp_path):
    text = VALID.replace("    default: true\n", "    default: true\n    cudnnn: 9\n")
    text = text.replace("  - torch: 2.7.1\n    cuda: \"12.6\"\n    wheel_cuda: \"12.6\"\n    cudnn: 9.5.1.17\n", "  - torch: 2.7.1\n    cuda: \"12.6\"\n    wheel_cuda: \"12.6\"\n")
    lines = problems(tmp_path, text)
    assert any("rows[0].cudnnn: unknown key" in ln and "line 17" in ln for ln in lines), lines
    assert any("rows[1].cudnn: Field required" in ln and "line 19" in ln for ln in lines), lines


def test_invalid_versions_all_reported(tmp_path):
    text = VALID.replace("torch: 2.7.1\n    cuda: \"12.1\"", "torch: two\n    cuda: \"12\"").replace("nccl: 2.26.2", "nccl: latest", 1)
    lines = problems(tmp_path, text)
    assert len(lines) == 3, lines
    assert any("'two' is not a valid full version" in ln for ln in lines)
    assert any("'12' is not a valid CUDA version" in ln for ln in lines)
    assert any("'latest' is not a valid version" in ln for ln in lines)


def test_duplicate_rows_and_two_defaults(tmp_path):
    text = VALID.replace('cuda: "12.6"\n    wheel_cuda: "12.6"', 'cuda: "12.1"\n    wheel_cuda: "12.6"\n    note: again\n    default: true')
    lines = problems(tmp_path, text)
    assert any("duplicate row torch 2.7.1 cuda 12.1" in ln for ln in lines), lines
    assert any("second default for torch 2.7" in ln for ln in lines), lines


def test_duplicate_yaml_key(tmp_path):
    (line,) = problems(tmp_path, VALID.replace("repository: pytorch-cuda\n", "repository: a\nrepository: b\n"))
    assert "duplicate key 'repository'" in line and "line 2" in line


def test_wheel_major_must_match_platform_major(tmp_path):
    lines = problems(tmp_path, VALID.replace('wheel_cuda: "12.6"', 'wheel_cuda: "11.8"', 1))
    assert any("differ in major version" in ln for ln in lines), lines


def test_substituted_wheel_needs_a_note(tmp_path):
    lines = problems(tmp_path, VALID.replace("    note: the 12.6 wheel runs on 12.1 drivers\n", ""))
    assert any("say why in a note" in ln for ln in lines), lines


def test_unknown_platform_and_os(tmp_path):
    lines = problems(tmp_path, VALID.replace('    cuda: "12.6"\n', '    cuda: "12.9"\n    os: ubuntu\n'))
    assert any("unknown CUDA platform 12.9" in ln for ln in lines), lines
    assert any("unknown OS 'ubuntu'" in ln for ln in lines), lines


def test_registry_base_must_be_digest_pinned(tmp_path):
    text = VALID.replace("  debian-bookworm: {kind: debootstrap", "  slim: {kind: registry, image: 'debian:bookworm-slim', python: '3.11'}\n  debian-bookworm: {kind: debootstrap")
    lines = problems(tmp_path, text)
    assert any("must be pinned by digest" in ln for ln in lines), lines


def test_not_a_mapping_and_missing_file(tmp_path):
    assert "expected a mapping" in problems(tmp_path, "- just\n- a list\n")[0]
    with pytest.raises(BadFile, match="cannot read matrix file"):
        matrix.load(tmp_path / "absent.yaml")


def test_devel_flavor_gets_its_own_name_and_tags(tmp_path):
    m = load(tmp_path, VALID.replace("    default: true\n", "    default: true\n    flavors: [runtime, devel]\n"))
    devel = m.select("2.7", None, "devel")
    assert devel.name == "2.7.1-cuda12.1-devel"
    assert devel.tags == ["2.7.1-cuda12.1-devel", "v2.7-cuda12.1-devel", "v2.7-devel"]
    assert devel.lock_key == m.select("2.7", None).lock_key  # same wheels: shared layers


def test_unknown_flavor_is_named(tmp_path):
    lines = problems(tmp_path, VALID.replace("    default: true\n", "    default: true\n    flavors: [runtime, slim]\n"))
    assert any("rows[0].flavors[1]" in ln and "'devel'" in ln for ln in lines), lines


def test_every_cuda_major_needs_a_toolkit(tmp_path):
    lines = problems(tmp_path, VALID.replace('"12": {source: debian', '"13": {source: debian'))
    assert any("no CUDA toolkit for CUDA 12.x" in ln for ln in lines), lines


def test_a_toolkit_says_where_it_comes_from(tmp_path):
    lines = problems(tmp_path, VALID.replace("packages: [nvidia-cuda-toolkit], version: 12.4.131~12.4.1-2", "packages: []"))
    assert any("a debian toolkit needs packages, version" in ln for ln in lines), lines
    lines = problems(tmp_path, VALID.replace("version: 12.4.131~12.4.1-2", "version: latest"))
    assert any("not a Debian CUDA toolkit version" in ln for ln in lines), lines


def test_prebuilt_ops_come_from_the_matrix_only(tmp_path):
    """No built-in list to fall back on: a matrix that names no ops is refused, and the ops it names are used."""
    lines = problems(tmp_path, VALID.replace(", prebuilt_ops: [cpu_adam, fused_adam]", ""))
    assert any("defaults.prebuilt_ops: Field required" in ln for ln in lines), lines
    lines = problems(tmp_path, VALID.replace("[cpu_adam, fused_adam]", "[]"))
    assert any("defaults.prebuilt_ops" in ln for ln in lines), lines
    assert {i.prebuilt_ops for i in load(tmp_path, VALID).images} == {("cpu_adam", "fused_adam")}


def test_versions_are_final_releases_written_as_pep_440_writes_them(tmp_path):
    text = VALID.replace("torch: 2.7.1\n    cuda: \"12.1\"", "torch: 2.7.1rc1\n    cuda: \"12.1\"").replace("deepspeed: 0.17.6", "deepspeed: v0.17.6", 1)
    lines = problems(tmp_path, text)
    assert any("'2.7.1rc1' is not a valid full version (X.Y.Z)" in ln for ln in lines), lines
    assert any("'v0.17.6' is not a valid full version (X.Y.Z)" in ln for ln in lines), lines
    # NVIDIA writes drivers with leading zeros; a torch local version (+cu128) is allowed.
    m = load(tmp_path, VALID.replace('driver_min: "525.60.13"}', 'driver_min: "450.80.02"}', 1).replace("torch: 2.7.1\n    cuda: \"12.6\"", "torch: 2.7.1+cu126\n    cuda: \"12.6\""))
    assert m.images[0].driver_min == "450.80.02" and m.images[1].torch_minor == "2.7"


def test_os_platforms_default_to_amd64_and_a_row_may_add_arm64(tmp_path):
    m = load(tmp_path, VALID.replace("    default: true\n", "    default: true\n    platforms: [linux/arm64, linux/amd64]\n"))
    assert [i.platforms for i in m.images] == [("linux/amd64", "linux/arm64"), ("linux/amd64",)]  # amd64 first
    assert fanout.as_json(m)["include"][0]["platforms"] == ["linux/amd64", "linux/arm64"]


def test_bad_os_platforms_are_named(tmp_path):
    lines = problems(tmp_path, VALID.replace("    default: true\n", "    default: true\n    platforms: [linux/s390x]\n"))
    assert len(lines) == 1 and "rows[0].platforms[0]" in lines[0] and "'linux/arm64'" in lines[0], lines
    lines = problems(tmp_path, VALID.replace("    default: true\n", "    default: true\n    platforms: [linux/arm64, linux/arm64]\n"))
    assert any("rows[0].platforms" in ln and "listed twice" in ln for ln in lines), lines
    assert any("rows[0].platforms" in ln and "linux/amd64 is missing" in ln for ln in lines), lines
    lines = problems(tmp_path, VALID.replace("    default: true\n", "    default: true\n    platforms: []\n"))
    assert any("rows[0].platforms" in ln and "linux/amd64 is missing" in ln for ln in lines), lines
