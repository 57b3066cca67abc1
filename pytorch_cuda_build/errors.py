"""One exception hierarchy, caught once at the CLI and printed as one line.

Exit codes: 2 for bad input and for a machine that lacks what we need (the user must
fix the command, the files, Docker or the disk before retrying); 1 for a failed build
or test; 3 for `verify --image` when the row cannot be rebuilt here.

Each class says what kind of problem it is, so a caller can tell them apart:

    PipelineError
      UsageError        bad input to a command, found by validation (validate.py, arguments.py) and raised nowhere else
        UsageErrors     every such problem of one command line
      BadValue          a value not of the form it must have (an argument's, a variable's, a field's)
        NoSuchRow       the matrix has no row (or platform) that the values pick
      BadFile           a file or folder read or written is missing, unreadable or not what it must be
      NotReady          what a command needs is not here yet: an image not built, not tested, a record not written
      ImageUnfit        an image or row lacks what the command needs of it (its labels, its platform, its kind)
      RegistryRefused   a registry asks for credentials, or refused the ones given
      RegistryMismatch  a registry served something other than what was asked for
      MatrixError, LockError, ResolveError, InputUnavailable, RenderError, EnvironmentProblem, BuildError, TestFailure,
      PublishError, CommandFailed, ...: below
      EnvironmentProblem
        DockerRefused   the Docker daemon answered no (an HTTP error it sent)
        EngineLost      the Docker daemon stopped answering mid-run: refused or reset connections, a reply cut short, a timeout

Validation calls the parsers that raise BadValue, NoSuchRow and BadFile, and reports what
they raise as usage problems (one line each, exit 2): the same rule gives the same words
whether it is met before anything is touched or later.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class PipelineError(Exception):
    exit_code = 1

    def lines(self) -> list[str]:
        """What the CLI prints on stderr, one problem per line."""
        return [str(self)]


class UsageError(PipelineError):
    """Bad input to a command, found by validation before anything is touched: a value of the
    wrong form, a missing file, flags that clash, a row the matrix lacks. Raised by validation only."""

    exit_code = 2


class UsageErrors(UsageError):
    """Every problem of one command line, so a user fixes them in one pass (validate.py)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems[0])
        self.problems = problems

    def lines(self) -> list[str]:
        return self.problems


class BadValue(PipelineError):
    """A value not of the form it must have: an argument's, an environment variable's, or a
    field's read from a file. `name` says whose (e.g. --shm-size, PYTORCH_CUDA_PUBLISH_BACKOFF)."""

    exit_code = 2

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class NoSuchRow(BadValue):
    """The matrix has no row, or the row no platform, that --torch, --cuda, --flavor or --platform pick."""


class BadFile(PipelineError):
    """A file or folder a command reads or writes is missing, unreadable, or not what it must be
    (a record, a wheel, a snapshot, a signing key, an output folder); `path` is the one."""

    exit_code = 2

    def __init__(self, message: str, path: object = "") -> None:
        super().__init__(message)
        self.path = str(path)


class NotReady(PipelineError):
    """What a command needs is not here yet: an image not built or not tested here, a file a
    build writes not written; `ref` names it, and the message says what to run first."""

    exit_code = 2

    def __init__(self, message: str, ref: object = "") -> None:
        super().__init__(message)
        self.ref = str(ref)


class ImageUnfit(PipelineError):
    """An image (or a row) lacks what the command needs of it: the labels publish dates and
    names it by, the commit verify rebuilds, the platform or kind the command serves; `ref` is the image or row."""

    exit_code = 2

    def __init__(self, message: str, ref: object = "") -> None:
        super().__init__(message)
        self.ref = str(ref)


class RegistryRefused(PipelineError):
    """A registry asks for credentials that were not given, or refused the ones given; `host` is its address."""

    exit_code = 2

    def __init__(self, message: str, host: str = "") -> None:
        super().__init__(message)
        self.host = host


class RegistryMismatch(PipelineError):
    """A registry served something other than what was asked for: bytes of another digest, no
    manifest, an index without the platform; `ref` is what was asked for."""

    exit_code = 2

    def __init__(self, message: str, ref: object = "") -> None:
        super().__init__(message)
        self.ref = str(ref)


@dataclass
class Problem:
    """One thing wrong in a matrix file, with where it is."""

    where: str  # e.g. "rows[3].cudnn"
    message: str
    line: int | None = None

    def __str__(self) -> str:
        at = f"line {self.line}: " if self.line else ""
        return f"{at}{self.where}: {self.message}" if self.where else f"{at}{self.message}"


@dataclass
class MatrixError(PipelineError):
    """Every problem of one matrix file, so a user fixes them in one pass."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    exit_code = 2

    def __post_init__(self) -> None:
        super().__init__(self.path)

    def __str__(self) -> str:
        n = len(self.problems)
        return f"{self.path}: {n} problem{'s' if n != 1 else ''}"

    def lines(self) -> list[str]:
        return [f"{self.path}: {p}" for p in self.problems]


class LockError(PipelineError):
    """A lock is missing, stale, or disagrees with the torch wheel's metadata."""

    exit_code = 2


class ResolveError(PipelineError):
    """The package index could not resolve a row (network, or no such version)."""

    exit_code = 1


class InputUnavailable(PipelineError):
    """A file the lock names is not in the store, and its source cannot give it (gone from the
    mirror, unreachable, or other bytes than the lock's hash); `url` is the file's address.
    Nothing was built or tagged."""

    exit_code = 1

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class RenderError(PipelineError):
    """Rendered Dockerfiles drifted from templates/ and matrix.yaml."""

    exit_code = 2


class EnvironmentProblem(PipelineError):
    """The machine lacks something we need: a Docker daemon, a BuildKit client, disk."""

    exit_code = 2


@dataclass
class BuildError(PipelineError):
    """A build step failed; carries where the full log is and its tail."""

    step: str
    log_path: str
    tail: str = ""
    exit_code = 1

    def __post_init__(self) -> None:
        super().__init__(self.step)

    def __str__(self) -> str:
        return f"build failed at {self.step}; full log: {self.log_path}"

    def lines(self) -> list[str]:
        out = [str(self)]
        if self.tail:
            out += ["--- last lines of the log ---", self.tail.rstrip()]
        return out


@dataclass
class TestFailure(PipelineError):
    """The candidate image failed its smoke or structure tests; no tag moved."""

    suite: str
    detail: str
    log_path: str
    exit_code = 1

    def __post_init__(self) -> None:
        super().__init__(self.suite)

    def __str__(self) -> str:
        return f"{self.suite} failed: {self.detail}; full log: {self.log_path}; no tag moved"


@dataclass
class PublishError(PipelineError):
    """A push or its read-back failed; says where every tag of the run is now."""

    message: str
    where: list[str] = field(default_factory=list)
    exit_code = 1

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def lines(self) -> list[str]:
        return [self.message] + [f"  {w}" for w in self.where]


@dataclass
class DockerRefused(EnvironmentProblem):
    """The daemon answered, with an HTTP error: a refusal to name, not a daemon gone."""

    address: str
    during: str
    status: int | None
    explanation: str

    def __post_init__(self) -> None:
        super().__init__(self.during)

    def __str__(self) -> str:
        return f"the Docker daemon at {self.address} refused {self.during} ({self.status}: {self.explanation})"


@dataclass
class EngineLost(EnvironmentProblem):
    """The Docker daemon stopped answering mid-run: a connection refused or reset, a reply cut
    short, a timeout, or a server error with no daemon behind it any more. `stage` is the step it
    was lost in, `left` what that leaves as it was (the tags). Exit 2, as for any engine missing:
    nothing of the command was wrong, and the same command, run again once the engine answers,
    finishes the job."""

    address: str
    stage: str
    detail: str = ""
    left: str = "no tag was moved"

    def __post_init__(self) -> None:
        super().__init__(self.stage)

    def __str__(self) -> str:
        why = f" ({self.detail})" if self.detail else ""
        return f"the Docker daemon at {self.address} stopped answering during {self.stage}{why}; start it and run the same command again: {self.left}"


@dataclass
class CommandFailed(PipelineError):
    """An external command we needed exited non-zero (or could not run at all)."""

    command: str
    returncode: int | None
    detail: str = ""
    exit_code = 1

    def __post_init__(self) -> None:
        super().__init__(self.command)

    def __str__(self) -> str:
        how = f"exited {self.returncode}" if self.returncode is not None else "could not run"
        return f"`{self.command}` {how}" + (f": {self.detail}" if self.detail else "")


@dataclass
class ArchiveLayoutError(EnvironmentProblem):
    """`docker save` wrote an archive whose layout we cannot read (a Docker version we do not know)."""

    ref: str
    detail: str

    def __post_init__(self) -> None:
        super().__init__(self.ref)

    def __str__(self) -> str:
        return f"cannot read `docker save {self.ref}`: {self.detail}"


@dataclass
class TagTaken:
    """An immutable tag that the registry already holds at another image."""

    target: str  # REGISTRY/NS/REPO:TAG
    digest: str  # the registry's manifest digest
    config: str | None  # the image ID it holds
    image_id: str  # ours


@dataclass
class ImmutableTagTaken(PipelineError):
    """Immutable tags never move: pushing one that holds another image is refused, nothing pushed."""

    taken: list[TagTaken]
    exit_code = 2

    def __post_init__(self) -> None:
        super().__init__(self.taken[0].target)

    def __str__(self) -> str:
        return self.lines()[0]

    def lines(self) -> list[str]:
        return [f"{t.target} is immutable and already holds another image (registry: manifest {t.digest}, "
                f"config {t.config}; this image: {t.image_id}); nothing pushed" for t in self.taken]


class AdvisoryLookupError(PipelineError):
    """PyPI or Debian's security index could not be read, so nothing can be said about advisories."""

    # Not 1: `lock --check-security` exits 1 when it found advisories, and CI refreshes the locks on that.
    exit_code = 2


@dataclass
class VulnerableImage(PipelineError):
    """Critical advisories in an image's vulnerabilities.json that no --allow-vulnerable names; nothing pushed."""

    refused: dict[str, list[str]]  # image -> "ID (package version)" of each critical advisory not allowed
    exit_code = 2

    def __post_init__(self) -> None:
        super().__init__(next(iter(self.refused), ""))

    def __str__(self) -> str:
        return self.lines()[0]

    def lines(self) -> list[str]:
        return [f"{image} has {len(ids)} critical advisor{'y' if len(ids) == 1 else 'ies'} not allowed: {', '.join(ids)}; "
                f"nothing pushed (rebuild from refreshed locks, or name each with --allow-vulnerable ID)"
                for image, ids in self.refused.items()]


@dataclass
class BundleTooLarge(PipelineError):
    """A gpu-bundle over the size a GPU machine takes; nothing was written."""

    size: int  # bytes
    limit_mib: int
    largest: list[tuple[str, int]] = field(default_factory=list)  # (file, bytes), the biggest first
    beside: int = 0  # bytes that travel with it: the repository's tracked files
    exit_code = 2

    def __post_init__(self) -> None:
        super().__init__(self.size)

    def __str__(self) -> str:
        big = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in self.largest)
        with_repo = f" with the repository's {self.beside / 2**20:.1f} MiB of tracked files beside it" if self.beside else ""
        return (f"the bundle would be {self.size / 2**20:.1f} MiB{with_repo}, over the {self.limit_mib} MiB limit (--limit-mib; "
                f"a GPU machine takes 64) (largest: {big}); nothing written")
