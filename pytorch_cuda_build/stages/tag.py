"""Stage 9: promote a tested image ID to its public tags, and remember that it passed.

Local tags move only here, only for an image ID whose tests passed: the row's own tag
first, the aliases after it. (The dated immutable tag exists only in registries: publish.)

A pass record (STATE_DIR/tested.json) says which image ID passed, on what (`cpu` or
`gpu`) and with which test code (a hash), so a CPU pass never stands in for a GPU run
and edited tests always run again:

    {"<image id>": [{"image": "<row name>", "mode": "cpu"|"gpu", "code": "<sha256>", "passed_at": <unix time>}, ...]}
"""
from __future__ import annotations

import json
import time

import docker
import docker.errors
from filelock import FileLock

from .. import paths
from ..files import write_atomic
from ..matrix import Image
from .gate import gpus_used

TESTED = paths.STATE_DIR / "tested.json"
MODES = ("cpu", "gpu")
KEEP_PER_ID = 8  # enough for a few test-code versions in both modes; the file stays small


def refs(image: Image) -> list[str]:
    """The tags a build of image.platform moves: the row's, and beside linux/amd64 also
    `<row>-<arch>`, which keeps naming that platform's image after the row's tags move on
    (a classic image store holds one platform per tag; publish finds each platform by it)."""
    own = [] if image.platform == "linux/amd64" else [f"{image.repository}:{image.local_name}"]
    return image.refs() + own


def own_ref(image: Image) -> str:
    """The tag that names image.platform's image: the row's own for linux/amd64, `<row>-<arch>` beside it."""
    return refs(image)[0 if image.platform == "linux/amd64" else -1]


def promote(c: docker.DockerClient, image: Image, image_id: str) -> list[str]:
    img = c.images.get(image_id)
    moved = refs(image)
    for ref in moved:
        repo, tag = ref.rsplit(":", 1)
        img.tag(repo, tag)
    return moved


def mode_of(report: dict) -> str:
    """`gpu` only when the smoke report says GPUs ran it; anything else is a CPU run."""
    return "gpu" if gpus_used(report) else "cpu"


def _valid(rec: object) -> bool:
    return (isinstance(rec, dict) and rec.get("mode") in MODES
            and isinstance(rec.get("code"), str) and bool(rec["code"]))


def _read() -> tuple[dict[str, list[dict]], bool]:
    """Every well-formed record by image ID, and whether the file (when present) was
    readable JSON of our shape. A damaged or old-format file, or entry, counts as no
    record: the worst that can cost is one more test run."""
    try:
        data = json.loads(TESTED.read_text())
    except FileNotFoundError:
        return {}, True
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}, False
    if not isinstance(data, dict):
        return {}, False
    return {k: [r for r in v if _valid(r)] for k, v in data.items() if isinstance(v, list)}, True


def record_pass(image: Image, image_id: str, report: dict, code: str) -> str:
    """Remember that this image ID passed in this mode with this test code; return the mode."""
    mode = mode_of(report)
    new = {"image": image.name, "mode": mode, "code": code, "passed_at": int(time.time())}
    TESTED.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TESTED) + ".lock"):
        data, intact = _read()
        if not intact:  # nothing in it is worth keeping, and write_atomic reads the old text as UTF-8
            TESTED.unlink(missing_ok=True)
        kept = [r for r in data.get(image_id, []) if (r["mode"], r["code"]) != (new["mode"], new["code"])]
        data[image_id] = (kept + [new])[-KEEP_PER_ID:]
        write_atomic(TESTED, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return mode


def passed(image_id: str, mode: str | None = None, code: str | None = None) -> dict | None:
    """The latest pass of image_id, limited to one mode and one test-code hash when given."""
    found = [r for r in _read()[0].get(image_id, [])
             if (mode is None or r["mode"] == mode) and (code is None or r["code"] == code)]
    return found[-1] if found else None


def reusable_pass(image_id: str, require_gpu: bool, code: str) -> dict | None:
    """A pass of this image ID with this test code, on a GPU when one is required."""
    return passed(image_id, "gpu" if require_gpu else None, code)


def needs_test(image_id: str, require_gpu: bool, code: str) -> bool:
    return reusable_pass(image_id, require_gpu, code) is None


def current(c: docker.DockerClient, image: Image) -> dict[str, str | None]:
    """Where each public tag of the image points now (None: absent)."""
    out: dict[str, str | None] = {}
    for ref in image.refs():
        try:
            out[ref] = c.images.get(ref).id
        except docker.errors.ImageNotFound:
            out[ref] = None
    return out
