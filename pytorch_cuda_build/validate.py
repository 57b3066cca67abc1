"""The command line's second stage: arguments.py parses, validate() checks, then completes.

Every argument is checked here, once, before Docker, the network, a lock or the disk is
touched: a value of the wrong form (what argparse's types and choices refused comes here too,
arguments.py), a file that is missing or of the wrong kind, a flag that does nothing beside
another (or contradicts it), and the row --torch, --cuda and --flavor pick. Every problem is
reported at once, as the matrix loader does: one line each naming the argument (both, for a
combination), exit 2.
A check that reads an argument already found wrong is skipped, so one mistake gives one line.
Nothing here writes, starts a process or opens a connection; files are only opened for reading.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import ssl
from pathlib import Path
from typing import Callable, Iterable

from . import arguments, jobs, matrix, scheduler, spec
from .commands import gpubundle
from .engine import docker_env
from .errors import BadFile, BadValue, UsageError, UsageErrors
from .jobs import mounts
from .registry import sign
from .stages import publish
from .tooling import bench

# The rules that read two arguments, declared with each command's options (arguments.py, jobs/options.py),
# listed here for the tests that make a case of each:
# (command, flag, the flag it needs, what it is for): the first does nothing without the second;
NEEDS = [(cls.NAME, *rule) for cls in arguments.COMMAND_OPTIONS.values() for rule in cls.NEEDS]
# (command, flag, flag, why): the two together contradict each other, or one does nothing;
CLASHES = [(cls.NAME, *rule) for cls in arguments.COMMAND_OPTIONS.values() for rule in cls.CLASHES]
# (command, flag, other flag, its values, why): the first does nothing, or cannot be honoured,
# unless the other has one of these values; defaults count (job's --runtime is oci under slurm).
ONLY_WITH = [(cls.NAME, *rule) for cls in arguments.COMMAND_OPTIONS.values() for rule in cls.ONLY_WITH]
JOB_DEFAULTS = {"runtime": lambda a: "oci" if a.scheduler == "slurm" else None}

NO_MATRIX = ("engine", "sbom", "selftest", "signing-key")  # commands that never read matrix.yaml
TORCH, CUDA, PYTHON = r"\d+\.\d+(\.\d+)?", r"\d+\.\d+", r"3\.\d+"
OPS_ARCH = r"\d+\.\d+a?(\+PTX)?(;\d+\.\d+a?(\+PTX)?)*"  # TORCH_CUDA_ARCH_LIST, as opsbuild.py takes it
CACHE_SPEC = r"type=[a-z]+(,.*)?"  # buildx's --cache-from/--cache-to: type=...,key=value


def flag(dest: str) -> str:
    return spec.flag_of(dest)


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user gave dest: a store_true set, a list with items, a value where the default is None."""
    value = getattr(args, dest, None)
    return value is not None and value is not False and value != []


class Checks:
    """Runs the checks, keeping every problem. Each check names the arguments it reads; one that
    reads an argument a problem was already found in is skipped (its line would say it again)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.failed: set[str] = set()

    def ok(self, *dests: str) -> bool:
        return not self.failed.intersection(dests)

    def fail(self, dests: tuple[str, ...] | str, message: str) -> None:
        dests = (dests,) if isinstance(dests, str) else dests
        if self.ok(*dests):
            self.problems.append(message)
        self.failed.update(dests)

    def run(self, dests: tuple[str, ...] | str, check: Callable[[], object]) -> None:
        """check() where none of dests has failed; a UsageError it raises is kept as a problem, and
        so is a BadValue or BadFile of the parsers it calls (the same rule, met before anything is touched)."""
        dests = (dests,) if isinstance(dests, str) else dests
        if not self.ok(*dests):
            return
        try:
            check()
        except UsageErrors as e:
            self.problems += e.problems
            self.failed.update(dests)
        except (UsageError, BadValue, BadFile) as e:
            self.fail(dests, str(e))


def validate(args: argparse.Namespace, default_matrix: Path | None = None) -> argparse.Namespace:
    """args checked (every problem raised at once, as UsageErrors) and completed: defaults filled in.
    With default_matrix (the project's matrix.yaml, where --matrix is not given), the row that
    --torch, --cuda and --flavor pick is looked up too."""
    c = Checks()
    for dest, problem in vars(args).pop(arguments.BAD, {}).items():  # what argparse's types and choices refused
        c.fail(dest, problem)
    _values(args, c)
    _files(args, c)
    _combinations(args, c)
    if default_matrix is not None:
        _row(args, c, args.matrix or default_matrix)
    if c.problems:
        raise UsageErrors(c.problems)
    # Options declared later=True (arguments.py) are None when not given, so that a flag given where it
    # does nothing can be told from its default: filled in now that the checks passed.
    spec.fill_defaults(arguments.COMMAND_OPTIONS[args.command], args)
    return args


def _values(args: argparse.Namespace, c: Checks) -> None:
    """Each value of the right form (argparse's types and choices already checked numbers and names)."""
    for dest, pattern, like in (("torch", TORCH, "a torch version like 2.7 or 2.7.1"), ("cuda", CUDA, "a CUDA version like 12.1")):
        value = getattr(args, dest, None)
        if value is not None and not re.fullmatch(pattern, value):
            c.fail(dest, f"{flag(dest)} takes {like}, not {value!r}")
    if c.ok("limit_mib") and getattr(args, "limit_mib", 1) < 1:
        c.fail("limit_mib", f"--limit-mib must be at least 1, not {args.limit_mib}")
    if getattr(args, "python", None) is not None and not re.fullmatch(PYTHON, args.python):
        c.fail("python", f"--python {args.python!r}: expected MAJOR.MINOR, e.g. 3.12")
    image = getattr(args, "image", None)  # test's --image, sbom's IMAGE (job's: _job_values; verify's: by digest)
    if image is not None and args.command == "verify":
        c.run("image", lambda: jobs.parse_image(image))
    elif image is not None and args.command != "job" and not re.fullmatch(r"\S+", image):
        c.fail("image", f"{'--image' if args.command in ('test', 'record') else 'IMAGE'} takes an image reference or ID, not {image!r}")
    for vid in getattr(args, "allow_vulnerable", []):
        if not re.fullmatch(r"[A-Za-z0-9][\w.:-]*", vid):
            c.fail("allow_vulnerable", f"--allow-vulnerable takes an advisory ID (e.g. GHSA-xxxx-xxxx-xxxx, PYSEC-2024-1), not {vid!r}")
    for dest in ("cache_from", "cache_to"):
        for text in getattr(args, dest, []):
            if not re.fullmatch(CACHE_SPEC, text):
                c.fail(dest, f"{flag(dest)} {text!r} is not buildx's type=...,key=value form (e.g. type=registry,ref=HOST/NS/cache:{{image}})")
    if args.command == "bench" and args.only is not None:
        c.run("only", lambda: bench.parse_only(args.only))
    if args.command == "job":
        _job_values(args, c)


# The forms of job's values. A path in the sbatch script is written in double quotes, so that
# $SLURM_SUBMIT_DIR expands: no quote, backslash, backquote, other $ or blank in it.
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
RDMA = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?=[1-9]\d*"
IFNAME = r"[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*"
SHARED_PATH = r"(/|\$SLURM_SUBMIT_DIR/|\$\{SLURM_SUBMIT_DIR\}/)[^\s\"'`\\$]*"
SCRIPT = r"[\w./+@%:,=-]+"


def _job_values(args: argparse.Namespace, c: Checks) -> None:
    if args.image is not None:
        c.run("image", lambda: jobs.parse_image(args.image))
    if args.name is not None and not (jobs.NAME.fullmatch(args.name) and len(args.name) <= jobs.NAME_MAX):
        c.fail("name", f"--name takes a lowercase DNS label (a-z, 0-9, -) of at most {jobs.NAME_MAX} characters, not {args.name!r}")
    if args.namespace is not None and not (jobs.NAME.fullmatch(args.namespace) and len(args.namespace) <= 63):
        c.fail("namespace", f"--namespace takes a Kubernetes namespace (a lowercase DNS label), not {args.namespace!r}")
    if args.cluster_runtime is not None and not re.fullmatch(DNS_SUBDOMAIN, args.cluster_runtime):
        c.fail("cluster_runtime", f"--cluster-runtime takes a ClusterTrainingRuntime's name (a lowercase DNS name), not {args.cluster_runtime!r}")
    c.run("shm_size", lambda: jobs.shm_mib(args.shm_size))
    if args.socket_ifname is not None and not re.fullmatch(IFNAME, args.socket_ifname):
        c.fail("socket_ifname", f"--socket-ifname takes NCCL_SOCKET_IFNAME's form (eth0, ^docker,lo, =ib0), not {args.socket_ifname!r}")
    for text in args.rdma:
        if not re.fullmatch(RDMA, text):
            c.fail("rdma", f"--rdma takes RESOURCE=COUNT, a device resource and a count of at least 1 (e.g. rdma/ib=1), not {text!r}")
    for dest, suffix in (("bundle", ""), ("sif", ".sif")):
        value = getattr(args, dest)
        if value is not None and not (re.fullmatch(SHARED_PATH, value) and value.endswith(suffix)):
            c.fail(dest, f"{flag(dest)} takes an absolute path{' to a ' + suffix + ' file' if suffix else ''} that every node "
                         f"sees (or one under $SLURM_SUBMIT_DIR/), without quotes, blanks or other $, not {value!r}")
    if args.memory_per_node is not None:
        c.run("memory_per_node", lambda: jobs.memory_mib(args.memory_per_node))
    if args.deadline is not None:
        c.run("deadline", lambda: jobs.deadline_seconds(args.deadline))
    for name in args.image_pull_secret:
        if not re.fullmatch(DNS_SUBDOMAIN, name):
            c.fail("image_pull_secret", f"--image-pull-secret takes a Secret's name (a lowercase DNS name: a-z, 0-9, - and .), not {name!r}")
    c.run("mount", lambda: mounts.parse_all(args.mount))
    if args.workdir is not None and not (re.fullmatch(SHARED_PATH, args.workdir) and ":" not in args.workdir
                                         and os.path.normpath(args.workdir) == args.workdir):
        c.fail("workdir", f"--workdir takes an absolute directory in the container (or one under $SLURM_SUBMIT_DIR/), in normal form, "
                          f"without quotes, blanks, : or other $, not {args.workdir!r}")
    c.run("script", lambda: _job_script(args.script))


def _job_script(command: list[str]) -> None:
    """SCRIPT [ARGS]: the script (or -m MODULE) is a path the sbatch script may put in double
    quotes; the ARGS are shell-quoted and go as they are."""
    if not command:
        raise UsageError("job needs SCRIPT [ARGS] after --, e.g. `-- train.py --epochs 3` (a path in the image, or -m MODULE)")
    script = command[1] if command[0] == "-m" and len(command) > 1 else command[0]
    if not re.fullmatch(SCRIPT, script) or script.startswith("-"):
        raise UsageError(f"SCRIPT takes a script path (or -m MODULE) of letters, digits and ./+@%:,=-, not {script!r}")


def _files(args: argparse.Namespace, c: Checks) -> None:
    """Files read exist, are readable and of the right kind; files written have a directory to go to."""
    if args.matrix is not None:
        c.run("matrix", lambda: _readable(args.matrix, "matrix file", "--matrix"))
    if getattr(args, "ca_bundle", None):
        c.run("ca_bundle", lambda: check_ca_bundle(args.ca_bundle))
    if getattr(args, "docker", None) and not shutil.which(args.docker):
        c.fail("docker", f"--docker {args.docker!r} is neither a program on PATH nor an executable file")
    snapshot = getattr(args, "security_snapshot", None)
    if snapshot is not None and not snapshot.is_dir():
        c.fail("security_snapshot", f"--security-snapshot {snapshot} is not a folder")
    if args.command == "fetch":
        if args.from_image is not None:
            c.run("from_image", lambda: jobs.parse_image(args.from_image, "--from-image"))
        if args.from_ is not None and not args.from_.is_dir():
            c.fail("from_", f"--from {args.from_} is not a folder")
        if args.to is not None:
            c.run("to", lambda: _writable_folder("--to", args.to))
    for dest in ("output", "result_json"):
        path = getattr(args, dest, None)
        if path is not None:
            c.run(dest, functools.partial(_writable_file, flag(dest), path, dir_ok=args.command == "job"))
    if args.command == "gpu-bundle":
        c.run("dir", lambda: gpubundle.check_target(args.dir))
        gpu_bundle_source(c, args)


def gpu_bundle_source(c: Checks, args: argparse.Namespace) -> None:
    """--ops-wheel, --build-python and --ops-arch: one wheel source, a file that is there, an arch list."""
    if args.ops_wheel is not None and args.build_python is not None:
        c.fail("build_python", "--build-python builds the ops wheel; --ops-wheel brings one built before: name one of them")
    if args.ops_wheel is not None and not args.ops_wheel.is_file():
        c.fail("ops_wheel", f"--ops-wheel {args.ops_wheel}: no such file")
    if args.build_python is not None and not shutil.which(args.build_python):
        c.fail("build_python", f"--build-python {args.build_python!r} is neither a program on PATH nor an executable file")
    if not re.fullmatch(OPS_ARCH, args.ops_arch):
        c.fail("ops_arch", f"--ops-arch {args.ops_arch!r}: expected TORCH_CUDA_ARCH_LIST's form, e.g. 9.0 or '8.0;9.0;10.0+PTX'")


def _readable(path: Path, what: str, name: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror} ({name})") from None


def check_ca_bundle(path: str) -> None:
    """A --ca-bundle holds at least one PEM certificate that OpenSSL loads (a DER file, a key or
    an empty file would fail every TLS handshake an hour into a build instead)."""
    _readable(Path(path), "CA bundle", "--ca-bundle")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
        found = ctx.cert_store_stats()["x509"]
    except (ssl.SSLError, ValueError):
        found = 0
    if not found:
        raise UsageError(f"--ca-bundle {path} holds no PEM certificate (no -----BEGIN CERTIFICATE----- block that loads)")


def _writable_file(name: str, path: Path, dir_ok: bool = False) -> None:
    if path.is_dir():
        if not dir_ok:
            raise UsageError(f"{name} {path} is a directory; name a file")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{name} {path} is not writable")
        return
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{name} {path}: {parent} is not a directory; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path}: {parent} is not writable")


def _writable_folder(name: str, path: Path) -> None:
    """A folder to write into: one that is writable, or one a writable folder can hold."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{name} {path} is not a folder")
    there = path if path.exists() else path.parent
    if not there.is_dir():
        raise UsageError(f"{name} {path}: {there} is not a folder; create it first")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path}: {there} is not writable")


def _combinations(args: argparse.Namespace, c: Checks) -> None:
    """Flags that do nothing without another, or contradict another; then each command's own rules."""
    command = args.command
    if command in NO_MATRIX and args.matrix is not None:
        c.fail("matrix", f"--matrix does nothing for `{command}`, which reads no matrix")
    declared = arguments.COMMAND_OPTIONS[command]  # the command's rules, declared with its options
    for dest, needed, why in declared.NEEDS:
        if given(args, dest) and not given(args, needed):
            c.fail((dest, needed), f"{flag(dest)} needs {flag(needed)}: {why}")
    for one, other, why in declared.CLASHES:
        if given(args, one) and given(args, other):
            c.fail((one, other), f"{flag(one)} and {flag(other)} do not go together: {why}")
    if command == "publish" or (command == "build" and args.push):
        # Its form only: no network. For build it is --push's registry: not asked for where --push was refused.
        # The address's form does not depend on --retries: checked even where --retries was refused.
        retries = (args.retries if c.ok("retries") else None) or arguments.BuildOptions.retries
        c.run(("registry", "push"), lambda: publish.registry(args.registry, retries))
        c.run(("push",), publish.retry_backoff)
    if command == "publish" and args.platform not in (None, "all", docker_env.host_platform()):
        c.fail("platform", f"publish --platform takes all (an index of every platform of the row) or this host's "
                           f"{docker_env.host_platform()}, not {args.platform}")
    if command == "verify":
        _verify_combinations(args, c)
    if command == "publish" and args.sign_key is not None and args.push:
        if args.signatures is not None and args.signatures.exists() and not args.signatures.is_dir():
            c.fail("signatures", f"--signatures {args.signatures} is not a directory")
        # The passphrase opens the key, before anything is pushed; not tried for a run already refused.
        c.run(("sign_key", "signatures"), lambda: sign.check_key(args.sign_key))
    if command == "signing-key":
        if args.folder.exists() and not args.folder.is_dir():
            c.fail("folder", f"FOLDER {args.folder} is not a directory")
        c.run("passphrase", sign.passphrase)
    if command == "test" and args.image and args.platform == "all":
        c.fail(("image", "platform"), "--image names one image: give its one --platform, not all")
    if command == "publish" and args.all == bool(args.torch):
        c.fail(("all", "torch"), "pick the rows: --torch X [--cuda Y] for one, or --all")
    if command == "bench" and args.full:
        c.run(("only", "yes"), lambda: bench.check_consent(bench.parse_only(args.only), args.yes))
        if c.ok("only") and args.pull_rows is not None and "pull" not in bench.parse_only(args.only):
            c.fail(("pull_rows", "only"), "--pull-rows picks the rows of the pull measure, and --only leaves it out")
    if command == "job":
        _job_combinations(args, c)


def _verify_combinations(args: argparse.Namespace, c: Checks) -> None:
    """verify picks its row with --torch, or takes it from --image's labels: one or the other."""
    if args.record is not None:
        if args.image is not None:
            c.fail(("image", "record"), "--image and --record do not go together: compare with a published image or with a record")
        if args.compile_ops:
            c.fail(("record", "compile_ops"), "--record and --compile-ops do not go together: --record builds nothing")
        if args.platform == "all":
            c.fail(("record", "platform"), "--record is one image's: give its one --platform, not all")
        if not args.record.is_file():
            c.fail("record", f"--record {args.record}: no such file (a record that `build.py record` wrote)")
    if args.image is None:
        if not args.torch:
            c.fail("torch", "verify needs the row: --torch X [--cuda Y], or a published image: --image REPO@sha256:...")
        if args.against is not None and args.record is None:
            c.fail("against", "--against needs --image or --record: it is what the published image or the record is compared with")
        if args.against is not None and not re.fullmatch(r"\S+", args.against):
            c.fail("against", f"--against takes a local image reference or ID, not {args.against!r}")
        return
    for dest in ("torch", "cuda", "compile_ops"):
        if given(args, dest):
            why = "the rebuild always compiles the ops" if dest == "compile_ops" else "the image's labels name its row"
            c.fail(("image", dest), f"--image and {flag(dest)} do not go together: {why}")
    if args.flavor != "runtime":
        c.fail(("image", "flavor"), "--image and --flavor do not go together: the image's labels name its row")
    if args.platform == "all":
        c.fail(("image", "platform"), "--image names one image: give its one --platform (of an index), not all")
    if args.against is not None and not re.fullmatch(r"\S+", args.against):
        c.fail("against", f"--against takes a local image reference or ID, not {args.against!r}")


def _job_combinations(args: argparse.Namespace, c: Checks) -> None:
    if args.scheduler == "kubernetes" and args.kind is None:
        c.fail(("scheduler", "kind"), "--scheduler kubernetes needs --kind: one of trainjob, pytorchjob, jobset, indexed-job")
    for dest, other, values, why in arguments.COMMAND_OPTIONS[args.command].ONLY_WITH:
        value = getattr(args, other) or (JOB_DEFAULTS[other](args) if other in JOB_DEFAULTS else None)
        if given(args, dest) and value not in values:
            c.fail((dest, other), f"{flag(dest)} needs {flag(other)} {' or '.join(values)}: {why}")
    if args.memory_per_node is not None and c.ok("memory_per_node", "shm_size") \
            and jobs.memory_mib(args.memory_per_node) <= jobs.shm_mib(args.shm_size):
        c.fail(("memory_per_node", "shm_size"), f"--memory-per-node {args.memory_per_node} must be larger than --shm-size "
               f"{args.shm_size}: a memory-backed /dev/shm counts against the pod's memory, which must also hold the "
               "processes' working memory")
    if args.qos == "guaranteed" and not (args.cpus_per_node and args.memory_per_node):
        c.fail(("qos", "cpus_per_node", "memory_per_node"), "--qos guaranteed needs --cpus-per-node and --memory-per-node: Guaranteed sets the limits equal to "
                      "the requests, and the job guesses neither")
    if args.scheduler == "slurm":
        if c.ok("mount"):
            claim = next((text for text in args.mount if mounts.parse(text).pvc), None)
            if claim is not None:
                c.fail(("mount", "scheduler"), f"--mount {claim!r} needs --scheduler kubernetes: pvc:CLAIM is a Kubernetes "
                       "PersistentVolumeClaim; under Slurm SOURCE is an absolute path on a filesystem every node mounts")
    elif args.workdir is not None and "$" in args.workdir and c.ok("workdir"):
        c.fail(("workdir", "scheduler"), f"--workdir {args.workdir!r} needs --scheduler slurm: $SLURM_SUBMIT_DIR is Slurm's; "
                                         "under Kubernetes it is an absolute directory in the container")


def _row(args: argparse.Namespace, c: Checks, path: Path) -> None:
    """The row --torch, --cuda and --flavor name is in the matrix (build --all: at least one row
    matches them). Read only: the matrix loader's own problems come back as they are. Every
    command with --torch picks a row with it (arguments._selection)."""
    if args.command == "publish" and args.all and args.sign_key is not None:
        c.run(("all", "sign_key", "matrix"), lambda: _signed_rows(matrix.load(path).images))
    if not getattr(args, "torch", None) or (args.command == "publish" and args.all):
        return
    if args.command == "build" and args.all:
        c.run(("torch", "cuda", "flavor", "matrix", "all"),
              lambda: scheduler.select_rows(matrix.load(path), args.torch, args.cuda, args.flavor))
        return
    picked: list[matrix.Image] = []  # the matrix read once
    c.run(("torch", "cuda", "flavor", "matrix"), lambda: picked.append(matrix.load(path).select(args.torch, args.cuda, args.flavor)))
    if not picked:
        return
    row = picked[0]
    if args.command == "publish" and args.sign_key is not None:
        c.run("sign_key", lambda: _signed_rows([row]))
    if args.command == "base" and row.os.kind == "registry":
        c.fail("torch", f"{row.name}'s base is the registry image {row.os.image}: it is pulled, never built")


def _signed_rows(rows: Iterable[matrix.Image]) -> None:
    """publish --sign-key signs images, not indexes: no row of several platforms among those published."""
    several = [i for i in rows if len(i.platforms) > 1]
    if several:
        raise UsageError(f"--sign-key signs single-platform rows' images; {several[0].name} is an index of "
                         f"{', '.join(several[0].platforms)}, which publish does not sign yet")
