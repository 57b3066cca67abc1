"""docs/choosing.md's list of rows is the matrix's: each row's flavors, torch, wheel CUDA, driver
floor, the toolkit its ops are built with and what that toolkit compiles for, read from
matrix.yaml and the locks, never typed twice. Its flavor table names exactly matrix.FLAVORS."""
from __future__ import annotations

import re

from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import LockError
from pytorch_cuda_build.stages import lock

from helpers import ROOT

PAGE = ROOT / "docs" / "choosing.md"
START, END = "<!-- choosing-table:start (checked against matrix.yaml) -->", "<!-- choosing-table:end -->"
# The newest architecture a CUDA 12 toolkit's nvcc compiles (CUDA 12.4's is sm_90: docs/ops.md); a
# CUDA 13 row's toolkit is torch's own version, which compiles every arch torch lists.
NEWEST = {"12": "sm_90"}


def architectures(image: matrix.Image) -> str:
    newest = NEWEST.get(image.cuda_major)
    return f"torch's, up to {newest}, and {newest} PTX" if newest else "every one of torch's, and the newest one's PTX"


def expected_table(m: matrix.Matrix) -> str:
    rows: dict[tuple[str, str], list[matrix.Image]] = {}
    for image in m.images:
        rows.setdefault((image.torch, image.cuda), []).append(image)
    lines = ["| build it with | flavors | torch | wheel CUDA | driver >= | ops built with | ops' GPU architectures |",
             "|---|---|---|---|---|---|---|"]
    for (torch, cuda), images in rows.items():
        first = images[0]
        try:
            toolkit = f"CUDA {lock.read(ROOT, first).get('cuda_toolkit') or '?'}"
        except LockError:
            toolkit = "not locked"
        flavors = ", ".join(i.flavor for i in images)
        lines.append(f"| `--torch {first.torch_minor} --cuda {cuda}` | {flavors} | {torch} | {first.wheel_cuda} | "
                     f"{first.driver_min} | {toolkit} | {architectures(first)} |")
    return "\n".join(lines)


def page_table() -> str:
    text = PAGE.read_text()
    assert START in text and END in text, f"{PAGE.name} lacks its table's markers"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_the_rows_on_the_page_are_the_matrixs():
    m = matrix.load(ROOT / "matrix.yaml")
    assert page_table() == expected_table(m), (
        f"docs/choosing.md's table differs from matrix.yaml; it should read:\n{expected_table(m)}")


def test_the_flavor_table_names_every_flavor_and_no_other():
    section = PAGE.read_text().split("## The flavor", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert tuple(named) == matrix.FLAVORS


def test_a_change_in_the_matrix_fails_the_check(tmp_path):
    """A driver floor moved in matrix.yaml: the page no longer says what the matrix does."""
    text = (ROOT / "matrix.yaml").read_text()
    moved = text.replace('"12.1": {driver_min: "525.60.13"}', '"12.1": {driver_min: "530.30.02"}')
    assert moved != text
    (tmp_path / "matrix.yaml").write_text(moved)
    changed = expected_table(matrix.load(tmp_path / "matrix.yaml"))
    assert changed != page_table() and "| `--torch 2.7 --cuda 12.1` | runtime, devel, train | 2.7.1 | 12.6 | 530.30.02 |" in changed
