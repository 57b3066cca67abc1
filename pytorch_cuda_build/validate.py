"""The command line's second stage: arguments.py parses, validate() checks, then completes.

Every argument is checked here, once, before Docker, the network, a lock or the disk is
touched: a value of the wrong form, a file that is missing or of the wrong kind, and a flag
that does nothing beside another (or contradicts it). Each problem is a UsageError: one
line naming the argument (both, for a combination), exit 2. Nothing here writes, starts a
process or opens a connection; files are only opened for reading.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import ssl
from pathlib import Path

from . import bench, publish
from .errors import UsageError

# Given as None by the parser, so that a flag given where it does nothing can be told from
# its default; filled in once the checks pass.
DEFAULTS = {"jobs": 1, "retries": 4, "cold_runs": 1}

# (command, flag, the flag it needs, what it is for): the first does nothing without the second.
NEEDS = [
    ("build", "jobs", "all", "it is how many rows --all builds at once"),
    ("build", "retries", "push", "it counts attempts per registry call, and only --push calls a registry"),
    ("build", "allow_vulnerable", "push", "it lets --push publish past an advisory, and without --push nothing is published"),
    ("lock", "record", "check_security", "it writes what --check-security finds"),
    ("lock", "security_snapshot", "check_security", "it answers --check-security's questions instead of the network"),
    ("bench", "only", "full", "it picks --full's measures"),
    ("bench", "cold_runs", "full", "it counts --full's cold builds"),
    ("bench", "yes", "full", "only --full empties the build cache"),
]

# (command, flag, flag, why): the two together contradict each other, or one does nothing.
CLASHES = [
    ("build", "dry_run", "all", "a dry run prints one row's plan"),
    *[("build", "dry_run", other, "a dry run only prints the plan: nothing is built, tested, cached or pushed")
      for other in ("push", "no_test", "retest", "no_cache", "require_gpu", "cache_from", "cache_to")],
    ("build", "no_test", "retest", "--no-test skips the tests that --retest would run again"),
    ("build", "no_test", "require_gpu", "--require-gpu is about the tests, which --no-test skips"),
    ("build", "no_test", "push", "--no-test sets no tag, so --push has nothing to publish"),
    ("build", "all", "result_json", "each row of --all writes its own result"),
    ("lock", "check", "upgrade", "--check only reads the locks (offline); --upgrade re-resolves and rewrites them"),
    ("lock", "check_security", "check", "--check-security only reads the locks; run it apart from --check and --upgrade"),
    ("lock", "check_security", "upgrade", "--check-security only reads the locks; run it apart from --check and --upgrade"),
    ("lock", "check", "ca_bundle", "--check is offline and uses no CA"),
    ("lock", "security_snapshot", "ca_bundle", "the snapshot answers instead of the network, which is the only use of a CA"),
    ("matrix", "json", "ca_bundle", "--json is offline and uses no CA"),
    ("engine", "down", "ca_bundle", "stopping the engine downloads nothing"),
    ("publish", "all", "cuda", "--all takes every row; --cuda picks among one --torch's rows"),
]

NO_MATRIX = ("engine", "sbom", "selftest")  # commands that never read matrix.yaml
TORCH, CUDA, PYTHON = r"\d+\.\d+(\.\d+)?", r"\d+\.\d+", r"3\.\d+"
CACHE_SPEC = r"type=[a-z]+(,.*)?"  # buildx's --cache-from/--cache-to: type=...,key=value


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user gave dest: a store_true set, a list with items, a value where the default is None."""
    value = getattr(args, dest, None)
    return value is not None and value is not False and value != []


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """args checked (the first problem raised as a UsageError) and completed: defaults filled in."""
    _values(args)
    _files(args)
    _combinations(args)
    for dest, value in DEFAULTS.items():
        if hasattr(args, dest) and getattr(args, dest) is None:
            setattr(args, dest, value)
    return args


def _values(args: argparse.Namespace) -> None:
    """Each value of the right form (argparse's types and choices already checked numbers and names)."""
    for dest, pattern, like in (("torch", TORCH, "a torch version like 2.7 or 2.7.1"), ("cuda", CUDA, "a CUDA version like 12.1")):
        value = getattr(args, dest, None)
        if value is not None and not re.fullmatch(pattern, value):
            raise UsageError(f"{flag(dest)} takes {like}, not {value!r}")
    if getattr(args, "limit_mib", 1) < 1:
        raise UsageError(f"--limit-mib must be at least 1, not {args.limit_mib}")
    if getattr(args, "python", None) is not None and not re.fullmatch(PYTHON, args.python):
        raise UsageError(f"--python {args.python!r}: expected MAJOR.MINOR, e.g. 3.12")
    image = getattr(args, "image", None)  # test's --image, sbom's IMAGE
    if image is not None and not re.fullmatch(r"\S+", image):
        raise UsageError(f"{'--image' if args.command == 'test' else 'IMAGE'} takes an image reference or ID, not {image!r}")
    for vid in getattr(args, "allow_vulnerable", []):
        if not re.fullmatch(r"[A-Za-z0-9][\w.:-]*", vid):
            raise UsageError(f"--allow-vulnerable takes an advisory ID (e.g. GHSA-xxxx-xxxx-xxxx, PYSEC-2024-1), not {vid!r}")
    for dest in ("cache_from", "cache_to"):
        for spec in getattr(args, dest, []):
            if not re.fullmatch(CACHE_SPEC, spec):
                raise UsageError(f"{flag(dest)} {spec!r} is not buildx's type=...,key=value form (e.g. type=registry,ref=HOST/NS/cache:{{image}})")
    if args.command == "bench" and args.only is not None:
        bench.parse_only(args.only)


def _files(args: argparse.Namespace) -> None:
    """Files read exist, are readable and of the right kind; files written have a directory to go to."""
    if args.matrix is not None:
        _readable(args.matrix, "matrix file", "--matrix")
    if getattr(args, "ca_bundle", None):
        check_ca_bundle(args.ca_bundle)
    if getattr(args, "docker", None) and not shutil.which(args.docker):
        raise UsageError(f"--docker {args.docker!r} is neither a program on PATH nor an executable file")
    snapshot = getattr(args, "security_snapshot", None)
    if snapshot is not None and not snapshot.is_dir():
        raise UsageError(f"--security-snapshot {snapshot} is not a folder")
    for dest in ("output", "result_json"):
        if getattr(args, dest, None) is not None:
            _writable_file(flag(dest), getattr(args, dest))
    if args.command == "gpu-bundle":
        from . import gpubundle
        gpubundle.check_target(args.dir)


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


def _writable_file(name: str, path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{name} {path} is a directory; name a file")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{name} {path}: {parent} is not a directory; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path}: {parent} is not writable")


def _combinations(args: argparse.Namespace) -> None:
    """Flags that do nothing without another, or contradict another; then each command's own rules."""
    command = args.command
    if command in NO_MATRIX and args.matrix is not None:
        raise UsageError(f"--matrix does nothing for `{command}`, which reads no matrix")
    for cmd, dest, needed, why in NEEDS:
        if cmd == command and given(args, dest) and not given(args, needed):
            raise UsageError(f"{flag(dest)} needs {flag(needed)}: {why}")
    for cmd, one, other, why in CLASHES:
        if cmd == command and given(args, one) and given(args, other):
            raise UsageError(f"{flag(one)} and {flag(other)} do not go together: {why}")
    if command == "publish" or (command == "build" and args.push):
        publish.registry(args.registry, args.retries or DEFAULTS["retries"])  # its form only: no network
    if command == "publish" and args.all == bool(args.torch):
        raise UsageError("pick the rows: --torch X [--cuda Y] for one, or --all")
    if command == "bench" and args.full:
        bench.check_consent(bench.parse_only(args.only), args.yes)
