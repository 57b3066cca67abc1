"""`build.py matrix --json` and `--indexes`: the matrix as the GitHub workflow fans it out, one
build per row and OS platform (each on a runner of its platform, which the workflow picks:
.github/workflows/images.yml), and the rows whose platforms' images it merges into one index."""
from __future__ import annotations

from ..matrix import Matrix


def as_json(m: Matrix) -> dict:
    """The builds for a CI fan-out (GitHub Actions: strategy.matrix: ${{ fromJSON(...) }}): one
    entry per row and platform, each for a runner of that platform (built natively; the workflow names the runners)."""
    return {"include": [{
        "image": i.name, "torch": i.torch, "torch_minor": i.torch_minor, "cuda": i.cuda,
        "wheel_cuda": i.wheel_cuda, "flavor": i.flavor, "default": i.default,
        "tags": i.tags, "refs": i.refs(), "cudnn": i.cudnn, "nccl": i.nccl, "deepspeed": i.deepspeed,
        "build_args": f"--torch {i.torch} --cuda {i.cuda} --flavor {i.flavor}", "platforms": list(i.platforms),
        "platform": p, "arch": p.split("/")[1],
    } for i in m.images for p in i.platforms]}


def indexes_json(m: Matrix) -> dict:
    """The rows built on several platforms, whose per-platform images CI merges into one index."""
    return {"include": [{"image": i.name, "build_args": f"--torch {i.torch} --cuda {i.cuda} --flavor {i.flavor}",
                         "platforms": list(i.platforms)} for i in m.images if len(i.platforms) > 1]}
