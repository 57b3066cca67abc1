"""Stage 1: lock. Resolve each row once (network) into committed files under images/<image>/.

  requirements.lock  every package of the image's Python environment, hash-pinned,
                     except DeepSpeed (installed only with --only-binary wheels)
  deepspeed.lock     the DeepSpeed sdist, hash-pinned; built into a wheel with
                     prebuilt ops in the image's builder stage
  toolkit.lock       the CUDA compiler the ops are built with: hash-pinned wheels (pypi)
                     or .deb addresses with the sha256 of a signed Debian index (debian)
  lock.json          what the lock was made from (inputs), the facts read from the
                     torch wheel, the base's identity, hashes of the three files, and
                     the wheel file (name, sha256, size) each pin installs (`wheels`,
                     wheel_files.py), from which render lays out the layers (layers.py)
  linux-arm64/       for a row that lists linux/arm64 beside linux/amd64: that platform's
                     requirements.lock and toolkit.lock, resolved from the aarch64 wheels'
                     own metadata; lock.json's `platforms` holds their inputs, facts and hashes

A train image (matrix.yaml `train:`) holds its runtime sibling's files, byte for byte, and beside
them, for each platform:
  extras.lock        the extras and what they add, hash-pinned wheels, resolved with every
                     runtime pin as a constraint (no runtime pin moves)
  extras-build.lock  the sdists among them compiled in the builder stage (tebuild.py)
lock.json's `extras` holds each platform's inputs, pins, wheel files and the files' hash.

`check` is offline: it recomputes the inputs from matrix.yaml and compares.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from ..errors import LockError, ResolveError
from ..files import sha256_text, write_atomic
from ..matrix import OS_PLATFORMS, Image, Matrix
from ..resolve import debian as resolve_debian
from ..resolve import pypi as resolve_pypi
from ..resolve import wheel_files

LOCK_SCHEMA = 3  # 3: lock.json records each pin's wheel file (`wheels`)
LOCK_FILES = ("requirements.lock", "deepspeed.lock", "toolkit.lock")
PLATFORM_LOCK_FILES = ("requirements.lock", "toolkit.lock")  # the DeepSpeed sdist is the same on every platform
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


def apt_pins(image: Image, ca_bundle: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(pins, fixes) of the image's Debian packages, when its OS names a mirror to read them from.

    pins: each named package at its newest version across the release and its update suites.
    fixes: the newest version in the update suites of every package the image can install
    (the named ones, their dependencies, the release's required set): the floor the image's
    structure check holds every installed package to."""
    names = [*image.os.packages, *image.os.build_packages]
    if not names or not (image.os.mirror and image.os.suite):
        return {}, {}
    suites = resolve_debian.DebianSuites(image.os.mirror, image.os.suite,
                                  tuple((u.mirror, u.suite) for u in image.os.updates), ca_bundle)
    return suites.newest(names), suites.fixes(names)


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


def render_lock(image: Image, lock_text: str, apt: tuple[dict[str, str], dict[str, str]] = ({}, {}),
                toolkit: tuple[str, str] = ("", ""), platforms: dict[str, dict] | None = None,
                wheels: dict[str, dict] | None = None) -> dict[str, str]:
    """The files of one image's lock, as text: the four of linux/amd64, and those of each other
    platform (render_platform) under its directory, which lock.json vouches for too."""
    facts = resolve_pypi.wheel_facts(lock_text)
    agree(image, facts)
    wheel_lock, built = split(lock_text)
    req = _header(image, "wheels, installed with --require-hashes") + wheel_lock
    ds = _header(image, "sdists built into wheels in the builder stage") + built
    tk_text, tk_version = toolkit
    meta = {
        "schema": LOCK_SCHEMA,
        "image": image.name,
        "inputs": inputs(image),
        "inputs_sha256": sha256_text(json.dumps(inputs(image), sort_keys=True)),
        "wheel": asdict(facts),
        "pins": resolve_pypi.pins(lock_text),
        "apt": apt[0],
        "apt_fixes": apt[1],
        "cuda_toolkit": tk_version,
        "files_sha256": sha256_text(req, ds, tk_text),
        "wheels": wheels or {},
    }
    return _with_platforms({"requirements.lock": req, "deepspeed.lock": ds, "toolkit.lock": tk_text}, meta, platforms or {})


def _with_platforms(files: dict[str, str], meta: dict, platforms: dict[str, dict]) -> dict[str, str]:
    """files, each other platform's files under its directory, and lock.json vouching for all."""
    meta = {k: v for k, v in meta.items() if k != "platforms"}
    if platforms:  # only a row that lists more than linux/amd64 has the key: the others' lock.json stays as it was
        meta["platforms"] = {p: part["meta"] for p, part in sorted(platforms.items())}
        files = {**files, **{f"{p.replace('/', '-')}/{n}": t for p, part in platforms.items() for n, t in part["files"].items()}}
    return {**files, "lock.json": json.dumps(meta, indent=2, sort_keys=True) + "\n"}


def render_platform(image: Image, platform: str, lock_text: str, toolkit: tuple[str, str], deepspeed_lock: str,
                    wheels: dict[str, dict] | None = None) -> dict:
    """A platform beside linux/amd64: its files and its part of lock.json. Its torch wheel must
    carry the CUDA, cuDNN and NCCL the row names, and its DeepSpeed sdist be linux/amd64's."""
    facts = platform_facts(image, platform, lock_text)
    wheel_lock, built = split(lock_text)
    if _header(image, "sdists built into wheels in the builder stage") + built != deepspeed_lock:
        raise LockError(f"{image.name}: the DeepSpeed sdist resolved for {platform} is not linux/amd64's")
    req = _header(image, f"{platform} wheels, installed with --require-hashes", platform) + wheel_lock
    tk_text, tk_version = toolkit
    return {"files": {"requirements.lock": req, "toolkit.lock": tk_text},
            "meta": {"inputs": platform_inputs(image, platform), "wheel": asdict(facts),
                     "pins": resolve_pypi.pins(lock_text), "cuda_toolkit": tk_version,
                     "files_sha256": sha256_text(req, tk_text), "wheels": wheels or {}}}


def write(root: Path, matrix: Matrix, images: list[Image], ca_bundle: str | None, log: Callable[[str], None] = print,
          exclude_newer: str | None = None, keep_current: bool = False) -> None:
    """Resolve each distinct lock once per platform and write it for every image that shares it.

    exclude_newer freezes the package index at that ISO 8601 time; None means
    $PYTORCH_CUDA_EXCLUDE_NEWER, and without it the index as it is now (see resolve_pypi.frozen_at).
    keep_current: a platform whose lock is current keeps it as committed (pins, Debian packages
    and all), and only the stale ones are resolved: adding linux/arm64 to a row refreshes nothing
    else, and a lock of an older schema only gains what the new one records (its wheel files).
    """
    exclude_newer = resolve_pypi.frozen_at(exclude_newer)
    if exclude_newer:
        log(f"package index frozen at {exclude_newer} ({resolve_pypi.EXCLUDE_NEWER_ENV})")
    resolved: dict[tuple, str] = {}
    toolkits: dict[tuple, tuple[str, str]] = {}
    found_files: dict[tuple, dict] = {}
    indexes: dict[str, wheel_files.Index] = {}
    rendered: list[tuple[Image, dict[str, str]]] = []

    def resolve(image: Image, platform: str) -> tuple[str, tuple[str, str]]:
        key = (*image.lock_key, platform)
        if key not in resolved:
            log(f"resolving {' '.join(resolve_pypi.requirements_for(image))} for Python {image.python} on {platform}")
            resolved[key] = resolve_pypi.compile_lock(image, ca_bundle, exclude_newer=exclude_newer, platform=platform)
            if platform != "linux/amd64":
                platform_facts(image, platform, resolved[key])  # no CUDA there: say so before resolving a toolkit
        if key not in toolkits:
            log(f"resolving the CUDA {image.cuda_major} toolkit for torch {image.torch} on {platform}")
            toolkits[key] = resolve_toolkit(image, resolved[key], ca_bundle, exclude_newer, platform)
        return resolved[key], toolkits[key]

    def files_of(image: Image, platform: str, wheel_lock: str, glibc: str | None) -> dict:
        key = (image.index, image.python, platform, glibc, sha256_text(wheel_lock))
        if key not in found_files:
            log(f"reading the wheel file of each pin for {platform} from {image.index}")
            index = indexes.setdefault(image.index, wheel_files.Index(image.index, ca_bundle))
            found_files[key] = wheel_files.wheel_files(wheel_lock, image.python, platform, index, glibc)
        return found_files[key]

    # A train image is locked over its runtime sibling: relocking the runtime relocks it too.
    written = {i.name for i in images}
    trains = [i for i in images if i.flavor == "train"] + [
        t for t in matrix.images if t.flavor == "train" and t.name not in written and runtime_of(t).name in written]
    for image in [i for i in images if i.flavor != "train"]:  # resolve everything first: nothing is written if any row fails
        if keep_current and not amd64_problems(root, image, migrating=True):
            meta = read(root, image)
            files = {name: (image_dir(root, image) / name).read_text() for name in LOCK_FILES}
            glibc = wheel_files.glibc_of({**meta.get("apt_fixes", {}), **meta.get("apt", {})})
            extra = {}
            for p in extra_platforms(image):
                extra[p] = _kept_platform(root, image, p, meta) or render_platform(image, p, *resolve(image, p), files["deepspeed.lock"])
                if not extra[p]["meta"].get("wheels"):
                    extra[p]["meta"]["wheels"] = files_of(image, p, extra[p]["files"]["requirements.lock"], glibc)
            wheels = meta.get("wheels") or files_of(image, "linux/amd64", files["requirements.lock"], glibc)
            rendered.append((image, _with_platforms(files, {**meta, "schema": LOCK_SCHEMA, "wheels": wheels}, extra)))
            continue
        lock_text, toolkit = resolve(image, "linux/amd64")
        apt = apt_pins(image, ca_bundle)
        glibc = wheel_files.glibc_of({**apt[1], **apt[0]})
        ds = _header(image, "sdists built into wheels in the builder stage") + split(lock_text)[1]
        extra = {}
        for p in extra_platforms(image):
            text, tk = resolve(image, p)
            extra[p] = render_platform(image, p, text, tk, ds, files_of(image, p, split(text)[0], glibc))
        wheels = files_of(image, "linux/amd64", split(lock_text)[0], glibc)
        rendered.append((image, render_lock(image, lock_text, apt, toolkit, extra, wheels)))
    by_name = {image.name: files for image, files in rendered}
    for image in trains:  # over their runtime sibling's lock: as rendered just now, or as committed
        base = by_name.get(runtime_of(image).name) or committed_runtime(root, image)
        meta = json.loads(base["lock.json"])
        glibc = wheel_files.glibc_of({**meta.get("apt_fixes", {}), **meta.get("apt", {})})
        parts = {}
        for p in image.platforms:
            runtime_lock = base[_in_platform("requirements.lock", p)] + base["deepspeed.lock"]
            log(f"resolving the train extras of {image.name} over its runtime lock on {p}")
            text = resolve_pypi.compile_extras(image, runtime_lock, ca_bundle, exclude_newer, p)
            wheel_lock, built = split_extras(image, text, runtime_lock, p)
            parts[p] = render_extras(image, p, runtime_lock, wheel_lock, built, files_of(image, p, wheel_lock, glibc))
        rendered.append((image, with_extras(image, base, parts)))
    for image, files in rendered:
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


def render_extras(image: Image, platform: str, runtime_lock: str, wheel_lock: str, built: str, wheels: dict) -> dict:
    """A platform's extras files and its part of lock.json's `extras`."""
    head = (f"# GENERATED by `python build.py lock` for {image.name}: the train extras over the runtime lock "
            f"({', '.join(r for _, r in image.extras)}), resolved with uv for Python {image.python} on "
            f"{OS_PLATFORMS[platform]} from {image.index}")
    files = {"extras.lock": f"{head}; wheels, installed with --require-hashes. DO NOT EDIT.\n" + wheel_lock,
             "extras-build.lock": f"{head}; sdists compiled in the builder stage. DO NOT EDIT.\n" + built}
    return {"files": files, "meta": {"inputs": extras_inputs(image, platform, runtime_lock),
                                     "pins": resolve_pypi.pins(wheel_lock), "built": resolve_pypi.pins(built),
                                     "files_sha256": sha256_text(*files.values()), "wheels": wheels}}


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
                   or not str(w.get("file", "")).endswith(".whl") or not isinstance(w.get("size"), int) or w["size"] <= 0)
    return [f"{image.name}: lock.json's {platform} wheel file of {', '.join(wrong[:5])} is not one requirements.lock allows{fix}"] if wrong else []


def amd64_problems(root: Path, image: Image, migrating: bool = False) -> list[str]:
    """Why the linux/amd64 part of the committed lock is not current, offline. migrating: a lock
    of an older schema, current otherwise, passes (`write` keeps it and adds what is new)."""
    try:
        meta = read(root, image)
    except LockError as e:
        return [str(e)]
    d = image_dir(root, image)
    out = []
    schema_ok = meta.get("schema") in ((2, LOCK_SCHEMA) if migrating else (LOCK_SCHEMA,))
    if not schema_ok or meta.get("inputs") != inputs(image):
        out.append(f"{image.name}: lock is stale against matrix.yaml; run `python build.py lock`")
    try:
        files = [(d / n).read_text() for n in LOCK_FILES]
        if sha256_text(*files) != meta.get("files_sha256"):
            out.append(f"{image.name}: {', '.join(LOCK_FILES)}: one was edited or half-written; run `python build.py lock`")
        elif not migrating:
            out += wheel_problems(image, "linux/amd64", files[0], meta.get("wheels"))
    except FileNotFoundError as e:
        out.append(f"{image.name}: missing {Path(e.filename).name}; run `python build.py lock`")
    try:
        agree(image, resolve_pypi.WheelFacts(**meta.get("wheel", {})))
    except (LockError, TypeError) as e:
        out.append(str(e) if isinstance(e, LockError) else f"{image.name}: lock.json lacks wheel facts")
    return out


def check(root: Path, images: list[Image]) -> None:
    found = [p for image in images for p in problems(root, image)]
    if found:
        raise LockError("; ".join(found))
