"""Stage 7: SBOM of any local image: run pytorch_cuda_runtime/sbom.py (stdlib only) inside it."""
from __future__ import annotations

import json
from pathlib import Path

import docker
import docker.errors

from ..errors import NotReady, PipelineError
from . import gate

FILE = "sbom.cdx.json"  # in the row's build-results: written by the build, attached by a push
SCRIPT = Path(__file__).resolve().parents[2] / "pytorch_cuda_runtime" / "sbom.py"


def generate(c: docker.DockerClient, ref: str) -> dict:
    try:
        c.images.get(ref)
    except docker.errors.ImageNotFound:
        raise NotReady(f"no image {ref} on this daemon", ref=ref) from None
    script = (
        "for p in /opt/venv/bin/python python3 python; do command -v $p >/dev/null 2>&1 && "
        "exec $p /sbom.py --subject \"$0\"; done; echo 'no python in this image' >&2; exit 3"
    )
    # A throwaway container: removed on every way out, a failed start included.
    with gate.throwaway_container(
        c, ref, ["-c", script, ref], "sbom", entrypoint="/bin/sh", user="0",
        volumes={str(SCRIPT): {"bind": "/sbom.py", "mode": "ro"}}, network_disabled=True,
        environment={"PYTORCH_CUDA_NO_BANNER": "1"},
    ) as container:
        code = container.wait(timeout=600)["StatusCode"]
        out, err = container.logs(stdout=True, stderr=False), container.logs(stdout=False, stderr=True)
    if code != 0:
        raise PipelineError(f"sbom of {ref} failed (exit {code}): {err.decode(errors='replace').strip()[-200:]}")
    return json.loads(out)


def text(doc: dict) -> str:
    """The SBOM as written to sbom.cdx.json: stable key order, so equal SBOMs are equal files."""
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"
