"""One buildable image, a matrix row in one flavor with everything filled in: its name, its tags
and references, and its facts on each of its OS platforms."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from packaging.requirements import Requirement

from .schema import DEFAULT_OS_PLATFORMS, Layers, OSBase, Toolkit, major_of, minor_of


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
