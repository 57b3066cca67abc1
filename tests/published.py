"""The default row published once per session (conftest.default_published), and what the
modules that read it share: the publish CLI as the tests call it, and a registry's view of the
row's tags. The push of the 6.5 GB image is minutes of CI, so one push serves the publish tests
(test_publish.py) and the Slurm bundle made from the registry (test_slurm.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import publish as publishing

from helpers import ROOT, run_build_py, shown
from registry import LocalRegistry

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
RESULTS = ROOT / "build-results" / DEFAULT.name
FAST = {"PYTORCH_CUDA_RETRY_BACKOFF": "0.2"}
SIGNING = {"PYTORCH_CUDA_SIGN_PASSPHRASE": "publish test passphrase"}
NAMESPACE = "ml"


def publish(address: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_build_py(ROOT, "publish", "--torch", "2.7", "--cuda", "12.1", "--registry", address, *extra,
                        env={**FAST, **(env or {})}, timeout=1800)


def remote_state(reg: LocalRegistry, namespace: str, tags: list[str]) -> dict[str, str | None]:
    """tag -> config digest (the image ID it holds) in the registry, None if absent."""
    out = {}
    for name in tags:
        found = reg.manifest(f"{namespace}/{DEFAULT.repository}", name)
        out[name] = found[1]["config"]["digest"] if found else None
    return out


def all_tags(client, image_id: str) -> list[str]:
    """Every tag a publish of the row sets: the dated immutable one first, then the moving ones."""
    labels = client.images.get(image_id).labels
    return [publishing.dated_tag(DEFAULT, labels, DEFAULT.refs()[0]), *DEFAULT.tags]


def through_a_stop(reg: LocalRegistry, client, image_id: str, tmp: Path) -> types.SimpleNamespace:
    """The row published and signed to NAMESPACE the way a flaky registry makes one publish: the
    registry is stopped while the first run uploads layers, and a second run completes the job.
    What the stopped run left is kept for test_publish's fault scenario."""
    key, lookaside = tmp / "key", tmp / "lookaside"
    made = run_build_py(ROOT, "signing-key", str(key), env=SIGNING)
    assert made.returncode == 0, shown(made)
    sign = ["--sign-key", str(key), "--signatures", str(lookaside)]
    tags = all_tags(client, image_id)
    first = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "publish", "--torch", "2.7", "--cuda", "12.1",
                              "--registry", reg.address(NAMESPACE), "--push", "--retries", "2", *sign],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **FAST, **SIGNING})
    assert reg.wait_for_log(f"POST /v2/{NAMESPACE}/{DEFAULT.repository}/blobs/uploads/", timeout=300), reg.log.read_text()[-2000:]
    reg.stop()  # killed while layers upload
    out, err = first.communicate(timeout=900)
    reg.start()
    stopped = {"returncode": first.returncode, "stdout": out, "stderr": err, "remote": remote_state(reg, NAMESPACE, tags),
               "push_tags_left": [t for i in client.images.list(name=f"{reg.host}/{NAMESPACE}/{DEFAULT.repository}") for t in i.tags]}
    retry = publish(reg.address(NAMESPACE), "--push", *sign, env=SIGNING)
    assert retry.returncode == 0, shown(retry)
    record = json.loads((RESULTS / "published.json").read_text())
    assert record["image_id"] == image_id and record["tags"] == tags
    return types.SimpleNamespace(record=record, stopped=stopped, retry=retry, key=key, lookaside=lookaside, tags=tags)
