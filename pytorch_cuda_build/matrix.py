"""The model every layer reads: matrix.yaml, the single source of truth, loaded in three steps.

parse (YAML, with line numbers) -> validate (schema, every problem at once) ->
complete (one `Image` per row and flavor, with its name, tags and platform facts).
Everything downstream (locks, Dockerfiles, tags, labels, README table, CI fan-out)
derives from the `Image` objects made here. It sits below the stages and their helpers, which
import it; it imports only errors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadFile, MatrixError, NoSuchRow, Problem

# SOURCE_DATE_EPOCH for BuildKit: 2026-01-01T00:00:00Z, one fixed time for every build, never the
# commit's. rewrite-timestamp clamps only the file times later than it, and a cached layer keeps
# the times of the build that made it. With the commit's time, a layer cached before the commit
# was made kept its own times while a cold build of that commit clamped them, so a build with a
# warm cache (CI's) and a user's cold rebuild of the same commit gave different digests (seen on
# Docker 26.1.5). Every build after this time clamps alike, cached or not. A recent time leaves
# most dates that packages ship their files with alone (Debian's timestamp-based .pyc files
# compare them); 0 would rewrite all. It is also the image config's `created` (docker images'
# CREATED); the commit's time is the org.opencontainers.image.created label. Changing this value
# changes the bytes of every image.
REPRODUCIBLE_EPOCH = 1767225600

# runtime: what users train in (with the compilers torch.compile needs); devel: runtime plus
# the CUDA toolkit (nvcc, headers, link libraries) that the row's DeepSpeed ops were built with;
# train: runtime plus the kernels large-scale training uses (matrix.yaml `train:`, docs/train.md),
# locked over the runtime's pins.
FLAVORS = ("runtime", "devel", "train")
Flavor = Literal["runtime", "devel", "train"]
# The sdists among the train extras' dependencies that are compiled in the image's builder stage
# (tebuild.py knows each one's recipe): PyPI has no wheel of them.
BUILT_EXTRAS = ("transformer-engine-torch",)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _version(what: str, parts: tuple[int, int], local: bool = False, exact: bool = True) -> Callable[[Any], str]:
    """A validator: a final release (PEP 440, no pre, post or dev part) of parts[0] to
    parts[1] numbers, a local part (+cu128) only where `local`. `exact`: written as PEP 440
    writes it, since the text becomes image names and tags; else digits and dots (NVIDIA
    writes drivers with leading zeros, 450.80.02)."""

    def check(value: Any) -> str:
        text = str(value)
        try:
            v: Version | None = Version(text)
        except InvalidVersion:
            v = None
        final = v is not None and not (v.epoch or v.is_prerelease or v.is_postrelease or (v.local and not local))
        written = v is not None and (str(v) == text if exact else text.replace(".", "").isdigit())
        if v is None or not (final and written and parts[0] <= len(v.release) <= parts[1]):
            raise ValueError(f"{text!r} is not a valid {what}")
        return text

    return check


def major_of(version: str) -> str:
    """'12.6' -> '12' (a CUDA major is the key of `toolkits:`)."""
    return str(Version(version).major)


def minor_of(version: str) -> str:
    """'2.7.1+cu126' -> '2.7'."""
    major, minor = Version(version).release[:2]
    return f"{major}.{minor}"


# A dated snapshot of a Debian archive: snapshot.debian.org/archive/<archive>/<YYYYMMDDTHHMMSSZ>.
# Its suites never change, so pinned versions stay fetchable and `apt-get upgrade` is
# repeatable; its signed Release files are kept as they were, Valid-Until long past.
_SNAPSHOT = re.compile(r"^https?://snapshot\.debian\.org/archive/[A-Za-z0-9._-]+/(\d{8}T\d{6}Z)/?$")


def snapshot_time(mirror: str | None) -> str | None:
    """The timestamp of a dated snapshot.debian.org mirror URL; None for any other mirror."""
    m = _SNAPSHOT.match(mirror or "")
    return m.group(1) if m else None


class AptSource(_Strict):
    """A suite beside the release's own: its security fixes, its stable updates."""

    mirror: str
    suite: str


class OSBase(_Strict):
    """Where a row's root filesystem comes from: built locally, or a pinned registry image."""

    kind: Literal["debootstrap", "registry"]
    python: str
    suite: str | None = None
    mirror: str | None = None
    variant: str = "minbase"
    image: str | None = None  # registry kind: name@sha256:<digest>
    # Debian packages of every image (Dockerfile.base) and of the ops builder stage;
    # `lock` pins each to the version the mirror's index holds.
    packages: tuple[str, ...] = ()
    build_packages: tuple[str, ...] = ()
    # Fixes on top of the release (its -security and -updates suites): every apt step reads
    # them too and the base upgrades to them; `lock` pins from the newest of all suites.
    updates: tuple[AptSource, ...] = ()

    _py = field_validator("python", mode="before")(_version("Python version (X.Y)", (2, 2)))

    @field_validator("image")
    @classmethod
    def _pinned(cls, value: str | None) -> str | None:
        if value is not None and not re.search(r"@sha256:[0-9a-f]{64}$", value):
            raise ValueError(f"{value!r} must be pinned by digest (name@sha256:<64 hex>)")
        return value

    @model_validator(mode="after")
    def _one_point_in_time(self) -> "OSBase":
        """A release read from a dated snapshot and its fixes from a live mirror (or another
        date) would rebuild differently tomorrow: all of them, or none, at one timestamp."""
        times = {snapshot_time(m) for m in (self.mirror, *(u.mirror for u in self.updates)) if m}
        if len(times) > 1:
            shown = ", ".join(sorted(t or "a live mirror" for t in times))
            raise ValueError(f"mirror and updates must all be snapshot.debian.org at one timestamp, or none of them; "
                             f"they read from {shown}")
        return self


class Toolkit(_Strict):
    """Where a CUDA major's compiler comes from: the one DeepSpeed's ops are built with.

    pypi: NVIDIA's wheels through `cuda-toolkit[extras]`, at exactly the version the torch
    wheel pins (CUDA 13). debian: a Debian suite's non-free `nvidia-cuda-toolkit`, for a
    major whose PyPI nvcc wheels carry no nvcc driver (CUDA 12: only ptxas); its minor may
    differ from torch's, which torch and DeepSpeed accept within a major, and the image says so.
    """

    source: Literal["pypi", "debian"]
    extras: tuple[str, ...] = ()  # pypi: cuda-toolkit extras beyond what torch pins
    mirror: str | None = None  # debian
    suite: str | None = None
    components: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    version: str | None = None  # debian: the package version to pin, checked by `lock`

    @field_validator("version")
    @classmethod
    def _debian_version(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^\d+\.\d+\.\d+~", value):
            raise ValueError(f"{value!r} is not a Debian CUDA toolkit version (e.g. 12.4.131~12.4.1-2)")
        return value

    @model_validator(mode="after")
    def _complete(self) -> "Toolkit":
        need = ("mirror", "suite", "components", "packages", "version") if self.source == "debian" else ("extras",)
        missing = [f for f in need if not getattr(self, f)]
        if missing:
            raise ValueError(f"a {self.source} toolkit needs {', '.join(missing)}")
        return self


# The OS/architecture platforms an image is built for, as BuildKit names them (`--platform`), and
# the Python platform tag uv resolves each one's wheels for. Not the CUDA platforms (the top-level
# `platforms:` of matrix.yaml, below), which name the CUDA an image promises the host.
OS_PLATFORMS = {"linux/amd64": "x86_64-manylinux_2_28", "linux/arm64": "aarch64-manylinux_2_28"}
OsPlatform = Literal["linux/amd64", "linux/arm64"]
DEFAULT_OS_PLATFORMS: tuple[OsPlatform, ...] = ("linux/amd64",)


class Platform(_Strict):
    """A CUDA platform an image promises the host: the driver it needs."""

    driver_min: str

    _drv = field_validator("driver_min", mode="before")(_version("driver version", (1, 3), exact=False))


class Layers(_Strict):
    """How the locked wheels are laid out in image layers (buildkit/layers.py). A wheel whose download
    is at least own_layer_min_mb MB gets a layer of its own, so that rows and refreshes that
    install the same file share that layer's blob; at most max_own_layers of them (the largest),
    far below Docker's limit of 127 layers. null: every wheel in one layer."""

    own_layer_min_mb: float | None = Field(5, gt=0)
    max_own_layers: int = Field(40, ge=1, le=80)


class Extra(_Strict):
    """One of the train flavor's extras: what to install, and where it can work.

    requirement: a PEP 508 requirement pinned with ==; `{version}` in it takes `versions` at the
    row's torch minor (torchao declares no torch requirement: its compatibility table is in its
    documentation). torch, wheel_cuda, cudnn: PEP 440 specifiers the row must meet, read from the
    package's metadata and documentation (`source` says where). build: a dependency PyPI has
    only as an sdist, compiled in the builder stage."""

    requirement: str
    purpose: str
    source: str
    versions: dict[str, str] = Field(default_factory=dict)
    torch: str | None = None
    wheel_cuda: str | None = None
    cudnn: str | None = None
    build: Literal["transformer-engine-torch"] | None = None

    @field_validator("versions", mode="before")
    @classmethod
    def _minor_keys(cls, value: Any) -> Any:
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else value

    @field_validator("torch", "wheel_cuda", "cudnn")
    @classmethod
    def _specifier(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ValueError(f"{value!r} is not a version specifier (e.g. >=9.12)") from None
        return value

    @model_validator(mode="after")
    def _pinned(self) -> "Extra":
        texts = [self.requirement.replace("{version}", v) for v in self.versions.values()] or [self.requirement]
        if "{version}" in self.requirement and not self.versions:
            raise ValueError("the requirement has {version} but no versions are listed")
        for text in texts:
            try:
                req = Requirement(text)
            except InvalidRequirement as e:
                raise ValueError(f"{text!r} is not a requirement: {e}") from None
            if len(req.specifier) != 1 or next(iter(req.specifier)).operator != "==":
                raise ValueError(f"{text!r} must pin one version with ==")
        return self

    def requirement_for(self, torch_minor: str) -> str | None:
        if "{version}" not in self.requirement:
            return self.requirement
        version = self.versions.get(torch_minor)
        return self.requirement.replace("{version}", version) if version else None

    def left_out_because(self, row: "Row") -> str | None:
        """Why this extra cannot work on the row, in a few words; None where it can."""
        minor = minor_of(row.torch)
        if self.requirement_for(minor) is None:
            return f"matrix.yaml lists no release for torch {minor} ({self.source})"
        unmet = [(what, spec, have) for what, spec, have in (
            ("torch", self.torch, Version(row.torch).base_version), ("CUDA", self.wheel_cuda, row.wheel_cuda), ("cuDNN", self.cudnn, row.cudnn))
            if spec and not SpecifierSet(spec).contains(have, prereleases=True)]
        if not unmet:
            return None
        return (f"needs {', '.join(f'{what} {spec}' for what, spec, _ in unmet)}; the row has "
                f"{', '.join(f'{what} {have}' for what, _, have in unmet)} ({self.source})")


class Defaults(_Strict):
    os: str
    # CPU baseline for the compiled DeepSpeed CPU ops (CPUAdam, shm_comm). DeepSpeed would
    # otherwise use the build host's CPU (-march=native, AVX-512 where present).
    cpu_arch: Literal["x86-64-v3", "x86-64-v4"] = "x86-64-v3"
    # The same for linux/arm64. armv8.2-a runs on every Arm server a GPU is attached to today
    # (Neoverse N1 and newer, Grace's V2 included); NEON is part of it, SVE is not.
    cpu_arch_arm64: Literal["armv8.2-a"] = "armv8.2-a"
    index: str = "https://pypi.org/simple"
    flavors: tuple[Flavor, ...] = ("runtime",)
    extra_requirements: tuple[str, ...] = ()
    # DeepSpeed ops compiled into every image's wheel for the `cuda` accelerator (names as
    # DeepSpeed's op builders call them); the build fails if any is missing. No default:
    # matrix.yaml names them, and render passes them on (Dockerfile, labels, manifest.json).
    prebuilt_ops: tuple[str, ...] = Field(min_length=1)
    # The OS platforms a row is locked (and later built) for; a row may list its own.
    platforms: tuple[OsPlatform, ...] = Field(DEFAULT_OS_PLATFORMS, min_length=1)
    layers: Layers = Field(default_factory=lambda: Layers())


class Row(_Strict):
    torch: str
    cuda: str = Field(description="CUDA platform the image promises the host")
    wheel_cuda: str = Field(description="CUDA build of the torch wheel (torch.version.cuda)")
    cudnn: str
    nccl: str
    deepspeed: str
    os: str | None = None
    index: str | None = None
    flavors: tuple[Flavor, ...] | None = None
    platforms: tuple[OsPlatform, ...] | None = None
    default: bool = False
    note: str | None = None

    _torch = field_validator("torch", "deepspeed", mode="before")(_version("full version (X.Y.Z)", (3, 3), local=True))
    _cuda = field_validator("cuda", "wheel_cuda", mode="before")(_version("CUDA version (X.Y)", (2, 2)))
    _libs = field_validator("cudnn", "nccl", mode="before")(_version("version", (2, 4)))


class MatrixFile(_Strict):
    repository: str = "pytorch-cuda"
    defaults: Defaults
    oses: dict[str, OSBase]
    platforms: dict[str, Platform]
    toolkits: dict[str, Toolkit] = Field(default_factory=dict)
    # The train flavor's extras, by name (docs/train.md).
    train: dict[str, Extra] = Field(default_factory=dict)
    rows: list[Row] = Field(min_length=1)

    @field_validator("platforms", "toolkits", mode="before")
    @classmethod
    def _platform_keys(cls, value: Any) -> Any:
        # YAML reads 12.1 as a float; a platform key is a version string.
        return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value

    @field_validator("repository")
    @classmethod
    def _repo(cls, value: str) -> str:
        if not re.match(r"^[a-z0-9]+([._/-][a-z0-9]+)*$", value):
            raise ValueError(f"{value!r} is not a valid image repository name")
        return value


@dataclass(frozen=True)
class Image:
    """One buildable image: a matrix row in one flavor, with everything filled in."""

    repository: str
    torch: str
    cuda: str
    wheel_cuda: str
    cudnn: str
    nccl: str
    deepspeed: str
    python: str
    os_name: str
    os: OSBase
    index: str
    flavor: str
    default: bool
    driver_min: str
    extra_requirements: tuple[str, ...]
    note: str | None
    cpu_arch: str = "x86-64-v3"
    toolkit: Toolkit | None = None
    prebuilt_ops: tuple[str, ...] = ()
    platforms: tuple[str, ...] = DEFAULT_OS_PLATFORMS  # OS platforms, linux/amd64 first where listed
    # The one OS platform this Image stands for in a build (`on`); cpu_arch is that platform's.
    platform: str = "linux/amd64"
    cpu_arches: tuple[tuple[str, str], ...] = (("linux/amd64", "x86-64-v3"), ("linux/arm64", "armv8.2-a"))
    layers: Layers = field(default_factory=lambda: Layers())
    # train flavor: (name, requirement) of each extra this row gets, (name, why) of each it does
    # not, and the sdists among their dependencies compiled in the builder stage.
    extras: tuple[tuple[str, str], ...] = ()
    extras_left_out: tuple[tuple[str, str], ...] = ()
    extras_built: tuple[str, ...] = ()

    @property
    def extras_pins(self) -> dict[str, str]:
        """name -> the version its requirement pins, for each extra the image has."""
        return {name: str(next(iter(Requirement(req).specifier)).version) for name, req in self.extras}

    def on(self, platform: str) -> "Image":
        """This row built for one of its platforms: its CPU baseline, lock folder and local names follow."""
        if platform not in self.platforms:
            raise ValueError(f"{self.name} is not locked for {platform}")
        return replace(self, platform=platform, cpu_arch=dict(self.cpu_arches)[platform])

    @property
    def arch(self) -> str:
        """The platform's architecture as Docker names it: amd64, arm64."""
        return self.platform.split("/", 1)[1]

    @property
    def local_name(self) -> str:
        """The row's name for one platform's local things (candidate tag, results, ops seed): the
        name itself for linux/amd64, so nothing of an amd64 build moved; `<name>-arm64` otherwise."""
        return self.name if self.platform == "linux/amd64" else f"{self.name}-{self.arch}"

    @property
    def cuda_major(self) -> str:
        return major_of(self.wheel_cuda)

    @property
    def torch_minor(self) -> str:
        return minor_of(self.torch)

    @property
    def name(self) -> str:
        """Directory under images/ and the row's own (moving) tag, e.g. 2.7.1-cuda12.1-runtime; publish adds a dated immutable one."""
        return f"{self.torch.replace('+', '-')}-cuda{self.cuda}-{self.flavor}"

    @property
    def lock_key(self) -> tuple[str, ...]:
        """Rows with equal keys resolve to the same lock (and share the torch layer)."""
        return (self.torch, self.deepspeed, self.python, self.index, *self.extra_requirements)

    @property
    def tags(self) -> list[str]:
        """The row's own tag first, then its aliases (all move with each new build of the row)."""
        suffix = "" if self.flavor == "runtime" else f"-{self.flavor}"
        tags = [self.name, f"v{self.torch_minor}-cuda{self.cuda}{suffix}"]
        if self.default:
            tags.append(f"v{self.torch_minor}{suffix}")
        return tags

    def refs(self) -> list[str]:
        return [f"{self.repository}:{t}" for t in self.tags]

    @property
    def require_cuda(self) -> str:
        """NVIDIA_REQUIRE_CUDA: the container runtime refuses hosts whose driver cannot run it."""
        return f"cuda>={self.cuda}"


@dataclass(frozen=True)
class Matrix:
    path: Path
    repository: str
    images: tuple[Image, ...]
    platforms: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # the train flavor's extras, in matrix.yaml's order

    def select(self, torch: str | None, cuda: str | None, flavor: str = "runtime") -> Image:
        """The one image a `--torch/--cuda/--flavor` selection names, or NoSuchRow listing what exists."""
        if torch is None:
            raise NoSuchRow("--torch is required (e.g. --torch 2.7); `build.py list` shows the matrix", name="--torch")
        if flavor not in FLAVORS:
            raise NoSuchRow(f"unknown --flavor {flavor!r}; allowed: {', '.join(FLAVORS)}", name="--flavor")
        same_torch = [i for i in self.images if torch in (i.torch, i.torch_minor)]
        if not same_torch:
            known = sorted({i.torch_minor for i in self.images}, key=Version)
            raise NoSuchRow(f"no row for torch {torch}; torch versions in {self.path.name}: {', '.join(known)}", name="--torch")
        hits = [i for i in same_torch if i.flavor == flavor and (cuda is None and i.default or i.cuda == cuda)]
        if cuda is None and not hits:
            hits = [i for i in same_torch if i.flavor == flavor]
            if len(hits) == 1:
                return hits[0]
            raise NoSuchRow(f"torch {torch} has no default row; pick --cuda from: {_choices(same_torch)}", name="--cuda")
        if not hits:
            raise NoSuchRow(f"no row for torch {torch} with CUDA {cuda} ({flavor}); rows for torch {torch}: {_choices(same_torch)}", name="--cuda")
        return hits[0]

    def by_name(self, name: str) -> Image:
        for image in self.images:
            if image.name == name:
                return image
        raise NoSuchRow(f"no image named {name!r} in {self.path.name}", name=name)


def _choices(images: list[Image]) -> str:
    return ", ".join(sorted({f"cuda {i.cuda} ({i.flavor}{', default' if i.default else ''})" for i in images}))


# ---- parse -------------------------------------------------------------------


def _line_map(node: yaml.Node, path: tuple[Any, ...] = (), out: dict | None = None) -> dict:
    """Map every key path in the YAML document to its 1-based line number."""
    out = {} if out is None else out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = path + (key.value,)
            out[child] = key.start_mark.line + 1
            _line_map(value, child, out)
            out[child] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out)
    return out


class _NoDuplicateKeys(yaml.SafeLoader):
    """A repeated key in a mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse(path: Path) -> tuple[Any, dict]:
    try:
        text = path.read_text()
    except OSError as e:
        raise BadFile(f"cannot read matrix file {path}: {e.strerror}", path=path) from None
    try:
        node = yaml.compose(text, Loader=_NoDuplicateKeys)
        data = yaml.load(text, Loader=_NoDuplicateKeys)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        reason = getattr(e, "problem", None) or str(e)
        raise MatrixError(str(path), [Problem("", f"malformed YAML: {reason}", line)]) from None
    if node is None or not isinstance(data, dict):
        raise MatrixError(str(path), [Problem("", "expected a mapping with defaults, oses, platforms and rows", 1)])
    return data, _line_map(node)


# ---- validate and complete -----------------------------------------------------


def _schema_problems(err: ValidationError, lines: dict) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        problems.append(Problem(where, msg, line))
    return problems


def _row_problems(spec: MatrixFile, lines: dict) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[tuple, int] = {}
    defaults: dict[str, int] = {}
    for i, row in enumerate(spec.rows):
        at = lines.get(("rows", i))
        where = f"rows[{i}]"
        os_name = row.os or spec.defaults.os
        if os_name not in spec.oses:
            problems.append(Problem(where + ".os", f"unknown OS {os_name!r}; defined: {', '.join(spec.oses)}", at))
        if row.cuda not in spec.platforms:
            problems.append(Problem(where + ".cuda", f"unknown CUDA platform {row.cuda}; defined: {', '.join(spec.platforms)}", at))
        if major_of(row.wheel_cuda) not in spec.toolkits:
            problems.append(Problem(where + ".wheel_cuda", f"no CUDA toolkit for CUDA {major_of(row.wheel_cuda)}.x under toolkits; defined: {', '.join(spec.toolkits) or 'none'}", at))
        if major_of(row.cuda) != major_of(row.wheel_cuda):
            problems.append(Problem(where, f"wheel CUDA {row.wheel_cuda} and platform CUDA {row.cuda} differ in major version; minor-version compatibility does not cross majors", at))
        elif Version(row.wheel_cuda) != Version(row.cuda) and not row.note:
            problems.append(Problem(where + ".note", f"platform CUDA {row.cuda} uses the CUDA {row.wheel_cuda} wheel: say why in a note", at))
        key = (row.torch, row.cuda)
        if key in seen:
            problems.append(Problem(where, f"duplicate row torch {row.torch} cuda {row.cuda} (first at line {seen[key]})", at))
        seen.setdefault(key, at or 0)
        listed = spec.defaults.platforms if row.platforms is None else row.platforms
        if len(set(listed)) != len(listed):
            problems.append(Problem(where + ".platforms", f"a platform listed twice: {', '.join(listed)}", at))
        if "linux/amd64" not in listed:
            problems.append(Problem(where + ".platforms", "linux/amd64 is missing: every row is built for it, other platforms beside it", at))
        flavors = row.flavors or spec.defaults.flavors
        if "train" in flavors and "runtime" not in flavors:
            problems.append(Problem(where + ".flavors", "train is locked over the row's runtime: list runtime too", at))
        if "train" in flavors and not any(e.left_out_because(row) is None for e in spec.train.values()):
            why = "; ".join(f"{n}: {e.left_out_because(row)}" for n, e in spec.train.items()) or "train: lists none"
            problems.append(Problem(where + ".flavors", f"no train extra can work on this row ({why})", at))
        if row.default:
            minor = minor_of(row.torch)
            if minor in defaults:
                problems.append(Problem(where + ".default", f"second default for torch {minor} (first at line {defaults[minor]})", at))
            defaults.setdefault(minor, at or 0)
    return problems


def _complete(spec: MatrixFile, path: Path) -> Matrix:
    images = []
    for row in spec.rows:
        os_name = row.os or spec.defaults.os
        base = spec.oses[os_name]
        for flavor in row.flavors or spec.defaults.flavors:
            train = flavor == "train"
            images.append(
                Image(
                    repository=spec.repository, torch=row.torch, cuda=row.cuda, wheel_cuda=row.wheel_cuda,
                    cudnn=row.cudnn, nccl=row.nccl, deepspeed=row.deepspeed, python=base.python,
                    os_name=os_name, os=base, index=row.index or spec.defaults.index, flavor=flavor,
                    default=row.default, driver_min=spec.platforms[row.cuda].driver_min,
                    extra_requirements=spec.defaults.extra_requirements, note=row.note,
                    cpu_arch=spec.defaults.cpu_arch,
                    cpu_arches=(("linux/amd64", spec.defaults.cpu_arch), ("linux/arm64", spec.defaults.cpu_arch_arm64)),
                    toolkit=spec.toolkits[major_of(row.wheel_cuda)],
                    prebuilt_ops=spec.defaults.prebuilt_ops, layers=spec.defaults.layers,
                    platforms=tuple(sorted(row.platforms or spec.defaults.platforms, key=list(OS_PLATFORMS).index)),
                    extras=tuple((n, req) for n, e in spec.train.items()  # left in: it has a requirement (left_out_because)
                                 if train and e.left_out_because(row) is None and (req := e.requirement_for(minor_of(row.torch))) is not None),
                    extras_left_out=tuple((n, why) for n, e in spec.train.items()
                                          if train and (why := e.left_out_because(row)) is not None),
                    extras_built=tuple(e.build for e in spec.train.values() if train and e.build and e.left_out_because(row) is None),
                )
            )
    return Matrix(path=path, repository=spec.repository, images=tuple(images), platforms=tuple(spec.platforms),
                  extras=tuple(spec.train))


def load(path: Path) -> Matrix:
    """Parse, validate and complete a matrix file; raise MatrixError with every problem."""
    data, lines = parse(path)
    try:
        spec = MatrixFile.model_validate(data)
    except ValidationError as e:
        raise MatrixError(str(path), _schema_problems(e, lines)) from None
    problems = _row_problems(spec, lines)
    if problems:
        raise MatrixError(str(path), problems)
    return _complete(spec, path)


# Where CI builds each platform natively: GitHub's hosted runners, or self-hosted GPU runners.
RUNNERS = {"linux/amd64": ("ubuntu-latest", ["self-hosted", "linux", "x64", "gpu"]),
           "linux/arm64": ("ubuntu-24.04-arm", ["self-hosted", "linux", "arm64", "gpu"])}


def as_json(m: Matrix) -> dict:
    """The builds for a CI fan-out (GitHub Actions: strategy.matrix: ${{ fromJSON(...) }}): one
    entry per row and platform, each for a runner of that platform (built natively)."""
    return {"include": [{
        "image": i.name, "torch": i.torch, "torch_minor": i.torch_minor, "cuda": i.cuda,
        "wheel_cuda": i.wheel_cuda, "flavor": i.flavor, "default": i.default,
        "tags": i.tags, "refs": i.refs(), "cudnn": i.cudnn, "nccl": i.nccl, "deepspeed": i.deepspeed,
        "build_args": f"--torch {i.torch} --cuda {i.cuda} --flavor {i.flavor}", "platforms": list(i.platforms),
        "platform": p, "arch": p.split("/")[1], "runner": RUNNERS[p][0], "gpu_runner": RUNNERS[p][1],
    } for i in m.images for p in i.platforms]}


def indexes_json(m: Matrix) -> dict:
    """The rows built on several platforms, whose per-platform images CI merges into one index."""
    return {"include": [{"image": i.name, "build_args": f"--torch {i.torch} --cuda {i.cuda} --flavor {i.flavor}",
                         "platforms": list(i.platforms)} for i in m.images if len(i.platforms) > 1]}
