"""The model every layer reads: matrix.yaml, the single source of truth, loaded in three steps.

parse (YAML, with line numbers) -> validate (schema, every problem at once) ->
complete (one `Image` per row and flavor, with its name, tags and platform facts).
Everything downstream (locks, Dockerfiles, tags, labels, README table, CI fan-out)
derives from the `Image` objects made here. It sits below the stages and their helpers, which
import it; it imports only errors.

One idea per module: schema.py (what each key may hold), image.py (an Image: its name, tags and
platforms), selection.py (the Matrix, and the row a command's flags pick), loader.py (parse,
validate, complete). Their names are the package's: `from .matrix import Image` reads. The CI
fan-out (`matrix --json`) is commands/fanout.py's.
"""
from __future__ import annotations

from .image import Image
from .loader import load, parse
from .schema import (
    BUILT_EXTRAS,
    DEFAULT_OS_PLATFORMS,
    FLAVORS,
    OS_PLATFORMS,
    REPRODUCIBLE_EPOCH,
    AptSource,
    Defaults,
    Extra,
    Flavor,
    Layers,
    MatrixFile,
    OSBase,
    OsPlatform,
    Platform,
    Row,
    Toolkit,
    major_of,
    minor_of,
    snapshot_time,
)
from .selection import Matrix

__all__ = ["BUILT_EXTRAS", "DEFAULT_OS_PLATFORMS", "FLAVORS", "OS_PLATFORMS", "REPRODUCIBLE_EPOCH", "AptSource", "Defaults",
           "Extra", "Flavor", "Image", "Layers", "Matrix", "MatrixFile", "OSBase", "OsPlatform", "Platform", "Row", "Toolkit",
           "load", "major_of", "minor_of", "parse", "snapshot_time"]
