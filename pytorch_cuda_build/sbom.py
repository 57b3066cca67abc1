"""SBOM of any local image: run pytorch_cuda_runtime/sbom.py (stdlib only) inside it."""
from __future__ import annotations

import json
from pathlib import Path

import docker
import docker.errors

from .errors import PipelineError, UsageError

SCRIPT = Path(__file__).resolve().parent.parent / "pytorch_cuda_runtime" / "sbom.py"


def generate(c: docker.DockerClient, ref: str) -> dict:
    try:
        c.images.get(ref)
    except docker.errors.ImageNotFound:
        raise UsageError(f"no image {ref} on this daemon") from None
    script = (
        "for p in /opt/venv/bin/python python3 python; do command -v $p >/dev/null 2>&1 && "
        "exec $p /sbom.py --subject \"$0\"; done; echo 'no python in this image' >&2; exit 3"
    )
    try:
        out = c.containers.run(
            ref, ["-c", script, ref], entrypoint="/bin/sh", remove=True, user="0",
            volumes={str(SCRIPT): {"bind": "/sbom.py", "mode": "ro"}}, network_disabled=True,
            environment={"PYTORCH_CUDA_NO_BANNER": "1"}, labels={"pytorch-cuda.test": "sbom"},
        )
    except docker.errors.ContainerError as e:
        raise PipelineError(f"sbom of {ref} failed: {e.stderr.decode(errors='replace').strip()[-200:] if e.stderr else e}") from None
    return json.loads(out)
