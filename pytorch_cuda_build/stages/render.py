"""Stage 2: render images/<image>/Dockerfile and manifest.json, offline and deterministic.

Inputs are committed files only (matrix.yaml, the locks, templates/, Dockerfile.base),
so `render --check` in CI catches any drift between them and the committed output.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import jinja2

from ..buildkit import layers
from ..errors import LockError, RenderError
from ..files import sha256_text, write_all_atomic
from ..matrix import REPRODUCIBLE_EPOCH, Image, Matrix, minor_of, snapshot_time
from . import lock, security

LABEL_PREFIX = "io.pytorch-cuda"
LOCK_LABEL = f"{LABEL_PREFIX}.lock-sha256"  # the hash of the row's lock files
OPS_CACHE_ID = "pytorch-cuda-ops"
TE_CACHE_ID = "pytorch-cuda-te"  # Transformer Engine's compiled extension (tebuild.py), as the ops cache
# What DeepSpeed's CPU accelerator compiles for ZeRO (its comm op, CPUAdam for offload, its
# FusedAdam for the default Adam config): builder class -> extension name.
CPU_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam", "FusedAdamBuilder": "fused_adam"}
SBOM_PATH = "/opt/pytorch-cuda/sbom.cdx.json"  # CycloneDX, baked into every image
_BASE_ARG = re.compile(r"^ARG BASE_IMAGE=\S+$", re.M)
_APT_ARG = re.compile(r'^ARG APT_PACKAGES="[^"]*"$', re.M)
_SOURCES_ARG = re.compile(r'^ARG APT_SOURCES="[^"]*"$', re.M)


# How a local base is made (stages/base.py: mmdebstrap's tarball as the one layer of an image
# whose config is fixed bytes). Part of the base's name, so a base made another way (an older
# debootstrap import, on a machine that still has one) is never taken for it.
ROOTFS_ROUTE = "mmdebstrap-archive-1"


def rootfs_ref(image: Image) -> str:
    """The local image a built base is loaded as; named by its recipe and route, and by its
    architecture beside linux/amd64 (a classic image store keeps one platform per name)."""
    recipe = lock.base_identity(image)
    arch = "" if image.platform == "linux/amd64" else f"-{image.arch}"
    return f"{image.repository}-rootfs:{image.os.suite}-{sha256_text(recipe['recipe_sha256'], ROOTFS_ROUTE)[:12]}{arch}"


def base_ref(image: Image) -> str:
    return image.os.image if image.os.kind == "registry" and image.os.image else rootfs_ref(image)


def apt_pinned(names: tuple[str, ...], pins: dict[str, str]) -> list[str]:
    """`name=version` for every package the lock pinned, the bare name otherwise; in matrix.yaml's order."""
    return [f"{n}={pins[n]}" if n in pins else n for n in names]


def apt_list(names: tuple[str, ...], pins: dict[str, str]) -> str:
    return " ".join(apt_pinned(names, pins))


def apt_arg_value(names: tuple[str, ...], pins: dict[str, str]) -> str:
    """The list one package a line, for `ARG APT_PACKAGES="..."`. Docker joins continuation lines
    keeping their indent, so these start at column 0: the value, and with it the cache key of
    the apt layer that reads it, stays that of the one-line list (`apt_list`)."""
    return "\\\n" + " \\\n".join(apt_pinned(names, pins))


def apt_sources(image: Image) -> str:
    """The OS's update suites as sources.list lines, `;`-separated (one ARG holds them).

    A dated snapshot's security Release expired a week after its date (Valid-Until); apt
    refuses it unless told, per source, that the date is the point."""
    return ";".join(f"deb {'[check-valid-until=no] ' if snapshot_time(u.mirror) else ''}{u.mirror} {u.suite} main"
                    for u in image.os.updates)


def base_stage(root: Path, image: Image, lock_meta: dict) -> str:
    # Through Jinja only to drop its {# #} editor notes; the pins are put in below.
    text = _env(root).from_string((root / "Dockerfile.base").read_text()).render(reproducible_epoch=REPRODUCIBLE_EPOCH)
    if len(_BASE_ARG.findall(text)) != 1 or len(_APT_ARG.findall(text)) != 1 or len(_SOURCES_ARG.findall(text)) != 1:
        raise RenderError('Dockerfile.base must have exactly one `ARG BASE_IMAGE=<default>`, one `ARG APT_PACKAGES="..."` '
                          'and one `ARG APT_SOURCES="..."` line')
    text = _BASE_ARG.sub(f"ARG BASE_IMAGE={base_ref(image)}", text)
    text = _SOURCES_ARG.sub(f'ARG APT_SOURCES="{apt_sources(image)}"', text)
    packages = apt_arg_value(image.os.packages, lock_meta.get("apt", {}))
    text = _APT_ARG.sub(lambda _: f'ARG APT_PACKAGES="{packages}"', text)  # a function: re would read the backslashes
    return text.rstrip("\n")


def labels(image: Image, lock_meta: dict) -> list[tuple[str, str]]:
    """Static OCI labels: every pin of the row. Revision and created come at build time."""
    p = LABEL_PREFIX
    return [
        ("org.opencontainers.image.title", image.repository),
        ("org.opencontainers.image.version", image.name),
        ("org.opencontainers.image.description", f"PyTorch {image.torch} for CUDA {image.cuda} with DeepSpeed {image.deepspeed}"),
        ("org.opencontainers.image.base.name", base_ref(image)),
        (f"{p}.image", image.name),
        (f"{p}.flavor", image.flavor),
        (f"{p}.torch", image.torch),
        (f"{p}.cuda-platform", image.cuda),
        (f"{p}.torch-cuda", image.wheel_cuda),
        (f"{p}.cudnn", image.cudnn),
        (f"{p}.nccl", image.nccl),
        (f"{p}.deepspeed", image.deepspeed),
        (f"{p}.python", image.python),
        (f"{p}.os", image.os_name),
        (f"{p}.driver-min", image.driver_min),
        (f"{p}.cpu-arch", image.cpu_arch),
        (f"{p}.cuda-toolkit", toolkit_text(image, lock_meta)),
        (f"{p}.deepspeed-ops", ",".join(image.prebuilt_ops)),
        (LOCK_LABEL, lock_meta["files_sha256"]),
        *([(f"{p}.extras", ",".join(f"{n}=={v}" for n, v in image.extras_pins.items())),
           (f"{p}.extras-left-out", "; ".join(f"{n}: {why}" for n, why in image.extras_left_out) or "none")]
          if image.flavor == "train" else []),
        (f"{p}.sbom", SBOM_PATH),
    ]


def torch_ext_folder(image: Image) -> str:
    """The folder torch's default extensions root gets for this Python and torch CUDA (py311_cu126)."""
    return f"py{image.python.replace('.', '')}_cu{image.wheel_cuda.replace('.', '')}"


def toolkit_text(image: Image, lock_meta: dict) -> str:
    """The compiler the ops were built with, and how it relates to torch's CUDA: said openly."""
    version = lock_meta.get("cuda_toolkit") or "?"
    same = version != "?" and minor_of(version) == image.wheel_cuda
    source = "PyPI" if image.toolkit and image.toolkit.source == "pypi" else f"Debian {image.toolkit.suite if image.toolkit else '?'}"
    return f"{version} ({source}{'' if same else f'; torch is built with CUDA {image.wheel_cuda}'})"


def manifest(image: Image, lock_meta: dict) -> dict:
    """What the banner and the smoke suite compare the installed libraries against."""
    return {
        "repository": image.repository,
        "image": image.name,
        "flavor": image.flavor,
        "torch": image.torch,
        "cuda_platform": image.cuda,
        "torch_cuda": image.wheel_cuda,
        "cudnn": image.cudnn,
        "nccl": image.nccl,
        "python": image.python,
        "deepspeed": image.deepspeed,
        "os": image.os_name,
        "driver_min": image.driver_min,
        "lock_sha256": lock_meta["files_sha256"],
        "prebuilt_ops": list(image.prebuilt_ops),
        "ops_accelerator": "cuda",
        "cuda_toolkit": lock_meta.get("cuda_toolkit"),
        "cuda_toolkit_source": image.toolkit.source if image.toolkit else None,
        "tags": image.tags,
        **({"extras": image.extras_pins, "extras_built": list(image.extras_built),
            "extras_left_out": dict(image.extras_left_out)} if image.flavor == "train" else {}),
    }


def _env(root: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
    )
    return env


def render_image(root: Path, image: Image) -> dict[str, str]:
    """The row's rendered files by path under images/<image>/: its Dockerfile and manifest.json,
    and for each platform beside linux/amd64 that platform's Dockerfile (linux-arm64/Dockerfile:
    its base, CPU baseline and lock files differ; the stages are the same templates)."""
    meta = lock.read(root, image)
    out = {"Dockerfile": dockerfile(root, image, meta), "manifest.json": json.dumps(manifest(image, meta), indent=2) + "\n"}
    for platform in lock.extra_platforms(image):
        out[f"{lock.platform_subdir(platform)}/Dockerfile"] = dockerfile(root, image.on(platform), meta)
    return out


def dockerfile(root: Path, image: Image, meta: dict) -> str:
    """One platform's Dockerfile (image.platform)."""
    layout = layers.plan(image, (lock.build_dir(root, image) / "requirements.lock").read_text(), layers.wheels_of(meta, image.platform))
    extras_layout = None
    if image.flavor == "train":
        extras_layout = layers.plan(image, (lock.build_dir(root, image) / "extras.lock").read_text(),
                                    layers.extras_wheels_of(meta, image.platform))
    try:
        text = _env(root).get_template("Dockerfile.j2").render(
            image=image, layout=layout, extras_layout=extras_layout, te_cache_id=TE_CACHE_ID, base_stage=base_stage(root, image, meta), labels=labels(image, meta),
            build_packages=apt_list(image.os.build_packages, meta.get("apt", {})), ops_cache_id=OPS_CACHE_ID,
            cpu_builders=list(CPU_OPS), cpu_ops=list(CPU_OPS.values()), torch_ext_folder=torch_ext_folder(image),
            toolkit_version=meta.get("cuda_toolkit") or "unknown", reproducible_epoch=REPRODUCIBLE_EPOCH,
        )
    except jinja2.TemplateError as e:
        raise RenderError(f"templates/: {e}") from None
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


README_START, README_END = "<!-- matrix-table:start (build.py render) -->", "<!-- matrix-table:end -->"
TABLE_FILES = ("README.md", "docs/matrix.md")  # where the one table goes, between those markers


def matrix_table(root: Path, matrix: Matrix) -> str:
    """The matrix table of the README and the docs, derived from matrix.yaml (never a second table).
    Its last column is the last recorded `lock --check-security --record` (images/<image>/security.json)."""
    rows = ["| image | torch | CUDA platform | wheel CUDA | cuDNN | NCCL | DeepSpeed | ops built with | Python | driver >= | aliases "
            "| locked for | known vulnerabilities (last check) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i in matrix.images:
        aliases = ", ".join(f"`{t}`" for t in i.tags[1:])
        try:
            toolkit = toolkit_text(i, lock.read(root, i))
        except LockError:
            toolkit = "not locked"
        arches = ", ".join(p.split("/")[1] for p in i.platforms)
        rows.append(f"| `{i.name}` | {i.torch} | {i.cuda} | {i.wheel_cuda} | {i.cudnn} | {i.nccl} | {i.deepspeed} | "
                    f"CUDA {toolkit} | {i.python} | {i.driver_min} | {aliases} | {arches} | {security.checked_cell(root, i)} |")
    return "\n".join(rows) + train_table(matrix)


def train_table(matrix: Matrix) -> str:
    """The train flavor's extras per image: the version each gets, or why it is left out (docs/train.md)."""
    trains = [i for i in matrix.images if i.flavor == "train"]
    if not trains:
        return ""
    names = list(matrix.extras)
    rows = ["", "", "The train flavor's extras (docs/train.md): the version each image pins, or why it has none.", "",
            "| train image | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i in trains:
        have, out = i.extras_pins, dict(i.extras_left_out)
        rows.append(f"| `{i.name}` | " + " | ".join(have.get(n) or f"left out: {out[n]}" for n in names) + " |")
    return "\n".join(rows)


def readme_with_table(text: str, root: Path, matrix: Matrix, name: str = "README.md") -> str:
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise RenderError(f"{name} lacks the {README_START} ... {README_END} markers")
    return text[: start + len(README_START)] + "\n" + matrix_table(root, matrix) + "\n" + text[end:]


def orphans(root: Path, matrix: Matrix) -> list[Path]:
    """Directories under images/ that no matrix row produces any more."""
    names = {i.name for i in matrix.images}
    d = root / "images"
    return sorted(p for p in d.iterdir() if p.is_dir() and p.name not in names) if d.exists() else []


def write(root: Path, matrix: Matrix, images: list[Image], log: Callable[[str], None] = print) -> None:
    outputs = [(image, render_image(root, image)) for image in images]
    items = [(lock.image_dir(root, image) / n, text) for image, files in outputs for n, text in files.items()]
    whole = len(images) == len(matrix.images)
    tables = [root / n for n in TABLE_FILES if (root / n).exists()] if whole else []
    items += [(p, readme_with_table(p.read_text(), root, matrix, str(p.relative_to(root)))) for p in tables]
    changed = write_all_atomic(items)  # all or nothing: a full disk leaves every file as it was
    for image, files in outputs:
        names = [n for n in files if lock.image_dir(root, image) / n in changed]
        log(f"{image.name}: {'rendered ' + ', '.join(names) if names else 'unchanged'}")
    for p in tables:
        if p in changed:
            log(f"{p.relative_to(root)}: matrix table updated")
    if whole:
        for stale in orphans(root, matrix):
            shutil.rmtree(stale)
            log(f"removed images/{stale.name}: no longer in {matrix.path.name}")


def check(root: Path, matrix: Matrix, images: list[Image]) -> None:
    drift = []
    for image in images:
        for name, text in render_image(root, image).items():
            path = lock.image_dir(root, image) / name
            if not path.exists() or path.read_text() != text:
                drift.append(f"images/{image.name}/{name}")
    drift += [f"images/{p.name} (not in {matrix.path.name})" for p in orphans(root, matrix)]
    for name in TABLE_FILES if len(images) == len(matrix.images) else ():
        p = root / name
        if p.exists() and p.read_text() != readme_with_table(p.read_text(), root, matrix, name):
            drift.append(f"{name} (matrix table)")
    if drift:
        raise RenderError(f"rendered files drifted: {', '.join(drift)}; run `python build.py render` and commit")
