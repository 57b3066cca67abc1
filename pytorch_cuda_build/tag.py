"""Stage 7: promote a tested image ID to its public tags, and remember that it passed.

Tags move only here, only for an image ID whose tests passed; the immutable tag moves
first and the aliases after it.
"""
from __future__ import annotations

import json
import time

import docker
import docker.errors
from filelock import FileLock

from .base import STATE_DIR
from .files import write_atomic
from .matrix import Image

TESTED = STATE_DIR / "tested.json"


def promote(c: docker.DockerClient, image: Image, image_id: str) -> list[str]:
    img = c.images.get(image_id)
    refs = image.refs()
    for ref in refs:
        repo, tag = ref.rsplit(":", 1)
        img.tag(repo, tag)
    return refs


def record_pass(image: Image, image_id: str, report: dict) -> None:
    """Remember that this exact image ID passed, so an unchanged rebuild need not re-test."""
    TESTED.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TESTED) + ".lock"):
        data = json.loads(TESTED.read_text()) if TESTED.exists() else {}
        data[image_id] = {"image": image.name, "passed_at": int(time.time()), "mode": "gpu" if report.get("gpus") else "cpu"}
        write_atomic(TESTED, json.dumps(data, indent=2, sort_keys=True) + "\n")


def passed(image_id: str) -> dict | None:
    try:
        return json.loads(TESTED.read_text()).get(image_id)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def current(c: docker.DockerClient, image: Image) -> dict[str, str | None]:
    """Where each public tag of the image points now (None: absent)."""
    out: dict[str, str | None] = {}
    for ref in image.refs():
        try:
            out[ref] = c.images.get(ref).id
        except docker.errors.ImageNotFound:
            out[ref] = None
    return out
