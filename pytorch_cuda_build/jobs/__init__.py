"""`build.py job`: one row's image, pinned by digest, as a multi-node job for a scheduler.

    slurm       an sbatch script (slurm.py): one task per node, each running the image's
                launch contract, `pytorch-cuda-launch SCRIPT [ARGS]`, under Slurm's own OCI
                support (`srun --container`), pyxis/enroot or Apptainer;
    kubernetes  manifests (kubernetes.py): a Kubeflow TrainJob or PyTorchJob, a JobSet, or an
                Indexed Job with its headless Service.

The image reference always carries a digest: a tag can move between the submission and the
moment a node pulls, and every node of one job must run the same bytes. It comes from the
row's published record (build-results/<image>/published.json, written by `publish --push`)
or from --image REPO@sha256:... . Rendering is pure: the same Job gives the same text.

The user's code and data come in through --mount (mounts.py). Each task starts in one working
directory, so that relative paths in SCRIPT and ARGS resolve where SCRIPT does: --workdir, else
Slurm's submit directory or the first Kubernetes mount. SCRIPT and ARGS go as the user wrote them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadFile, BadValue, NotReady

LAUNCH = "pytorch-cuda-launch"
LAUNCH_PATH = "/usr/local/bin/pytorch-cuda-launch"  # srun's PATH replaces the image's inside containers
PREFLIGHT = "pytorch-cuda-preflight"  # --preflight: every node proves itself before training (pytorch_cuda_runtime/preflight)
PREFLIGHT_PATH = "/usr/local/bin/pytorch-cuda-preflight"
RUNTIMES = ("oci", "pyxis", "apptainer")  # Slurm's container runtimes (slurm.py)
KINDS = ("trainjob", "pytorchjob", "jobset", "indexed-job")  # the Kubernetes resources (kubernetes.py)
QOS = ("burstable", "guaranteed")  # a Kubernetes pod's QoS classes
DIGEST = r"sha256:[0-9a-f]{64}"
# REPO[:TAG]@sha256:<64 hex>; the tag, where given, is dropped: the digest decides.
REFERENCE = re.compile(rf"(?P<repo>[a-z0-9][a-z0-9._/:-]*?)(?::(?P<tag>\w[\w.-]{{0,127}}))?@(?P<digest>{DIGEST})")
NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # a DNS-1123 label: Kubernetes object and pod host names
NAME_MAX = 40  # so that pod names such as NAME-node-0-0-xxxxx stay within 63 characters
SIZE = re.compile(r"(?P<n>[1-9]\d*)(?P<unit>Mi|Gi|M|G)")
DURATION = re.compile(r"(?=\d)(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?|(?P<bare>\d+)")


@dataclass(frozen=True)
class ImageRef:
    repository: str  # HOST[:PORT]/PATH, as docker writes it
    digest: str  # sha256:<64 hex>

    def __str__(self) -> str:
        return f"{self.repository}@{self.digest}"

    def split(self) -> tuple[str | None, str]:
        """(registry host or None for Docker Hub, path): docker's rule, the first component is
        a host where it holds a dot or a port, or is localhost."""
        first, _, rest = self.repository.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            return first, rest
        return None, self.repository

    def pyxis(self) -> str:
        """pyxis/enroot's URI: `REGISTRY#IMAGE@sha256:...` (enroot import's docker:// syntax)."""
        host, path = self.split()
        return f"{host}#{path}@{self.digest}" if host else f"{path}@{self.digest}"


def parse_image(text: str, what: str = "--image") -> ImageRef:
    m = REFERENCE.fullmatch(text or "")
    if not m:
        hint = "" if "@sha256:" in (text or "") else " (a tag can move between submission and pull; pin the digest)"
        raise BadValue(f"{what} takes an image pinned by digest, REPO@sha256:<64 hex>, not {text!r}{hint}", name=what)
    return ImageRef(m["repo"], m["digest"])


def published(results: Path, row: str) -> ImageRef:
    """The row's reference from its published record, or NotReady saying how to get one."""
    record = results / "published.json"
    try:
        data = json.loads(record.read_text())
    except FileNotFoundError:
        raise NotReady(f"{row} has no published record ({record}): publish it first (publish --push), "
                         "or give --image REPO@sha256:...", ref=record) from None
    except (OSError, ValueError) as e:
        raise BadFile(f"cannot read {record}: {e}", path=record) from None
    return parse_image(f"{data.get('repository', '')}@{data.get('digest', '')}", f"{record}'s repository@digest")


def shm_mib(text: str) -> int:
    """A /dev/shm size, 16Gi or 512Mi (G and M read as Gi and Mi), in MiB."""
    m = SIZE.fullmatch(text)
    if not m:
        raise BadValue(f"--shm-size takes a size like 16Gi or 512Mi, not {text!r}", name="--shm-size")
    return int(m["n"]) * (1024 if m["unit"].startswith("G") else 1)


def quantity(mib: int) -> str:
    """MiB as a Kubernetes quantity, in Gi where it divides."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def default_name(torch: str) -> str:
    return "pytorch-cuda-" + torch.replace(".", "-")


def memory_mib(text: str) -> int:
    """--memory-per-node, 64Gi or 512Mi (G and M read as Gi and Mi, as --shm-size), in MiB."""
    m = SIZE.fullmatch(text)
    if not m:
        raise BadValue(f"--memory-per-node takes a size like 64Gi or 512Mi, not {text!r}", name="--memory-per-node")
    return int(m["n"]) * (1024 if m["unit"].startswith("G") else 1)


def deadline_seconds(text: str) -> int:
    """--deadline, 24h, 90m, 1h30m, 2d or seconds, in seconds (at least 1)."""
    m = DURATION.fullmatch(text)
    seconds = 0 if not m else int(m["bare"]) if m["bare"] else \
        sum(int(m[unit] or 0) * factor for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)))
    if seconds < 1:
        raise BadValue(f"--deadline takes a duration of at least 1s like 24h, 90m, 1h30m, 2d or seconds (3600), not {text!r}", name="--deadline")
    return seconds
