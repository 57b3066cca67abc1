"""matrix.yaml's schema: what each key may hold, checked by pydantic, one class per mapping
(the file, its defaults, OSes, CUDA platforms, toolkits, rows and the train flavor's extras), and
the vocabulary the rest of the model shares (flavors, OS platforms, the fixed build time)."""
from __future__ import annotations

import re
from typing import Any, Callable, Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
