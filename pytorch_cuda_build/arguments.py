"""The command line's arguments: every command of build.py as a frozen dataclass, one field per
option with its help, type and default (spec.py), from which the parser is built. Bad arguments
are UsageErrors (one line each, exit 2) like every other bad input: validate.py reports them."""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from . import spec
from .errors import UsageErrors
from .jobs.options import JobOptions
from .matrix import Image
from .spec import Command, flag, many, opt
from .tooling import bench, engine_current

COMPRESSIONS = ("gzip", "zstd")  # publish's layer compression (registry/zstd.py)

BAD = "_bad_arguments"  # the namespace's {dest: problem} of values argparse's types or choices refused


class _Parser(argparse.ArgumentParser):
    """argparse, except that a value its type or choices refuse is kept as a problem (the value
    left None, or as given) instead of ending the parse: validate() reports it with every other
    problem of the command line at once, and skips the checks that read it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bad: dict[str, str] = {}

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:  # type: ignore[override]
        self._bad = {}
        ns, extras = super().parse_known_args(args, namespace)
        # A subcommand's parser ran inside this one and copied its namespace, BAD included, into ns.
        self._bad = {**getattr(ns, BAD, {}), **self._bad}
        setattr(ns, BAD, self._bad)
        return ns, extras

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            self._bad.setdefault(action.dest, f"{e} (see --help)")
            return None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction):
            return super()._check_value(action, value)
        if action.dest in self._bad:  # its type refused it already
            return None
        try:
            return super()._check_value(action, value)
        except argparse.ArgumentError as e:
            self._bad[action.dest] = f"{e} (see --help)"
            return None

    def error(self, message: str) -> NoReturn:  # each problem one line, exit 2, like every other bad input
        raise UsageErrors([*self._bad.values(), f"{message} (see --help)"])


# What Docker's --keep-storage takes (go-units RAMInBytes): bytes, or a number with k/m/g/t/p,
# an optional i and an optional b, in either case (10GB, 512mb, 10GiB, 1.5g, 1048576).
SIZE = re.compile(r"\d+(\.\d+)? ?([kmgtp]i?)?b?", re.IGNORECASE)


def docker_size(text: str) -> str:
    """A size as Docker's CLI takes it, passed on as the user wrote it."""
    if not SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 40GB, 512MB, 10GiB, or bytes)")
    return text



# ---- the registry options build and publish share ------------------------------------------

def _registry() -> Any:
    return opt(None, "HOST[:PORT]/NAMESPACE (default: $PYTORCH_CUDA_REGISTRY)", env="PYTORCH_CUDA_REGISTRY")


def _retries() -> Any:
    return opt(4, "attempts per registry call (default 4, exponential backoff)", type=spec.positive_int, later=True)


def _allow_vulnerable() -> Any:
    return many("publish despite this critical advisory of vulnerabilities.json (its ID or an alias); repeatable", metavar="ID")


ATTACHED_INPUTS = ("debian", "all", "none")  # publish's inputs artifact (registry/attach.py)


def _attach_inputs() -> Any:
    return opt("debian", "the locked files attached beside each pushed image, for a rebuild whose sources are gone: debian (default: "
                         "the .debs and indexes, which Debian's mirror drops), all (the wheels and sdists too), none",
               choices=ATTACHED_INPUTS, later=True)


def _compression() -> Any:
    return opt("gzip", "the pushed layers: gzip (default: as the engine holds them; every Docker pulls them) or zstd "
                       "(the containerd image store; Docker >= 23 and containerd >= 1.5 pull them, Docker 20.10 cannot)",
               choices=COMPRESSIONS, later=True)


# ---- the commands, in `build.py --help`'s order --------------------------------------------

@dataclass(frozen=True)
class BuildOptions(spec.Rows):
    NAME: ClassVar[str] = "build"
    HELP: ClassVar[str] = "build, test and tag one row (the default command), or many with --all"
    GROUPS: ClassVar[dict[str, bool]] = {"shown": False}
    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("jobs", "all", "it is how many rows --all builds at once"),
        ("retries", "push", "it counts attempts per registry call, and only --push calls a registry"),
        ("allow_vulnerable", "push", "it lets --push publish past an advisory, and without --push nothing is published"),
        ("compression", "push", "it is how --push compresses the layers it pushes, and without --push nothing is pushed"),
        ("attach_inputs", "push", "it is what --push attaches beside the image, and without --push nothing is pushed"))
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("dry_run", "all", "a dry run prints one row's plan"),
        ("platform", "all", "--all builds every row for this host's platform; --platform picks one row's platforms"),
        *[("dry_run", other, "a dry run only prints the plan: nothing is built, tested, cached or pushed")
          for other in ("push", "no_test", "retest", "no_cache", "require_gpu", "cache_from", "cache_to")],
        ("no_test", "retest", "--no-test skips the tests that --retest would run again"),
        ("no_test", "require_gpu", "--require-gpu is about the tests, which --no-test skips"),
        ("no_test", "push", "--no-test sets no tag, so --push has nothing to publish"),
        ("all", "result_json", "each row of --all writes its own result"))

    all: bool = flag("every row (of --torch, if given): each built, tested and tagged as on its own")
    platform: str | None = spec.platform()
    jobs: int = opt(1, "with --all: rows built at once (default 1; shared layers are built once)", type=spec.positive_int, later=True)
    docker: str | None = spec.docker()
    ca_bundle: str | None = spec.ca_bundle("CA bundle for HTTPS inside the build (default: pip's configured cert)")
    no_test: bool = flag("build only; sets no public tag")
    retest: bool = flag("test even if this image ID already passed")
    no_cache: bool = flag("build without the layer cache")
    require_gpu: bool = flag("fail instead of testing on the CPU when no GPU runtime exists")
    dry_run: bool = flag("print the plan without calling Docker")
    cache_from: tuple[str, ...] = many("import BuildKit's cache (buildx; e.g. type=registry,ref=HOST/NS/pytorch-cuda-cache:{image}); "
                                       "repeatable", metavar="SPEC")
    cache_to: tuple[str, ...] = many("export BuildKit's cache (buildx on the containerd store; add mode=max for every stage); repeatable",
                                     metavar="SPEC")
    quiet: bool = flag("show no build progress (the log is still saved)", group="shown")
    verbose: bool = flag("stream BuildKit's raw log instead of one line per step", group="shown")
    result_json: Path | None = opt(None, argparse.SUPPRESS, type=Path)  # where a child of --all writes its RowResult
    registry: str | None = _registry()
    push: bool = flag("after tagging, publish the row (see `publish`)")
    retries: int = _retries()
    allow_vulnerable: tuple[str, ...] = _allow_vulnerable()
    compression: str = _compression()
    attach_inputs: str = _attach_inputs()

    def child_argv(self, image: Image, result_json: Path, ca_path: str | None) -> list[str]:
        """This build for one row of --all: its child's command line (after build.py), with the CA
        bundle already found and the RowResult written to result_json."""
        return spec.argv(dataclasses.replace(self, torch=image.torch, cuda=image.cuda, flavor=image.flavor, all=False, jobs=1,
                                             result_json=result_json, ca_bundle=ca_path, registry=self.registry if self.push else None))


@dataclass(frozen=True)
class ListOptions(Command):
    NAME: ClassVar[str] = "list"
    HELP: ClassVar[str] = "the matrix: what can be built, what is built"


@dataclass(frozen=True)
class MatrixOptions(Command):
    NAME: ClassVar[str] = "matrix"
    HELP: ClassVar[str] = "the matrix for machines: --json rows for the GitHub workflow's fan-out, --propose new torch releases"
    GROUPS: ClassVar[dict[str, bool]] = {"mode": True}
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("json", "ca_bundle", "--json is offline and uses no CA"),
        ("indexes", "ca_bundle", "--indexes is offline and uses no CA"))

    json: bool = flag("every row and platform with its tags, build arguments and runner, as JSON", group="mode")
    indexes: bool = flag("the rows built on several platforms, whose images the GitHub workflow merges into one index, as JSON", group="mode")
    propose: bool = flag("candidate rows for torch releases on the index that the matrix lacks (network)", group="mode")
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class PublishOptions(spec.Rows):
    NAME: ClassVar[str] = "publish"
    HELP: ClassVar[str] = "push tested images and their tags to a registry (dry run without --push)"
    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("sign_key", "push", "it signs what --push pushes, and without --push nothing is pushed"),
        ("signatures", "sign_key", "it is where --sign-key's signatures go"))
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("all", "cuda", "--all takes every row; --cuda picks among one --torch's rows"),
        ("merge", "platform", "--merge makes the index of every platform from the registry's parts"),
        ("merge", "allow_vulnerable", "--merge pushes no image, only the index of parts each build published"),
        ("merge", "compression", "--merge pushes no image, only the index of the parts each build published, "
                                 "compressed as they were pushed"),
        ("merge", "attach_inputs", "--merge pushes no image, only the index of the parts each build published, with their inputs"))

    all: bool = flag("every row of the matrix (each must be built and tested)")
    platform: str | None = spec.platform("all: one image index of each row's platforms, every one built and tested here (build --platform "
                                         "all); default: this host's platform: its image, or for a row on several platforms its part "
                                         "<dated>-<arch>")
    merge: bool = flag("a row on several platforms: one index of the parts each platform's build published (the GitHub workflow's merge job)")
    registry: str | None = _registry()
    push: bool = flag("push for real; without it, print what would move")
    retries: int = _retries()
    allow_vulnerable: tuple[str, ...] = _allow_vulnerable()
    compression: str = _compression()
    attach_inputs: str = _attach_inputs()
    ca_bundle: str | None = spec.ca_bundle("CA bundle for an HTTPS registry (default: pip's configured cert)")
    sign_key: Path | None = opt(None, "with --push: sign each row's image (GPG, containers' simple signing) with the key signing-key "
                                      "wrote in FOLDER; its passphrase in $PYTORCH_CUDA_SIGN_PASSPHRASE", type=Path, metavar="FOLDER")
    signatures: Path | None = opt(None, "with --sign-key: the lookaside directory the signatures go to, to be served over HTTP(S) "
                                        "(default: build-results/signatures)", type=Path, metavar="DIR")


@dataclass(frozen=True)
class SigningKeyOptions(Command):
    NAME: ClassVar[str] = "signing-key"
    HELP: ClassVar[str] = ("make a GPG signing key for publish --sign-key in FOLDER/gnupg, its public half in "
                           "FOLDER/signing-key.pub.asc; passphrase from $PYTORCH_CUDA_SIGN_PASSPHRASE")

    folder: Path = opt(Path(), "where to write them (created if absent; an existing key is never replaced)", type=Path, kind="positional")


@dataclass(frozen=True)
class LockOptions(spec.Rows):
    NAME: ClassVar[str] = "lock"
    HELP: ClassVar[str] = "resolve rows into images/<image>/ lock files (network)"
    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("record", "check_security", "it writes what --check-security finds"),
        ("security_snapshot", "check_security", "it answers --check-security's questions instead of the network"))
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("check", "upgrade", "--check only reads the locks (offline); --upgrade re-resolves and rewrites them"),
        ("check_security", "check", "--check-security only reads the locks; run it apart from --check and --upgrade"),
        ("check_security", "upgrade", "--check-security only reads the locks; run it apart from --check and --upgrade"),
        ("check", "ca_bundle", "--check is offline and uses no CA"),
        ("security_snapshot", "ca_bundle", "the snapshot answers instead of the network, which is the only use of a CA"))

    check: bool = flag("fail if any lock is stale (offline)")
    upgrade: bool = flag("re-resolve and print the version changes")
    check_security: bool = flag("list locked Python packages with advisories and Debian pins behind the security suite; "
                                "exit 1 if any (network)")
    record: bool = flag("with --check-security: write images/<image>/security.json (the README table's counts)")
    security_snapshot: Path | None = opt(None, "with --check-security: recorded answers instead of the network (pypi.json, "
                                               "<suite>-security.Packages)", type=Path, metavar="DIR")
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class FetchOptions(spec.Row):
    NAME: ClassVar[str] = "fetch"
    HELP: ClassVar[str] = ("download every file a row's lock names into the store, once, checked by its sha256 (a build does this "
                           "first); or carry them: --to writes them to a folder, --from fills the store from one (an air-gapped host)")
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("to", "from_", "--from fills this host's store from a folder, --to writes the store's files to one: one at a time"),
        ("from_", "from_image", "each names where the files come from: a folder or an image, one at a time"),
        ("from_", "ca_bundle", "--from reads a folder, not the network, which is the only use of a CA"))

    platform: str | None = spec.platform()
    to: Path | None = opt(None, "also write the row's files to this folder (FOLDER/sha256/<hex> and FOLDER/INDEX), for a host "
                                "without the network", type=Path, metavar="FOLDER")
    from_: Path | None = opt(None, "fill the store from this folder (one `fetch --to` wrote, or the files by name) instead of the "
                                   "network; a file of other bytes than the lock's is refused", type=Path, metavar="FOLDER")
    from_image: str | None = opt(None, "fill the store from the files attached beside this published image (`publish` attaches "
                                       "them), HOST[:PORT]/NAMESPACE/NAME@sha256:<64 hex>; then the network for what it lacks",
                                 metavar="REF")
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class RenderOptions(Command):
    NAME: ClassVar[str] = "render"
    HELP: ClassVar[str] = "render images/<image>/Dockerfile (offline)"

    check: bool = flag("fail on drift from templates/ and the locks")


@dataclass(frozen=True)
class ImageTestOptions(spec.Row):
    NAME: ClassVar[str] = "test"
    HELP: ClassVar[str] = "run the smoke and structure tests against a built image"

    image: str | None = opt(None, "image reference or ID to test (default: the row's own tag)")
    platform: str | None = spec.platform()
    require_gpu: bool = flag()


@dataclass(frozen=True)
class VerifyOptions(spec.Rows):
    NAME: ClassVar[str] = "verify"
    HELP: ClassVar[str] = ("build a row twice without cache and compare the images file by file; with --image, rebuild a published "
                           "image's row from this checkout and compare")

    image: str | None = opt(None, "a published image, HOST[:PORT]/NAMESPACE/NAME@sha256:<64 hex>: its labels name the commit and the "
                                  "row; exit 0 same, 1 different, 2 bad input, 3 not rebuildable here")
    against: str | None = opt(None, "with --image or --record: compare with this local image instead of rebuilding (--record: default "
                                    "the row's own tag)", metavar="LOCAL")
    record: Path | None = opt(None, "compare the row's local image with a record (`build.py record`, another machine's build): exit 0 "
                                    "the same image, 1 another; the differing layers and files are named", type=Path, metavar="FILE")
    compile_ops: bool = flag("compile the DeepSpeed ops in both builds instead of taking the host's ops seed, as a rebuild on a fresh "
                             "machine does (each build then compiles them: docs/ops.md gives the time)")
    platform: str | None = spec.platform()
    docker: str | None = spec.docker()
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class RecordOptions(spec.Row):
    NAME: ClassVar[str] = "record"
    HELP: ClassVar[str] = ("write a local image's record for another machine to compare its build with: the image and config "
                           "digests, the config, every layer's files (xz-compressed JSON)")

    image: str | None = opt(None, "local image reference or ID (default: the row's own tag)")
    output: Path | None = opt(None, "where to write it, a new .json.xz (default: build-results/<image>/record.json.xz)", type=Path,
                              metavar="FILE")
    platform: str | None = spec.platform()
    docker: str | None = spec.docker()


@dataclass(frozen=True)
class BaseOptions(spec.Row):
    NAME: ClassVar[str] = "base"
    HELP: ClassVar[str] = ("build (or, --rebuild, build anew) a row's local base and say whether it is the recorded one: its "
                           "diff_id, image ID and the mirror state it came from")

    rebuild: bool = flag("build the base anew even if this machine has it")
    record: bool = flag("write its identity to images/<image>/base.json of every row that shares this base")
    platform: str | None = spec.platform()
    docker: str | None = spec.docker()  # no --ca-bundle: mmdebstrap reads the mirror's signed indexes over HTTP


@dataclass(frozen=True)
class SbomOptions(Command):
    NAME: ClassVar[str] = "sbom"
    HELP: ClassVar[str] = "CycloneDX SBOM (Python and Debian packages) of any local image"

    image: str = opt("", "image reference or ID", kind="positional")
    output: Path | None = opt(None, "file to write (default: stdout)", type=Path)


@dataclass(frozen=True)
class BenchOptions(spec.Row):
    NAME: ClassVar[str] = "bench"
    HELP: ClassVar[str] = "measure (never assert): --full for size, build times and banner, else the banner only"
    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("only", "full", "it picks --full's measures"),
        ("cold_runs", "full", "it counts --full's cold builds"),
        ("yes", "full", "only --full empties the build cache"),
        ("pull_rows", "full", "it picks the rows of --full's pull measure"))

    runs: int = opt(10, "repetitions of the quick measurements (default 10)", type=spec.positive_int)
    full: bool = flag("every benchmark; report in bench/ (cold builds, two naive images, the matrix and pull measures: the "
                      "longest command this tool has; --only picks some; empties the build cache for the cold builds)")
    cold_runs: int = opt(1, "with --full: cold builds of each kind (default 1)", type=spec.positive_int, later=True)
    only: str | None = opt(None, "with --full: comma list of " + ",".join(bench.MEASURES) + " (default: every one)")
    pull_rows: int | None = opt(None, "with --only pull: build the first N CUDA 13 rows, oldest first (default: every one)",
                                type=spec.positive_int, metavar="N")
    yes: bool = flag("allow the cold and matrix measures to empty this daemon's whole build cache")
    docker: str | None = spec.docker()
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class SelftestOptions(Command):
    NAME: ClassVar[str] = "selftest"
    HELP: ClassVar[str] = "this project's own test suite (sets up Docker first)"

    pytest_args: tuple[str, ...] = opt((), "extra pytest arguments", kind="rest")


@dataclass(frozen=True)
class EngineOptions(Command):
    NAME: ClassVar[str] = "engine"
    HELP: ClassVar[str] = ("bring up a current Docker Engine (26, buildx) beside this host's; prints the environment that points "
                           "build.py at it (root)")
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = (("down", "ca_bundle", "stopping the engine downloads nothing"),)

    store: str = opt("containerd", "image store: containerd (default, Docker 29's) or classic", choices=tuple(engine_current.STORES))
    down: bool = flag("stop that engine instead")
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class GpuBundleOptions(spec.Row):
    NAME: ClassVar[str] = "gpu-bundle"
    HELP: ClassVar[str] = ("write DIR: DeepSpeed with the row's ops prebuilt, libaio, wheels, smoke suite and run.sh, to prove the "
                           "row's GPU half on a GPU machine without Docker, network or compiler (`bash DIR/run.sh` there)")

    dir: Path = opt(Path(), "new or empty directory to write", type=Path, kind="positional", metavar="DIR")
    python: str | None = opt(None, "the GPU machine's Python, MAJOR.MINOR (default: the row's)")
    build_python: str | None = opt(None, "the Python of that version (with its headers) that builds the ops wheel here (default: "
                                         "found: pythonX.Y or python3 on PATH, `uv python find X.Y`, pyenv's versions)", metavar="PATH")
    ops_wheel: Path | None = opt(None, "a DeepSpeed wheel with the row's ops built before, for that Python and the row's torch, instead "
                                       "of building one", type=Path, metavar="FILE")
    ops_arch: str = opt("9.0", "TORCH_CUDA_ARCH_LIST the ops are built for (default 9.0: H100, H200; e.g. '8.0;9.0;10.0')",
                        metavar="LIST")
    limit_mib: int = opt(64, "refuse a bundle that, with the repository's tracked files beside it, is larger than this (default 64)",
                         type=int)
    ca_bundle: str | None = spec.ca_bundle()


@dataclass(frozen=True)
class PruneOptions(Command):
    NAME: ClassVar[str] = "prune"
    HELP: ClassVar[str] = "remove candidate images and bound the build cache"

    keep_storage: str = opt("40GB", "build cache to keep (default 40GB)", type=docker_size)


COMMAND_OPTIONS: dict[str, type[Command]] = {c.NAME: c for c in (
    BuildOptions, ListOptions, MatrixOptions, PublishOptions, SigningKeyOptions, LockOptions, FetchOptions, RenderOptions, ImageTestOptions,
    VerifyOptions, RecordOptions, BaseOptions, SbomOptions, BenchOptions, SelftestOptions, EngineOptions, GpuBundleOptions,
    JobOptions, PruneOptions)}
COMMANDS = ("build", "list", "matrix", "lock", "fetch", "render", "test", "publish", "prune", "selftest", "bench", "sbom", "verify", "record",
            "base", "signing-key", "engine", "gpu-bundle", "job")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="build.py", description="Build, test and tag pinned PyTorch + CUDA images from matrix.yaml.")
    p.add_argument("--matrix", type=Path, help=spec.Command.__dataclass_fields__["matrix"].metadata[spec.KEY].help)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for cls in COMMAND_OPTIONS.values():
        spec.add_command(sub, cls)
    return p


def options(args: argparse.Namespace, **given: Any) -> Any:
    """The frozen, typed options of validated arguments (its command's class): what a handler gets."""
    return spec.complete(COMMAND_OPTIONS[args.command], args, **given)
