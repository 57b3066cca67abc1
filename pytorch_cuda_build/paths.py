"""Where the build tool keeps machine-wide state: below every stage that uses it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

# Machine-wide state shared by every run: pass records (tag.TESTED), the ops seed, and the
# locks that keep two runs off one row. Read once, at import: a caller that wants its own (the
# test suite does, tests/conftest.py) sets PYTORCH_CUDA_STATE before importing the package.
# Empty means unset, never the current directory.
STATE_DIR = Path(os.environ.get("PYTORCH_CUDA_STATE") or Path.home() / ".cache" / "pytorch-cuda").expanduser()
# The content-addressed store of every locked file builds read (stages/fetch.py): in the state
# directory unless set apart, e.g. on a larger disk, or shared by several checkouts and state dirs.
STORE_DIR = Path(os.environ.get("PYTORCH_CUDA_STORE") or STATE_DIR / "store").expanduser()


def results_dir(root: Path, image: Row) -> Path:
    """What a build of a matrix Image leaves: build-results/<image>/, and build-results/<image>/linux-arm64/
    for that platform's build (every stage that writes there reads it from here)."""
    row = root / "build-results" / image.name
    return row if image.platform == "linux/amd64" else row / image.platform.replace("/", "-")

class Row(Protocol):
    """What results_dir reads of a matrix Image (the model sits above this module)."""

    @property
    def name(self) -> str: ...

    @property
    def platform(self) -> str: ...


# The checkout this package runs from (build.py's folder): its images/ hold the locks a stage reads
# when a caller names no other project root.
CHECKOUT = Path(__file__).resolve().parent.parent
RUNTIME_PACKAGE = "pytorch_cuda_runtime"  # the code baked into images, copied into build contexts and bundles
