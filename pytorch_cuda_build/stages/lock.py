"""Stage 1: lock. Resolve each row once (network) into committed files under images/<image>/.

  requirements.lock  every package of the image's Python environment, hash-pinned,
                     except DeepSpeed (installed only with --only-binary wheels)
  deepspeed.lock     the DeepSpeed sdist, hash-pinned; built into a wheel with
                     prebuilt ops in the image's builder stage
  toolkit.lock       the CUDA compiler the ops are built with: hash-pinned wheels (pypi)
                     or .deb addresses with the sha256 of a signed Debian index (debian)
  debs.lock          every Debian file the build reads, by step (the base's, the apt step's, the
                     ops builder's; the release index the base is bootstrapped from), each at its
                     exact version with its pool address and the sha256 of the signed index
                     (resolve/apt.py: apt's own solver, run offline over those indexes)
  lock.json          what the lock was made from (inputs), the facts read from the
                     torch wheel, the base's identity, hashes of the three files, and
                     the file (name, sha256, size, address) each pin installs (`wheels`,
                     wheel_files.py), from which render lays out the layers (layers.py), each
                     sdist built in the image (`sdists`), a pypi toolkit's wheel files
                     (`toolkit_files`) and every Debian package the image holds (`debian`)
  linux-arm64/       for a row that lists linux/arm64 beside linux/amd64: that platform's
                     requirements.lock and toolkit.lock, resolved from the aarch64 wheels'
                     own metadata; lock.json's `platforms` holds their inputs, facts and hashes

A train image (matrix.yaml `train:`) holds its runtime sibling's files, byte for byte, and beside
them, for each platform:
  extras.lock        the extras and what they add, hash-pinned wheels, resolved with every
                     runtime pin as a constraint (no runtime pin moves)
  extras-build.lock  the sdists among them compiled in the builder stage (tebuild.py)
lock.json's `extras` holds each platform's inputs, pins, wheel files and the files' hash.

Together they name, by hash, every file a build reads: fetch.py downloads each once into the
store, and the build reads them from there with no network (docs/reproducibility.md).

`check` is offline: it recomputes the inputs from matrix.yaml and compares.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from pytorch_cuda_runtime import lockfile

from ..errors import LockError, ResolveError
from ..files import sha256_text, write_atomic
from ..matrix import OS_PLATFORMS, Image, Matrix
from ..resolve import apt as resolve_apt
from ..resolve import debian as resolve_debian
from ..resolve import pypi as resolve_pypi
from ..resolve import wheel_files

# 3: lock.json records each pin's wheel file (`wheels`); 4: every file by address and hash (debs.lock,
# the wheels' and sdists' addresses)
LOCK_SCHEMA = 4
PYTHON_LOCK_FILES = ("requirements.lock", "deepspeed.lock", "toolkit.lock")
LOCK_FILES = (*PYTHON_LOCK_FILES, "debs.lock")
PLATFORM_LOCK_FILES = ("requirements.lock", "toolkit.lock", "debs.lock")  # the DeepSpeed sdist is the same on every platform
EXTRAS_FILES = ("extras.lock", "extras-build.lock")  # a train image's, per platform
# Packages built in the image's builder stage rather than installed from a wheel.
BUILT_IN_IMAGE = ("deepspeed",)


def image_dir(root: Path, image: Image) -> Path:
    return root / "images" / image.name


def platform_subdir(platform: str) -> str:
    return platform.replace("/", "-")


def platform_dir(root: Path, image: Image, platform: str) -> Path:
    """Where a platform beside linux/amd64 keeps its lock files: images/<image>/linux-arm64/."""
    return image_dir(root, image) / platform_subdir(platform)


def build_dir(root: Path, image: Image) -> Path:
    """Where image.platform's Dockerfile and lock files are: images/<image>/ for linux/amd64,
    images/<image>/linux-arm64/ beside it (the DeepSpeed lock and manifest stay the row's)."""
    return image_dir(root, image) if image.platform == "linux/amd64" else platform_dir(root, image, image.platform)


def extra_platforms(image: Image) -> tuple[str, ...]:
    """The row's platforms beside linux/amd64, whose lock lives in images/<image>/."""
    return tuple(p for p in image.platforms if p != "linux/amd64")


def base_identity(image: Image) -> dict:
    """What the base is: a digest-pinned registry image, or the recipe of a local rootfs."""
    # The rootfs is made from suite, mirror and variant alone; package lists are pinned apart.
    recipe = image.os.model_dump(exclude_none=True, exclude={"packages", "build_packages", "updates"})
    recipe["name"] = image.os_name
    return {**recipe, "recipe_sha256": sha256_text(json.dumps(recipe, sort_keys=True))}


def inputs(image: Image) -> dict:
    """Everything that decides the lock's content; a change to any of it makes the lock stale."""
    return {
        "requirements": resolve_pypi.requirements_for(image),
        "python": image.python,
        "platform": resolve_pypi.PYTHON_PLATFORM,
        "index": image.index,
        "expect": {"torch_cuda": image.wheel_cuda, "cudnn": image.cudnn, "nccl": image.nccl},
        "base": base_identity(image),
        "apt": {"packages": list(image.os.packages), "build_packages": list(image.os.build_packages),
                "updates": [u.model_dump() for u in image.os.updates]},
        "toolkit": image.toolkit.model_dump(mode="json", exclude_defaults=True) if image.toolkit else None,
    }


def platform_inputs(image: Image, platform: str) -> dict:
    """What decides the lock of a platform beside linux/amd64 (its Debian packages are the same)."""
    return {
        "requirements": resolve_pypi.requirements_for(image),
        "python": image.python,
        "platform": OS_PLATFORMS[platform],
        "index": image.index,
        "expect": {"torch_cuda": image.wheel_cuda, "cudnn": image.cudnn, "nccl": image.nccl},
        "toolkit": image.toolkit.model_dump(mode="json", exclude_defaults=True) if image.toolkit else None,
    }


def cuda_index(image: Image) -> str:
    """PyTorch's own index of the row's CUDA build (cu126, cu130, ...)."""
    return f"https://download.pytorch.org/whl/cu{image.wheel_cuda.replace('.', '')}"


def platform_facts(image: Image, platform: str, lock_text: str) -> resolve_pypi.WheelFacts:
    """The torch wheel's facts on a platform, or one line saying that it carries no CUDA there and
    which index has a build that does (PyPI's aarch64 torch wheels carry CUDA from 2.11 on)."""
    try:
        facts = resolve_pypi.wheel_facts(lock_text)
    except ResolveError:
        torch = resolve_pypi.pins(lock_text).get("torch", image.torch)
        raise LockError(f"{image.name}: torch {torch}'s {platform} wheel from {image.index} carries no CUDA (it pins no "
                        f"nvidia-cuda-runtime); PyTorch's index {cuda_index(image)} has CUDA {platform} builds: set "
                        f"`index:` on the row to it, or drop {platform} from its platforms") from None
    agree(image, facts, platform)
    return facts


@dataclass(frozen=True)
class DebianLock:
    """A row's Debian packages on one platform: the named ones' pins, debs.lock's text (every
    file of every step) and what the image then holds."""

    pins: dict[str, str]
    text: str
    installed: dict[str, str]


def debian_lock(image: Image, platform: str, ca_bundle: str | None) -> DebianLock:
    """Each named package at the newest version its release and update suites hold, and every
    .deb of the base, the apt step and the ops builder's step at the version apt then installs."""
    os_ = image.os
    if not (os_.mirror and os_.suite):
        raise LockError(f"{image.name}: the base {image.os_name} is a registry image, whose Debian packages cannot be locked "
                        "file by file; use a debootstrap base (matrix.yaml oses:)")
    arch = platform.split("/", 1)[1]  # Debian's and Docker's name: amd64, arm64
    release = resolve_debian.read_suite(os_.mirror, os_.suite, arch, ca_bundle)
    updates = [resolve_debian.read_suite(u.mirror, u.suite, arch, ca_bundle) for u in os_.updates]
    pins = resolve_debian.newest_of([release, *updates], [*os_.packages, *os_.build_packages], f"Debian {os_.suite} at {os_.mirror}")
    steps = resolve_apt.steps(release, updates, arch, {n: pins[n] for n in os_.packages}, {n: pins[n] for n in os_.build_packages})
    head = (f"# GENERATED by `python build.py lock`: every Debian file a {image.os_name} build reads on {platform}, apt's own "
            f"choice over the signed indexes of {', '.join(s.suite for s in [release, *updates])}; sha256 from those indexes. "
            "DO NOT EDIT.\n# step sha256 size url package=version\n")
    text = lockfile.deb_steps_text(head, {"index": steps.index, "base": steps.base, "apt": steps.apt, "build": steps.build})
    return DebianLock(pins, text, steps.installed())


def split(lock_text: str) -> tuple[str, str]:
    """Separate the packages built in the image from those installed as wheels."""
    blocks = re.split(r"\n(?=\S)", lock_text.strip())
    built = [b for b in blocks if re.match(rf"^({'|'.join(BUILT_IN_IMAGE)})==", b)]
    wheels = [b for b in blocks if b not in built]
    return "\n".join(wheels) + "\n", "\n".join(built) + "\n"


def agree(image: Image, facts: resolve_pypi.WheelFacts, platform: str = "linux/amd64") -> None:
    """Fail, naming both versions, where the matrix disagrees with the torch wheel."""
    wrong = [
        f"{what} {said} in matrix.yaml but torch {facts.torch}'s wheel requires {real}"
        for what, said, real in (
            ("CUDA build", image.wheel_cuda, facts.torch_cuda),
            ("cuDNN", image.cudnn, facts.cudnn),
            ("NCCL", image.nccl, facts.nccl),
        )
        if said != real
    ]
    if wrong:
        where = "" if platform == "linux/amd64" else f" ({platform})"
        raise LockError(f"{image.name}{where}: " + "; ".join(wrong))


def _header(image: Image, what: str, platform: str = "linux/amd64") -> str:
    # Names the lock's inputs, not the row: rows that share a lock must get byte-identical
    # files, or the COPY of the lock busts the build cache and they stop sharing the torch layer.
    return (
        f"# GENERATED by `python build.py lock` for torch {image.torch}, DeepSpeed {image.deepspeed}: {what}. DO NOT EDIT.\n"
        f"# Resolved with uv for Python {image.python} on {OS_PLATFORMS[platform]} from {image.index}\n"
    )


def toolkit_version(debs: list[resolve_debian.Deb] | None, toolkit_text: str) -> str:
    """The CUDA compiler's own version: nvcc's package (pypi) or nvidia-cuda-toolkit's upstream part (debian)."""
    if debs:
        return next(d.version for d in debs if d.package == "nvidia-cuda-toolkit").split("~")[0]
    version = resolve_pypi.pins(toolkit_text).get("nvidia-cuda-nvcc")
    if not version:
        raise LockError("the pypi toolkit resolved without nvidia-cuda-nvcc; add the nvcc extra")
    return version


def resolve_toolkit(image: Image, lock_text: str, ca_bundle: str | None,
                    exclude_newer: str | None = None, platform: str = "linux/amd64") -> tuple[str, str]:
    """(toolkit.lock text, compiler version) for the row's CUDA major on one platform."""
    tk = image.toolkit
    if tk is None:
        raise LockError(f"{image.name}: no toolkit for CUDA {image.cuda_major}")
    if tk.source == "pypi":
        body = resolve_pypi.pypi_toolkit(image, lock_text, ca_bundle, exclude_newer, platform)
        head = f"# GENERATED by `python build.py lock`: cuda-toolkit[{','.join(tk.extras)}] for torch {image.torch}'s CUDA, wheels installed with --require-hashes. DO NOT EDIT.\n"
        return head + body, toolkit_version(None, body)
    if platform != "linux/amd64":  # Debian's toolkit is read from its amd64 index
        raise LockError(f"{image.name}: the CUDA {image.cuda_major} toolkit comes from Debian's amd64 packages; "
                        f"{platform} needs a pypi toolkit (toolkits.{image.cuda_major} in matrix.yaml)")
    assert tk.mirror is not None and tk.suite is not None  # a debian toolkit has both (matrix.Toolkit._complete)
    debs = resolve_debian.debian_toolkit(tk.mirror, tk.suite, tk.components, tk.packages, ca_bundle)
    found = next(d.version for d in debs if d.package == "nvidia-cuda-toolkit") if any(d.package == "nvidia-cuda-toolkit" for d in debs) else None
    if found != tk.version:
        raise LockError(f"toolkits.{image.cuda_major}: nvidia-cuda-toolkit {tk.version} in matrix.yaml but Debian {tk.suite} has {found}")
    head = (f"# GENERATED by `python build.py lock`: CUDA toolkit {toolkit_version(debs, '')} from Debian {tk.suite} "
            f"({', '.join(tk.components)}); sha256 from its signed Release. DO NOT EDIT.\n# sha256 size url package=version\n")
    body = "".join(f"{d.sha256} {d.size} {tk.mirror.rstrip('/')}/{d.filename} {d.package}={d.version}\n" for d in debs)
    return head + body, toolkit_version(debs, "")


def render_lock(image: Image, lock_text: str, debian: DebianLock, toolkit: tuple[str, str] = ("", ""),
                platforms: dict[str, dict] | None = None, python_files: dict[str, dict] | None = None) -> dict[str, str]:
    """The files of one image's lock, as text: the five of linux/amd64, and those of each other
    platform (render_platform) under its directory, which lock.json vouches for too.
    python_files: the `wheels`, `sdists` and `toolkit_files` records (the files' addresses)."""
    facts = resolve_pypi.wheel_facts(lock_text)
    agree(image, facts)
    wheel_lock, built = split(lock_text)
    req = _header(image, "wheels, installed with --require-hashes") + wheel_lock
    ds = _header(image, "sdists built into wheels in the builder stage") + built
    tk_text, tk_version = toolkit
    found = python_files or {}
    meta = {
        "schema": LOCK_SCHEMA,
        "image": image.name,
        "inputs": inputs(image),
        "inputs_sha256": sha256_text(json.dumps(inputs(image), sort_keys=True)),
        "wheel": asdict(facts),
        "pins": resolve_pypi.pins(lock_text),
        "apt": debian.pins,
        "debian": debian.installed,
        "cuda_toolkit": tk_version,
        "files_sha256": sha256_text(req, ds, tk_text, debian.text),
        "wheels": found.get("wheels") or {},
        "sdists": found.get("sdists") or {},
        "toolkit_files": found.get("toolkit_files") or {},
    }
    files = {"requirements.lock": req, "deepspeed.lock": ds, "toolkit.lock": tk_text, "debs.lock": debian.text}
    return _with_platforms(files, meta, platforms or {})


def _with_platforms(files: dict[str, str], meta: dict, platforms: dict[str, dict]) -> dict[str, str]:
    """files, each other platform's files under its directory, and lock.json vouching for all."""
    meta = {k: v for k, v in meta.items() if k != "platforms"}
    if platforms:  # only a row that lists more than linux/amd64 has the key: the others' lock.json stays as it was
        meta["platforms"] = {p: part["meta"] for p, part in sorted(platforms.items())}
        files = {**files, **{f"{p.replace('/', '-')}/{n}": t for p, part in platforms.items() for n, t in part["files"].items()}}
    return {**files, "lock.json": json.dumps(meta, indent=2, sort_keys=True) + "\n"}


def render_platform(image: Image, platform: str, lock_text: str, toolkit: tuple[str, str], deepspeed_lock: str,
                    debian: DebianLock, python_files: dict[str, dict] | None = None) -> dict:
    """A platform beside linux/amd64: its files and its part of lock.json. Its torch wheel must
    carry the CUDA, cuDNN and NCCL the row names, and its DeepSpeed sdist be linux/amd64's."""
    facts = platform_facts(image, platform, lock_text)
    wheel_lock, built = split(lock_text)
    if _header(image, "sdists built into wheels in the builder stage") + built != deepspeed_lock:
        raise LockError(f"{image.name}: the DeepSpeed sdist resolved for {platform} is not linux/amd64's")
    req = _header(image, f"{platform} wheels, installed with --require-hashes", platform) + wheel_lock
    tk_text, tk_version = toolkit
    found = python_files or {}
    return {"files": {"requirements.lock": req, "toolkit.lock": tk_text, "debs.lock": debian.text},
            "meta": {"inputs": platform_inputs(image, platform), "wheel": asdict(facts),
                     "pins": resolve_pypi.pins(lock_text), "cuda_toolkit": tk_version, "apt": debian.pins,
                     "debian": debian.installed, "files_sha256": sha256_text(req, tk_text, debian.text),
                     "wheels": found.get("wheels") or {}, "toolkit_files": found.get("toolkit_files") or {}}}


class _Resolver:
    """What `write` asks the network, each question once per run: the rows that share a lock, a
    platform or an OS share the answers."""

    def __init__(self, ca_bundle: str | None, exclude_newer: str | None, log: Callable[[str], None]):
        self.ca_bundle, self.exclude_newer, self.log = ca_bundle, exclude_newer, log
        self._python: dict[tuple, str] = {}
        self._toolkits: dict[tuple, tuple[str, str]] = {}
        self._files: dict[tuple, dict] = {}
        self._debian: dict[tuple, DebianLock] = {}
        self._indexes: dict[str, wheel_files.Index] = {}

    def python(self, image: Image, platform: str) -> tuple[str, tuple[str, str]]:
        """(the uv lock of the row's requirements, (toolkit.lock, compiler version)) on platform."""
        key = (*image.lock_key, platform)
        if key not in self._python:
            self.log(f"resolving {' '.join(resolve_pypi.requirements_for(image))} for Python {image.python} on {platform}")
            self._python[key] = resolve_pypi.compile_lock(image, self.ca_bundle, exclude_newer=self.exclude_newer, platform=platform)
            if platform != "linux/amd64":
                platform_facts(image, platform, self._python[key])  # no CUDA there: say so before resolving a toolkit
        if key not in self._toolkits:
            self.log(f"resolving the CUDA {image.cuda_major} toolkit for torch {image.torch} on {platform}")
            self._toolkits[key] = resolve_toolkit(image, self._python[key], self.ca_bundle, self.exclude_newer, platform)
        return self._python[key], self._toolkits[key]

    def index(self, image: Image) -> wheel_files.Index:
        return self._indexes.setdefault(image.index, wheel_files.Index(image.index, self.ca_bundle))

    def wheels(self, image: Image, platform: str, wheel_lock: str, glibc: str | None) -> dict:
        """name -> the wheel file (name, sha256, size, address) each pin installs on platform."""
        key = ("wheels", image.index, image.python, platform, glibc, sha256_text(wheel_lock))
        if key not in self._files:
            self.log(f"reading the file of each pin for {platform} from {image.index}")
            self._files[key] = wheel_files.wheel_files(wheel_lock, image.python, platform, self.index(image), glibc)
        return self._files[key]

    def sdists(self, image: Image, built_lock: str) -> dict:
        """name -> the sdist (name, sha256, size, address) of each pin the image compiles."""
        key = ("sdists", image.index, sha256_text(built_lock))
        if key not in self._files:
            self._files[key] = wheel_files.sdist_files(built_lock, self.index(image)) if resolve_pypi.pins(built_lock) else {}
        return self._files[key]

    def debian(self, image: Image, platform: str) -> DebianLock:
        key = (image.os_name, image.os.model_dump_json(), platform)
        if key not in self._debian:
            self.log(f"resolving {image.os_name}'s Debian packages on {platform}: every file of the base and the apt steps")
            self._debian[key] = debian_lock(image, platform, self.ca_bundle)
        return self._debian[key]

    def python_files(self, image: Image, platform: str, wheel_lock: str, toolkit_text: str, glibc: str | None,
                     deepspeed_lock: str = "") -> dict[str, dict]:
        """The `wheels`, `sdists` and `toolkit_files` records of one platform."""
        pypi_toolkit = image.toolkit is not None and image.toolkit.source == "pypi"
        return {"wheels": self.wheels(image, platform, wheel_lock, glibc),
                "sdists": self.sdists(image, deepspeed_lock) if deepspeed_lock else {},
                "toolkit_files": self.wheels(image, platform, toolkit_text, glibc) if pypi_toolkit else {}}


def write(root: Path, matrix: Matrix, images: list[Image], ca_bundle: str | None, log: Callable[[str], None] = print,
          exclude_newer: str | None = None, keep_current: bool = False) -> None:
    """Resolve each distinct lock once per platform and write it for every image that shares it.

    exclude_newer freezes the package index at that ISO 8601 time; None means
    $PYTORCH_CUDA_EXCLUDE_NEWER, and without it the index as it is now (see resolve_pypi.frozen_at).
    keep_current: a platform whose lock is current keeps it as committed (pins, Debian packages
    and all), and only the stale ones are resolved: adding linux/arm64 to a row refreshes nothing
    else, and a lock of an older schema keeps its Python pins and gains what the new one records
    (every file's address, the Debian files).
    """
    exclude_newer = resolve_pypi.frozen_at(exclude_newer)
    if exclude_newer:
        log(f"package index frozen at {exclude_newer} ({resolve_pypi.EXCLUDE_NEWER_ENV})")
    r = _Resolver(ca_bundle, exclude_newer, log)
    rendered: list[tuple[Image, dict[str, str]]] = []
    # A train image is locked over its runtime sibling: relocking the runtime relocks it too.
    written = {i.name for i in images}
    trains = [i for i in images if i.flavor == "train"] + [
        t for t in matrix.images if t.flavor == "train" and t.name not in written and runtime_of(t).name in written]
    for image in [i for i in images if i.flavor != "train"]:  # resolve everything first: nothing is written if any row fails
        if keep_current and not amd64_problems(root, image):
            rendered.append((image, _kept_row(root, image, r)))
        elif keep_current and not amd64_problems(root, image, migrating=True):
            rendered.append((image, _migrated_row(root, image, r)))
        else:
            rendered.append((image, _resolved_row(image, r)))
    by_name = {image.name: files for image, files in rendered}
    for image in trains:  # over their runtime sibling's lock: as rendered just now, or as committed
        rendered.append((image, _train_row(root, image, by_name.get(runtime_of(image).name) or committed_runtime(root, image),
                                           r, keep_current)))
    for image, files in rendered:
        _write_files(root, image, files, log)


def _resolved_row(image: Image, r: _Resolver) -> dict[str, str]:
    """A row resolved anew on every platform."""
    lock_text, toolkit = r.python(image, "linux/amd64")
    debian = r.debian(image, "linux/amd64")
    glibc = wheel_files.glibc_of(debian.installed)
    wheel_lock, built = split(lock_text)
    ds = _header(image, "sdists built into wheels in the builder stage") + built
    extra = {}
    for p in extra_platforms(image):
        text, tk = r.python(image, p)
        extra[p] = render_platform(image, p, text, tk, ds, r.debian(image, p),
                                   r.python_files(image, p, split(text)[0], tk[0], glibc))
    return render_lock(image, lock_text, debian, toolkit, extra, r.python_files(image, "linux/amd64", wheel_lock, toolkit[0], glibc, ds))


def _kept_row(root: Path, image: Image, r: _Resolver) -> dict[str, str]:
    """A row whose linux/amd64 lock is current: kept as committed; its other platforms kept where
    current, else resolved."""
    meta = read(root, image)
    files = {name: (image_dir(root, image) / name).read_text() for name in LOCK_FILES}
    glibc = wheel_files.glibc_of(meta.get("debian", {}))
    extra = {}
    for p in extra_platforms(image):
        extra[p] = _kept_platform(root, image, p, meta) or _platform_part(image, p, r, files["deepspeed.lock"], glibc)
    return _with_platforms(files, meta, extra)


def _migrated_row(root: Path, image: Image, r: _Resolver) -> dict[str, str]:
    """A row locked by an older schema whose Python pins are current: the pins and toolkit kept as
    committed, the rest (every file's address, the Debian files) read anew."""
    meta = read(root, image)
    d = image_dir(root, image)
    req, ds, tk = ((d / n).read_text() for n in PYTHON_LOCK_FILES)
    debian = r.debian(image, "linux/amd64")
    glibc = wheel_files.glibc_of(debian.installed)
    extra = {}
    for p in extra_platforms(image):
        part = meta.get("platforms", {}).get(p)
        try:
            p_req, p_tk = ((platform_dir(root, image, p) / n).read_text() for n in ("requirements.lock", "toolkit.lock"))
        except FileNotFoundError:
            part = None
        if not part or part.get("inputs") != platform_inputs(image, p) or sha256_text(p_req, p_tk) != part.get("files_sha256"):
            extra[p] = _platform_part(image, p, r, ds, glibc)
            continue
        extra[p] = render_platform(image, p, _unsplit(p_req, ds), (p_tk, part["cuda_toolkit"]), ds, r.debian(image, p),
                                   r.python_files(image, p, _body(p_req), p_tk, glibc))
    return render_lock(image, _unsplit(req, ds), debian, (tk, meta["cuda_toolkit"]), extra,
                       r.python_files(image, "linux/amd64", _body(req), tk, glibc, ds))


def _platform_part(image: Image, platform: str, r: _Resolver, deepspeed_lock: str, glibc: str | None) -> dict:
    text, tk = r.python(image, platform)
    return render_platform(image, platform, text, tk, deepspeed_lock, r.debian(image, platform),
                           r.python_files(image, platform, split(text)[0], tk[0], glibc))


def _body(lock_file: str) -> str:
    """A lock file's requirements without its GENERATED header."""
    return "".join(line + "\n" for line in lock_file.splitlines() if not line.startswith("# GENERATED") and not line.startswith("# Resolved"))


def _unsplit(requirements: str, deepspeed: str) -> str:
    """The one lock that split() divided, from the two committed files."""
    return _body(requirements).rstrip("\n") + "\n" + _body(deepspeed)


def _train_row(root: Path, image: Image, base: dict[str, str], r: _Resolver, keep_current: bool) -> dict[str, str]:
    """A train image: its runtime sibling's files, and each platform's extras, kept where current
    (with keep_current), else resolved over the runtime's pins."""
    meta = json.loads(base["lock.json"])
    glibc = wheel_files.glibc_of(meta.get("debian", {}))
    committed = _committed_extras(root, image) if keep_current else {}
    parts = {}
    for p in image.platforms:
        runtime_lock = base[_in_platform("requirements.lock", p)] + base["deepspeed.lock"]
        kept = committed.get(p)
        if kept and kept["meta"].get("inputs") == extras_inputs(image, p, runtime_lock):
            wheel_lock, built = _body(kept["files"]["extras.lock"]), _body(kept["files"]["extras-build.lock"])
        else:
            r.log(f"resolving the train extras of {image.name} over its runtime lock on {p}")
            text = resolve_pypi.compile_extras(image, runtime_lock, r.ca_bundle, r.exclude_newer, p)
            wheel_lock, built = split_extras(image, text, runtime_lock, p)
        parts[p] = render_extras(image, p, runtime_lock, wheel_lock, built, r.wheels(image, p, wheel_lock, glibc), r.sdists(image, built))
    return with_extras(image, base, parts)


def _committed_extras(root: Path, image: Image) -> dict[str, dict]:
    """platform -> the committed extras files and lock.json part of a train image, where they are whole."""
    try:
        meta = read(root, image)
    except LockError:
        return {}
    out = {}
    for p, part in (meta.get("extras") or {}).items():
        try:
            texts = {n: (image_dir(root, image) / _in_platform(n, p)).read_text() for n in EXTRAS_FILES}
        except FileNotFoundError:
            continue
        if sha256_text(*texts.values()) == part.get("files_sha256"):
            out[p] = {"files": texts, "meta": part}
    return out


def _write_files(root: Path, image: Image, files: dict[str, str], log: Callable[[str], None]) -> None:
    d = image_dir(root, image)
    # lock.json last: it vouches for the others by hash, so a run cut off
    # between files leaves a lock that `check` reports as stale, never a wrong one.
    names = [n for n in files if n != "lock.json"] + ["lock.json"]
    changed = [name for name in names if write_atomic(d / name, files[name])]
    for gone in _orphan_platform_dirs(root, image):
        for f in sorted(gone.iterdir()):
            f.unlink()
        gone.rmdir()
        changed.append(f"{gone.name}/ (removed)")
    log(f"{image.name}: {'updated ' + ', '.join(changed) if changed else 'unchanged'}")


def runtime_of(image: Image) -> Image:
    """The row's runtime image, whose lock a train image is layered over."""
    return replace(image, flavor="runtime", extras=(), extras_left_out=(), extras_built=())


def _in_platform(name: str, platform: str) -> str:
    """A lock file's path under images/<image>/ for a platform."""
    return name if platform == "linux/amd64" else f"{platform_subdir(platform)}/{name}"


def committed_runtime(root: Path, image: Image) -> dict[str, str]:
    """The runtime sibling's committed lock files, which must be current."""
    sibling = runtime_of(image)
    stale = problems(root, sibling)
    if stale:
        raise LockError(f"{image.name} is locked over {sibling.name}, whose lock is not current: {stale[0]}")
    names = [*LOCK_FILES, *(_in_platform(n, p) for p in extra_platforms(sibling) for n in PLATFORM_LOCK_FILES), "lock.json"]
    return {n: (image_dir(root, sibling) / n).read_text() for n in names}


def extras_inputs(image: Image, platform: str, runtime_lock: str) -> dict:
    """What decides a train image's extras lock on one platform: the extras, and the runtime lock under them."""
    return {"extras": [r for _, r in image.extras], "built": list(image.extras_built), "python": image.python,
            "platform": OS_PLATFORMS[platform], "index": image.index, "runtime_lock_sha256": sha256_text(runtime_lock)}


def split_extras(image: Image, resolved: str, runtime_lock: str, platform: str) -> tuple[str, str]:
    """(wheels, sdists built in the image) among the packages the extras add to the runtime lock.
    A runtime pin that moved would change the tested runtime under them: refused."""
    base = resolve_pypi.pins(runtime_lock)
    added: list[str] = []
    built: list[str] = []
    for block in re.split(r"\n(?=\S)", resolved.strip()):
        found = resolve_pypi.pins(block)
        if not found:
            continue
        (name, version), = found.items()
        if name in base:
            if base[name] != version:
                raise LockError(f"{image.name} ({platform}): the extras moved the runtime's {name} {base[name]} to {version}")
            continue
        (built if name in image.extras_built else added).append(block)
    missing = sorted(set(image.extras_built) - {n for b in built for n in resolve_pypi.pins(b)})
    if missing:
        raise LockError(f"{image.name} ({platform}): the extras resolved without {', '.join(missing)}, which the builder stage compiles")
    return "\n".join(added) + "\n", "\n".join(built) + "\n"


def render_extras(image: Image, platform: str, runtime_lock: str, wheel_lock: str, built: str, wheels: dict,
                  sdists: dict | None = None) -> dict:
    """A platform's extras files and its part of lock.json's `extras`."""
    head = (f"# GENERATED by `python build.py lock` for {image.name}: the train extras over the runtime lock "
            f"({', '.join(r for _, r in image.extras)}), resolved with uv for Python {image.python} on "
            f"{OS_PLATFORMS[platform]} from {image.index}")
    files = {"extras.lock": f"{head}; wheels, installed with --require-hashes. DO NOT EDIT.\n" + wheel_lock,
             "extras-build.lock": f"{head}; sdists compiled in the builder stage. DO NOT EDIT.\n" + built}
    return {"files": files, "meta": {"inputs": extras_inputs(image, platform, runtime_lock),
                                     "pins": resolve_pypi.pins(wheel_lock), "built": resolve_pypi.pins(built),
                                     "files_sha256": sha256_text(*files.values()), "wheels": wheels, "sdists": sdists or {}}}


def with_extras(image: Image, base: dict[str, str], parts: dict[str, dict]) -> dict[str, str]:
    """A train image's files: its runtime sibling's, each platform's extras, and lock.json for all."""
    meta = {**json.loads(base["lock.json"]), "image": image.name,
            "extras": {p: part["meta"] for p, part in sorted(parts.items())}}
    files = {n: t for n, t in base.items() if n != "lock.json"}
    files.update({_in_platform(n, p): t for p, part in parts.items() for n, t in part["files"].items()})
    return {**files, "lock.json": json.dumps(meta, indent=2, sort_keys=True) + "\n"}


def extras_problems(root: Path, image: Image, meta: dict) -> list[str]:
    """Why a train image's lock is not current over its runtime sibling's, offline."""
    fix = "; run `python build.py lock`"
    d, sibling = image_dir(root, image), image_dir(root, runtime_of(image))
    names = [*LOCK_FILES, *(_in_platform(n, p) for p in extra_platforms(image) for n in PLATFORM_LOCK_FILES)]
    try:
        if any((d / n).read_bytes() != (sibling / n).read_bytes() for n in names):
            return [f"{image.name}: its runtime lock files are not {runtime_of(image).name}'s{fix}"]
    except FileNotFoundError as e:
        return [f"{image.name}: missing {Path(e.filename).relative_to(root) if Path(e.filename).is_relative_to(root) else e.filename}{fix}"]
    parts, out = meta.get("extras") or {}, []
    if set(parts) != set(image.platforms):
        return [f"{image.name}: lock.json's extras are not locked for {', '.join(image.platforms)}{fix}"]
    for p in image.platforms:
        runtime_lock = (d / _in_platform("requirements.lock", p)).read_text() + (d / "deepspeed.lock").read_text()
        if parts[p].get("inputs") != extras_inputs(image, p, runtime_lock):
            out.append(f"{image.name}: the {p} extras lock is stale against matrix.yaml or the runtime lock{fix}")
            continue
        try:
            texts = [(d / _in_platform(n, p)).read_text() for n in EXTRAS_FILES]
        except FileNotFoundError as e:
            out.append(f"{image.name}: missing {_in_platform(Path(e.filename).name, p)}{fix}")
            continue
        if sha256_text(*texts) != parts[p].get("files_sha256"):
            out.append(f"{image.name}: {p}'s extras files: one was edited or half-written{fix}")
        else:
            out += wheel_problems(image, f"{p} extras", texts[0], parts[p].get("wheels"))
            out += file_problems(image, f"{p} extras sdist", texts[1], parts[p].get("sdists"))
    return out


def _kept_platform(root: Path, image: Image, platform: str, meta: dict) -> dict | None:
    """A platform's committed lock (files and lock.json part) where it is current, else None."""
    part = meta.get("platforms", {}).get(platform)
    if not part or part.get("inputs") != platform_inputs(image, platform):
        return None
    try:
        texts = {n: (platform_dir(root, image, platform) / n).read_text() for n in PLATFORM_LOCK_FILES}
    except FileNotFoundError:
        return None
    if sha256_text(*texts.values()) != part.get("files_sha256"):
        return None
    return {"files": texts, "meta": dict(part)}


def _orphan_platform_dirs(root: Path, image: Image) -> list[Path]:
    """Platform directories of images/<image>/ the row no longer lists."""
    d, keep = image_dir(root, image), {p.replace("/", "-") for p in extra_platforms(image)}
    return [x for x in sorted(d.glob("linux-*")) if x.is_dir() and x.name not in keep] if d.is_dir() else []


def read(root: Path, image: Image) -> dict:
    d = image_dir(root, image)
    try:
        meta = json.loads((d / "lock.json").read_text())
    except FileNotFoundError:
        raise LockError(f"{image.name}: no lock (images/{image.name}/lock.json); run `python build.py lock`") from None
    except json.JSONDecodeError as e:
        raise LockError(f"{image.name}: images/{image.name}/lock.json is not valid JSON ({e.msg}); run `python build.py lock`") from None
    return meta


def problems(root: Path, image: Image) -> list[str]:
    """Why this image's committed lock is not current, offline; empty when it is."""
    out = amd64_problems(root, image)
    if out:
        return out
    meta = read(root, image)
    if image.flavor == "train":
        out += extras_problems(root, image, meta)
    locked = meta.get("platforms", {})
    if set(locked) != set(extra_platforms(image)) or _orphan_platform_dirs(root, image):
        return [f"{image.name}: locked for {', '.join(['linux/amd64', *sorted(locked)])} but the row lists "
                f"{', '.join(image.platforms)}; run `python build.py lock`"]
    for platform, part in sorted(locked.items()):
        if part.get("inputs") != platform_inputs(image, platform):
            out.append(f"{image.name}: the {platform} lock is stale against matrix.yaml; run `python build.py lock`")
        try:
            texts = [(platform_dir(root, image, platform) / n).read_text() for n in PLATFORM_LOCK_FILES]
            if sha256_text(*texts) != part.get("files_sha256"):
                out.append(f"{image.name}: {platform}'s lock files: one was edited or half-written; run `python build.py lock`")
            else:
                out += wheel_problems(image, platform, texts[0], part.get("wheels"))
                out += debs_problems(image, platform, texts[2], part)
        except FileNotFoundError as e:
            out.append(f"{image.name}: missing {platform.replace('/', '-')}/{Path(e.filename).name}; run `python build.py lock`")
        try:
            agree(image, resolve_pypi.WheelFacts(**part.get("wheel", {})), platform)
        except (LockError, TypeError) as e:
            out.append(str(e) if isinstance(e, LockError) else f"{image.name}: lock.json lacks {platform}'s wheel facts")
    return out


def wheel_problems(image: Image, platform: str, wheel_lock: str, wheels: object) -> list[str]:
    """lock.json's wheel files of a platform against its requirements.lock: one per pin, each a
    file whose hash the lock allows (render pins each large wheel to that one file)."""
    pinned = wheel_files.pinned_hashes(wheel_lock)
    fix = "; run `python build.py lock`"
    if not isinstance(wheels, dict) or not wheels:
        return [f"{image.name}: lock.json records no {platform} wheel files{fix}"]
    if set(wheels) != set(pinned):
        odd = sorted(set(wheels) ^ set(pinned))
        return [f"{image.name}: lock.json's {platform} wheel files are not requirements.lock's pins ({', '.join(odd[:5])}){fix}"]
    wrong = sorted(n for n, w in wheels.items() if not isinstance(w, dict) or w.get("sha256") not in pinned[n][1]
                   or not str(w.get("file", "")).endswith(".whl") or not isinstance(w.get("size"), int) or w["size"] <= 0
                   or not str(w.get("url", "")).startswith(("https://", "http://", "file:")))
    return [f"{image.name}: lock.json's {platform} wheel file of {', '.join(wrong[:5])} is not one requirements.lock allows{fix}"] if wrong else []


def amd64_problems(root: Path, image: Image, migrating: bool = False) -> list[str]:
    """Why the linux/amd64 part of the committed lock is not current, offline. migrating: a lock
    of an older schema whose Python pins are current passes (`write` keeps them and adds what is new)."""
    try:
        meta = read(root, image)
    except LockError as e:
        return [str(e)]
    d = image_dir(root, image)
    out = []
    old = migrating and meta.get("schema") in (2, 3)
    if meta.get("schema") != LOCK_SCHEMA and not old or meta.get("inputs") != inputs(image):
        out.append(f"{image.name}: lock is stale against matrix.yaml; run `python build.py lock`")
    names = PYTHON_LOCK_FILES if old else LOCK_FILES
    try:
        files = [(d / n).read_text() for n in names]
        if sha256_text(*files) != meta.get("files_sha256"):
            out.append(f"{image.name}: {', '.join(names)}: one was edited or half-written; run `python build.py lock`")
        elif not old:
            out += wheel_problems(image, "linux/amd64", files[0], meta.get("wheels"))
            out += file_problems(image, "DeepSpeed sdist", files[1], meta.get("sdists"))
            out += debs_problems(image, "linux/amd64", files[3], meta)
    except FileNotFoundError as e:
        out.append(f"{image.name}: missing {Path(e.filename).name}; run `python build.py lock`")
    try:
        agree(image, resolve_pypi.WheelFacts(**meta.get("wheel", {})))
    except (LockError, TypeError) as e:
        out.append(str(e) if isinstance(e, LockError) else f"{image.name}: lock.json lacks wheel facts")
    return out


def file_problems(image: Image, what: str, lock_text: str, found: object) -> list[str]:
    """lock.json's records of the files lock_text's pins install (sdists, a toolkit's wheels): one
    per pin, with an address, and a hash the lock allows."""
    pinned = wheel_files.pinned_hashes(lock_text)
    records = found if isinstance(found, dict) else {}
    wrong = sorted(n for n in pinned if not isinstance(records.get(n), dict) or records[n].get("sha256") not in pinned[n][1]
                   or not records[n].get("url") or not records[n].get("file"))
    return [f"{image.name}: lock.json records no {what} file with a locked hash for {', '.join(wrong[:5])}; "
            "run `python build.py lock`"] if wrong else []


def debs_problems(image: Image, platform: str, debs_text: str, meta: dict) -> list[str]:
    """debs.lock against lock.json: readable, every step it needs there, and lock.json's installed
    packages exactly the base's and the apt step's."""
    fix = "; run `python build.py lock`"
    try:
        steps = lockfile.deb_steps(debs_text, f"images/{image.name}/debs.lock ({platform})")
    except lockfile.LockFormatError as e:
        return [f"{image.name}: {e}{fix}"]
    if not steps["index"] or not steps["base"]:
        return [f"{image.name}: debs.lock ({platform}) names no base or no release index{fix}"]
    held = {d.package: d.version for d in steps["base"]}
    held.update({d.package: d.version for d in steps["apt"]})
    if meta.get("debian") != dict(sorted(held.items())):
        return [f"{image.name}: lock.json's Debian packages ({platform}) are not debs.lock's{fix}"]
    return []


def check(root: Path, images: list[Image]) -> None:
    found = [p for image in images for p in problems(root, image)]
    if found:
        raise LockError("; ".join(found))


@dataclass(frozen=True)
class BuildInputs:
    """Every file one platform's build of a row reads, by where it reads it (lock.json and the
    lock files, parsed by pytorch_cuda_runtime.lockfile): what fetch.py puts in the store and
    build.py stages from it."""

    base: tuple[lockfile.Input, ...]  # the release index and the base's .debs (mmdebstrap, on the host)
    apt: tuple[lockfile.Input, ...]  # the base stage's apt step
    build_debs: tuple[lockfile.Input, ...]  # the ops builder's apt step
    toolkit: tuple[lockfile.Input, ...]  # a Debian toolkit's .debs or a pypi toolkit's wheels
    wheels: dict[str, lockfile.Input]  # name -> the wheel file requirements.lock's pin installs
    sdists: tuple[lockfile.Input, ...]  # compiled in the builder stage (DeepSpeed)
    extras: dict[str, lockfile.Input]  # a train image's extras wheels, by name
    extras_sdists: tuple[lockfile.Input, ...]  # compiled in its te-builder stage

    def all(self) -> list[lockfile.Input]:
        """Each file once (rows and steps share files), in the order above."""
        seen: dict[str, lockfile.Input] = {}
        for item in (*self.base, *self.apt, *self.build_debs, *self.toolkit, *self.wheels.values(), *self.sdists,
                     *self.extras.values(), *self.extras_sdists):
            seen.setdefault(item.sha256, item)
        return list(seen.values())


def build_inputs(root: Path, image: Image) -> BuildInputs:
    """The files image.platform's build reads, from the committed lock (which must be current)."""
    stale = problems(root, image)
    if stale:
        raise LockError(stale[0])
    meta = read(root, image)
    part = meta if image.platform == "linux/amd64" else meta["platforms"][image.platform]
    d = build_dir(root, image)
    where = f"images/{image.name}/lock.json"

    def records(found: dict) -> dict[str, lockfile.Input]:
        return {n: lockfile.Input.from_json(w, f"{where} {n}") for n, w in sorted(found.items())}

    steps = lockfile.deb_steps((d / "debs.lock").read_text())
    toolkit_text = (d / "toolkit.lock").read_text()
    pypi_toolkit = image.toolkit is not None and image.toolkit.source == "pypi"
    toolkit = tuple(records(part.get("toolkit_files", {})).values()) if pypi_toolkit else tuple(x.input for x in lockfile.debs(toolkit_text))
    extras = (meta.get("extras") or {}).get(image.platform, {}) if image.flavor == "train" else {}
    return BuildInputs(
        base=tuple(x.input for x in (*steps["index"], *steps["base"])), apt=tuple(x.input for x in steps["apt"]),
        build_debs=tuple(x.input for x in steps["build"]), toolkit=toolkit, wheels=records(part.get("wheels", {})),
        sdists=tuple(records(meta.get("sdists", {})).values()), extras=records(extras.get("wheels", {})),
        extras_sdists=tuple(records(extras.get("sdists", {})).values()))
