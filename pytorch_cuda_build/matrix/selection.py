"""The loaded matrix, and the row a command's --torch, --cuda and --flavor pick from it: its
messages name those flags, and `build.py list` for what exists."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ..errors import NoSuchRow
from .image import Image
from .schema import FLAVORS


@dataclass(frozen=True)
class Matrix:
    path: Path
    repository: str
    images: tuple[Image, ...]
    platforms: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # the train flavor's extras, in matrix.yaml's order

    def select(self, torch: str | None, cuda: str | None, flavor: str = "runtime") -> Image:
        """The one image a `--torch/--cuda/--flavor` selection names, or NoSuchRow listing what exists."""
        if torch is None:
            raise NoSuchRow("--torch is required (e.g. --torch 2.7); `build.py list` shows the matrix", name="--torch")
        if flavor not in FLAVORS:
            raise NoSuchRow(f"unknown --flavor {flavor!r}; allowed: {', '.join(FLAVORS)}", name="--flavor")
        same_torch = [i for i in self.images if torch in (i.torch, i.torch_minor)]
        if not same_torch:
            known = sorted({i.torch_minor for i in self.images}, key=Version)
            raise NoSuchRow(f"no row for torch {torch}; torch versions in {self.path.name}: {', '.join(known)}", name="--torch")
        hits = [i for i in same_torch if i.flavor == flavor and (cuda is None and i.default or i.cuda == cuda)]
        if cuda is None and not hits:
            hits = [i for i in same_torch if i.flavor == flavor]
            if len(hits) == 1:
                return hits[0]
            raise NoSuchRow(f"torch {torch} has no default row; pick --cuda from: {_choices(same_torch)}", name="--cuda")
        if not hits:
            raise NoSuchRow(f"no row for torch {torch} with CUDA {cuda} ({flavor}); rows for torch {torch}: {_choices(same_torch)}", name="--cuda")
        return hits[0]

    def by_name(self, name: str) -> Image:
        for image in self.images:
            if image.name == name:
                return image
        raise NoSuchRow(f"no image named {name!r} in {self.path.name}", name=name)


def _choices(images: list[Image]) -> str:
    return ", ".join(sorted({f"cuda {i.cuda} ({i.flavor}{', default' if i.default else ''})" for i in images}))
