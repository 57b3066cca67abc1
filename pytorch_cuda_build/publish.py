"""Stage 8: publish tested images to a registry.

Only an image ID recorded as tested is pushed. Each row's immutable tag is dated:
`<row>-<YYYYMMDD>-<lock8>`, the source commit's day (UTC) and the lock's hash, both read
from the image's labels so the tag is a fact of the artefact. It never moves: one that
the registry holds at another image is refused before anything is pushed. Every
immutable tag of the run goes first and is read back from the registry (manifest digest
and config digest = the local image ID) before any moving tag (the row's name, the
aliases) moves, so a failure part-way leaves them where they were. A tag already
holding this image is skipped. Pushing happens only with push=True: the default is a
dry run that prints what would move. Before the registry is contacted, `screen` refuses
an image whose vulnerabilities.json (security.py) lists a critical advisory not allowed.

A locally built base rootfs goes first, under an immutable tag that names its image ID
(`pytorch-cuda-rootfs:bookworm-<recipe>-<id12>`): debootstrap gives every machine another
base, and a rebuild from the commit has one digest with the publisher's only on the same base.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker
import docker.auth
import docker.errors
import requests
import tenacity

from . import docker_env, render, security
from . import tag as tags
from .errors import EnvironmentProblem, ImmutableTagTaken, PublishError, TagTaken, UsageError
from .files import write_atomic
from .matrix import Image
from .render import LABEL_PREFIX

_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # the distribution spec's path component
_ADDRESS = re.compile(rf"^(?P<host>{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::(?P<port>[0-9]+))?/(?P<ns>{_PATH}(?:/{_PATH})*)$")
_PUSHED_DIGEST = re.compile(r"\bdigest: (sha256:[0-9a-f]{64})\b")
# Push errors worth retrying: the registry or the network hiccuped. Anything else
# (unauthorized, denied, a malformed name) fails the same way every time.
_PERMANENT = re.compile(r"unauthori[sz]ed|denied|authentication required|invalid reference|name unknown", re.I)
USER_ENV, PASSWORD_ENV = "PYTORCH_CUDA_REGISTRY_USER", "PYTORCH_CUDA_REGISTRY_PASSWORD"
BASE_LABEL = "org.opencontainers.image.base.digest"  # the local image ID of the base the row was built on
CREATED_LABEL = "org.opencontainers.image.created"  # the source commit's time (not SOURCE_DATE_EPOCH: build.REPRODUCIBLE_EPOCH)
LOCK_LABEL = f"{LABEL_PREFIX}.lock-sha256"
_LOCK_HASH = re.compile(r"^[0-9a-f]{64}$")


class Transient(Exception):
    """Worth another attempt: connection refused/reset, 5xx, a push stream error."""


@dataclass(frozen=True)
class Registry:
    host: str  # as written, with the port: what docker tags and pushes carry
    namespace: str

    @classmethod
    def parse(cls, text: str) -> "Registry":
        m = _ADDRESS.match(text or "")
        if not m:
            raise UsageError(f"malformed registry address {text!r}: expected HOST[:PORT]/NAMESPACE, e.g. 127.0.0.1:5000/ml (no scheme, lowercase namespace)")
        if m["port"] is not None and not 0 < int(m["port"]) < 65536:
            raise UsageError(f"malformed registry address {text!r}: port {m['port']} is not 1-65535")
        host = m["host"] + (f":{m['port']}" if m["port"] else "")
        return cls(host, m["ns"])

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}"

    def repository(self, image: Image) -> str:
        return f"{self.host}/{self.namespace}/{image.repository}"

    @property
    def loopback(self) -> bool:
        name = self.host.rsplit(":", 1)[0] if not self.host.startswith("[") else self.host[1:self.host.index("]")]
        if name == "localhost":
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def credentials(reg: Registry) -> dict | None:
    """From the environment, else the Docker config (docker login). Never printed."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user or password:
        if not (user and password):
            raise UsageError(f"set both {USER_ENV} and {PASSWORD_ENV}, or neither")
        return {"username": user, "password": password}
    found = docker.auth.resolve_authconfig(docker.auth.load_config(), reg.host) or {}
    found = {k.lower(): v for k, v in found.items()}
    if found.get("username") and found.get("password"):
        return {"username": found["username"], "password": found["password"]}
    return None


@dataclass(frozen=True)
class Remote:
    digest: str  # manifest digest: what `pull REPO@DIGEST` takes
    config: str | None  # config digest: the classic store's image ID


class RegistryAPI:
    """Reads a tag's manifest with skopeo (containers/image: the client of podman and CRI-O),
    which speaks the distribution API with Basic and Bearer-token auth, TLS and redirects.
    Pushes go through the Docker daemon (push_one); this is only the read-back. Credentials
    reach skopeo through a private auth file, never its command line."""

    def __init__(self, reg: Registry, creds: dict | None, ca_bundle: str | None, timeout: float = 30):
        self.reg, self.creds, self.ca_bundle, self.timeout = reg, creds, ca_bundle, timeout
        self.binary = shutil.which("skopeo")

    def _missing(self) -> UsageError:
        return UsageError(f"registry {self.reg.host} needs credentials: `docker login {self.reg.host}` or set {USER_ENV} and {PASSWORD_ENV}")

    def _options(self, tmp: Path) -> list[str]:
        opts = [f"--tls-verify={'false' if self.reg.loopback else 'true'}"]  # as Docker: loopback is plain HTTP
        if self.creds:
            auth = base64.b64encode(f"{self.creds['username']}:{self.creds['password']}".encode()).decode()
            authfile = tmp / "auth.json"
            authfile.write_text(json.dumps({"auths": {self.reg.host: {"auth": auth}}}))
            opts.append(f"--authfile={authfile}")
        else:
            opts.append("--no-creds")
        if self.ca_bundle:
            (tmp / "certs").mkdir()
            shutil.copyfile(self.ca_bundle, tmp / "certs" / "ca.crt")
            opts.append(f"--cert-dir={tmp / 'certs'}")
        return opts

    def _skopeo(self, *args: str) -> bytes:
        if not self.binary:
            raise EnvironmentProblem("skopeo is not installed (the registry read-back uses it): apt-get install skopeo")
        with tempfile.TemporaryDirectory(prefix="pytorch-cuda-skopeo-") as tmp:
            cmd = [self.binary, f"--command-timeout={self.timeout:g}s", args[0], "--retry-times=0",
                   *self._options(Path(tmp)), *args[1:]]
            # HOME in the scratch directory: skopeo reads no auth or registries.conf of the user's
            # but the auth file given (containers/image looks in ~/.config/containers, ~/.docker).
            proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, env={**os.environ, "HOME": tmp})
        if proc.returncode == 0:
            return proc.stdout
        raise self._failure(proc.stderr.decode(errors="replace"))

    def _failure(self, stderr: str) -> Exception:
        said, lines = re.findall(r'msg="((?:[^"\\]|\\.)*)"', stderr), stderr.strip().splitlines()
        msg = said[-1].replace('\\"', '"') if said else (lines[-1] if lines else "no message")
        msg = re.sub(r'^Error parsing image name "[^"]*": ', "", msg)
        if _ABSENT.search(msg):
            return _Absent(msg)
        if _REFUSED.search(msg):
            token = " (token)" if "auth token" in msg else ""
            return UsageError(f"registry {self.reg.host} refused the credentials given{token}: {msg}") if self.creds else self._missing()
        if _NOT_A_REGISTRY.search(msg):
            return EnvironmentProblem(f"{self.reg.host} is not a container registry ({msg})")
        asked = re.search(r'"https?://([^/"]+)', msg)  # the URL that failed: the registry's, or its token service's
        if _TRANSIENT.search(msg) and ("auth token" in msg or (asked and asked.group(1) != self.reg.host)):
            return Transient(f"token service of {self.reg.host} unreachable: {msg}")
        if _TRANSIENT.search(msg):
            return Transient(f"registry {self.reg.host} unreachable: {msg}")
        return PublishError(f"skopeo could not read from {self.reg.host}: {msg}")

    def ping(self, image: Image) -> None:
        """Reachable, a registry, and our credentials good for the image's repository: reading a
        tag that cannot exist answers "manifest unknown" (None) only when all three hold. The
        repository is the one we publish to: registries such as Docker Hub deny a pull token for
        a repository the account cannot see, so a made-up one would fail good credentials."""
        self._read(f"{self.reg.namespace}/{image.repository}", "pytorch-cuda-ping")

    def _read(self, name: str, tag: str) -> bytes | None:
        try:
            return self._skopeo("inspect", "--raw", f"docker://{self.reg.host}/{name}:{tag}")
        except _Absent:
            return None

    def manifest(self, image: Image, tag: str, repository: str | None = None) -> Remote | None:
        """The tag in the row's repository, or in `repository` (the base's) under the same namespace."""
        name = repository or image.repository
        raw = self._read(f"{self.reg.namespace}/{name}", tag)
        if raw is None:
            return None
        try:
            config = (json.loads(raw).get("config") or {}).get("digest")
        except (ValueError, AttributeError):
            raise PublishError(f"registry {self.reg.host} served {name}:{tag} as something other than a manifest") from None
        # The digest of the bytes served: what `docker pull REPO@DIGEST` and the push report.
        return Remote("sha256:" + hashlib.sha256(raw).hexdigest(), config)


class _Absent(Exception):
    """The registry answered: no such tag (or no such repository yet)."""


# skopeo's messages (containers/image errors and the registry's error codes), by what to do.
_ABSENT = re.compile(r"manifest unknown|name unknown|repository name not known", re.I)
_REFUSED = re.compile(r"unauthori[sz]ed|authentication required|invalid username/password|denied", re.I)
_NOT_A_REGISTRY = re.compile(r"V1 container registry|invalid status code from registry 40[0-9]", re.I)
_TRANSIENT = re.compile(r"connection refused|connection reset|i/o timeout|deadline exceeded|no route to host|EOF|"
                        r"invalid status code from registry (5\d\d|429)|status(?: code)? (5\d\d|429)|toomanyrequests|"
                        r"server misbehaving|TLS handshake timeout", re.I)


@dataclass
class Move:
    image: Image
    image_id: str
    tag: str
    immutable: bool
    before: Remote | None = None
    after: Remote | None = None
    # Which registry digest the local ID is. The classic store's image ID is the config
    # digest; the containerd store's is the digest of the manifest (or index) that a push
    # sends unchanged.
    by_manifest: bool = False
    base: str = ""  # the base rootfs's repository (e.g. pytorch-cuda-rootfs) when this moves the row's base

    @property
    def name(self) -> str:
        """The repository under the registry's namespace: the base's, or the row's."""
        return self.base or self.image.repository

    def repository(self, reg: Registry) -> str:
        return f"{reg}/{self.name}"

    def target(self, reg: Registry) -> str:
        return f"{self.repository(reg)}:{self.tag}"

    def read(self, api: "RegistryAPI") -> Remote | None:
        return api.manifest(self.image, self.tag, self.base or None)

    def holds(self, remote: Remote | None) -> bool:
        """Whether the registry's image there is this one."""
        if remote is None:
            return False
        return (remote.digest if self.by_manifest else remote.config) == self.image_id

    @property
    def in_place(self) -> bool:
        return self.holds(self.before)


def tested_id(c: docker.DockerClient, image: Image) -> str:
    """The local image ID of the row, refusing one never built or never tested."""
    ref = image.refs()[0]
    build_cmd = f"python build.py --torch {image.torch} --cuda {image.cuda}"
    try:
        image_id = c.images.get(ref).id
    except docker.errors.ImageNotFound:
        raise UsageError(f"{image.name} was never built here (no {ref}); build and test it first: {build_cmd}") from None
    if tags.passed(image_id) is None:
        raise UsageError(f"{ref} ({image_id[:19]}) never passed its tests here; nothing pushed (run {build_cmd} or build.py test)")
    return image_id


def screen(c: docker.DockerClient, images: list[Image], results: Callable[[Image], Path], allowed: set[str]) -> None:
    """Refuse before the registry is contacted: a row never tested here, or one whose
    vulnerabilities.json lists a critical advisory that `allowed` does not name."""
    for image in images:
        tested_id(c, image)  # the first question: a row never built says so, not that its report is missing
    security.gate({i.name: results(i) / security.REPORT for i in images}, allowed)


def dated_tag(image: Image, labels: dict[str, str] | None, ref: str) -> str:
    """The row's immutable tag, e.g. 2.7.1-cuda12.1-runtime-20261122-7904bf67.

    From the image's labels, not this checkout or the clock: the day (UTC) of the
    commit it was built from, and the first 8 hex of the hash of its lock files.
    """
    labels = labels or {}
    rebuild = f"rebuild it (python build.py --torch {image.torch} --cuda {image.cuda})"
    created, lock = labels.get(CREATED_LABEL, ""), labels.get(LOCK_LABEL, "")
    if not _LOCK_HASH.match(lock):
        raise UsageError(f"{ref} has no valid label {LOCK_LABEL} ({lock!r}), so no immutable tag can name its lock; {rebuild}")
    try:
        when = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{ref} has no valid label {CREATED_LABEL} ({created!r}), so no immutable tag can date it; {rebuild}") from None
    when = when.replace(tzinfo=dt.timezone.utc) if when.tzinfo is None else when.astimezone(dt.timezone.utc)
    if when.timestamp() <= 0:  # the build found no commit time: the date would say nothing
        raise UsageError(f"{ref} was built without a commit time ({CREATED_LABEL}={created}); {rebuild} from a git checkout")
    return f"{image.name}-{when:%Y%m%d}-{lock[:8]}"


def base_move(c: docker.DockerClient, image: Image, image_id: str, by_manifest: bool) -> Move | None:
    """The move that publishes the base a row was built on, None for a registry base (pinned by
    digest already). Its tag is the local rootfs tag and the first 12 hex of the base's ID,
    which the row's BASE_LABEL holds, so one published image names the base to pull."""
    if image.os.kind == "registry":
        return None
    base_id = (c.images.get(image_id).labels or {}).get(BASE_LABEL, "")
    ref = image.refs()[0]
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", base_id):
        raise UsageError(f"{ref} has no valid label {BASE_LABEL} ({base_id!r}), so its base cannot be published; "
                         f"rebuild it (python build.py --torch {image.torch} --cuda {image.cuda})")
    try:
        c.images.get(base_id)
    except docker.errors.ImageNotFound:
        raise UsageError(f"the base {ref} was built on ({base_id[:19]}) is no longer in this engine's store, and a "
                         f"rebuild elsewhere needs it; rebuild the row (python build.py --torch {image.torch} --cuda {image.cuda})") from None
    repository, tag = render.base_ref(image).split(":", 1)
    return Move(image, base_id, f"{tag}-{base_id.removeprefix('sha256:')[:12]}", True, by_manifest=by_manifest, base=repository)


def plan(c: docker.DockerClient, api: RegistryAPI, images: list[Image], retry: Callable) -> list[Move]:
    """The bases first, then immutable tags of every row, then the moving ones; each with where it is now.

    An immutable tag that the registry holds at another image is refused here, for every
    row at once, before anything is pushed. (A registry has no compare-and-set: a push
    by someone else between this read and ours is caught by execute's read-back.)
    """
    ids = {i.name: tested_id(c, i) for i in images}
    dated = {i.name: dated_tag(i, c.images.get(ids[i.name]).labels, i.refs()[0]) for i in images}
    for first in {i.repository: i for i in images}.values():  # one read per repository published to
        retry(lambda: api.ping(first), "contacting the registry")
    by_manifest = docker_env.image_store(c) == "containerd"
    bases = {mv.target(api.reg): mv for i in images if (mv := base_move(c, i, ids[i.name], by_manifest))}
    moves = list(bases.values())  # rows that share a base push it once
    moves += [Move(i, ids[i.name], dated[i.name], True, by_manifest=by_manifest) for i in images]
    moves += [Move(i, ids[i.name], t, False, by_manifest=by_manifest) for i in images for t in i.tags]
    for mv in moves:
        mv.before = retry(lambda: mv.read(api), f"reading {mv.target(api.reg)}")
    taken = [TagTaken(mv.target(api.reg), mv.before.digest, mv.before.config, mv.image_id)
             for mv in moves if mv.immutable and mv.before is not None and not mv.in_place]
    if taken:
        raise ImmutableTagTaken(taken)
    return moves


def describe(mv: Move, reg: Registry, now: Remote | None, unknown: str = "") -> str:
    if unknown:
        state = f"unknown ({unknown})"
    elif now is None:
        state = "absent"
    elif mv.holds(now):
        state = f"at this image ({now.digest})"
    else:
        state = f"at another image ({now.digest}, config {now.config})"
    return f"{mv.target(reg)}: {state}"


def where(api: RegistryAPI, moves: list[Move]) -> list[str]:
    """Where every tag of the run is now, read from the registry (one try each)."""
    out = []
    for mv in moves:
        try:
            out.append(describe(mv, api.reg, mv.read(api)))
        except (Transient, UsageError, PublishError) as e:
            out.append(describe(mv, api.reg, None, unknown=str(e)))
    return out


def push_one(c: docker.DockerClient, mv: Move, reg: Registry, creds: dict | None) -> str:
    """Tag locally under the registry's name, push, untag; return the pushed digest."""
    repo = mv.repository(reg)
    c.images.get(mv.image_id).tag(repo, mv.tag)
    try:
        digest = None
        try:
            for ev in c.api.push(repo, tag=mv.tag, stream=True, decode=True, auth_config=creds):
                err = ev.get("error") or (ev.get("errorDetail") or {}).get("message")
                if err:
                    raise (PublishError if _PERMANENT.search(err) else Transient)(err)
                # Docker 20.10 sends it as aux; 26 on the containerd store only in the status line
                said = _PUSHED_DIGEST.search(ev.get("status") or "")
                digest = (ev.get("aux") or {}).get("Digest") or (said.group(1) if said else digest)
        except (docker.errors.APIError, requests.ConnectionError) as e:
            raise Transient(str(docker_env.failure(f"the push of {repo}:{mv.tag}", e))) from None
        if not digest and mv.by_manifest:
            digest = mv.image_id  # that store pushes the manifest it holds; the read-back checks it
        if not digest:
            raise Transient("the daemon reported no digest")
        return digest
    finally:
        try:
            c.images.remove(f"{repo}:{mv.tag}", noprune=True)
        except docker.errors.APIError:
            pass


def execute(c: docker.DockerClient, api: RegistryAPI, moves: list[Move], creds: dict | None,
            retry: Callable, log: Callable[[str], None]) -> None:
    reg = api.reg
    for mv in moves:
        if mv.in_place:
            mv.after = mv.before
            log(f"{mv.target(reg)} already at this image ({mv.before.digest}); skipped")
            continue
        log(f"pushing {mv.target(reg)} ({mv.image_id[:19]})")
        try:
            pushed = retry(lambda: push_one(c, mv, reg, creds), f"pushing {mv.target(reg)}")
            mv.after = retry(lambda: mv.read(api), f"reading back {mv.target(reg)}")
        except (Transient, PublishError) as e:
            raise PublishError(f"{mv.target(reg)}: {e}") from None
        if mv.after is None or mv.after.digest != pushed or not mv.holds(mv.after):
            raise PublishError(f"read-back of {mv.target(reg)} does not match the push: pushed {pushed} of {mv.image_id}, registry has {mv.after}")


def publish(c: docker.DockerClient, images: list[Image], reg: Registry, *, push: bool, ca_bundle: str | None,
            attempts: int, backoff: float, log: Callable[[str], None]) -> list[Move]:
    creds = credentials(reg)
    api = RegistryAPI(reg, creds, ca_bundle)

    def retry(fn: Callable, what: str):
        def before_sleep(state: tenacity.RetryCallState) -> None:
            log(f"{what} failed: {state.outcome.exception()}; attempt {state.attempt_number + 1}/{attempts} in {state.next_action.sleep:.0f}s")
        r = tenacity.Retrying(stop=tenacity.stop_after_attempt(attempts), reraise=True,
                              wait=tenacity.wait_exponential(multiplier=backoff, max=60),
                              retry=tenacity.retry_if_exception_type(Transient), before_sleep=before_sleep)
        return r(fn)

    try:
        moves = plan(c, api, images, retry)
    except Transient as e:
        raise EnvironmentProblem(f"{e}; nothing pushed") from None
    if not push:
        return moves
    try:
        execute(c, api, moves, creds, retry, log)
    except (Transient, PublishError) as e:
        raise PublishError(f"publish to {reg} stopped at {e}; nothing after it was pushed. Tags now:", where(api, moves)) from None
    except KeyboardInterrupt:
        log("interrupted; tags now: " + "; ".join(where(api, moves)))
        raise
    return moves


def registry(address: str | None, retries: int) -> Registry:
    """The --registry and --retries of a command, checked before anything is built or pushed."""
    if not address:
        raise UsageError("no registry: pass --registry HOST[:PORT]/NAMESPACE or set PYTORCH_CUDA_REGISTRY")
    if retries < 1:
        raise UsageError(f"--retries must be at least 1, not {retries}")
    return Registry.parse(address)


def table(moves: list[Move], reg: Registry, push: bool) -> list[str]:
    """Where each tag is now (pushed) or would go (dry run), one line per tag."""
    rows = [("TAG", "NOW", "ACTION")]
    for mv in moves:
        now = mv.after if push else mv.before
        action = "already there" if mv.in_place else ("pushed, verified" if push else "would push")
        rows.append((mv.target(reg), now.digest if now else "absent", action))
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if not push:
        return lines + ["dry run: nothing pushed; add --push to publish"]
    bases = [f"base for rebuilds: {mv.repository(reg)}@{mv.after.digest}" for mv in moves if mv.base and mv.after]
    return lines + [f"pull by digest: {reg.repository(image)}@{digest}" for image, digest in pushed(moves)] + bases


def pushed(moves: list[Move]) -> list[tuple[Image, str]]:
    """Each published row with the digest to pull it by, in the order of the moves."""
    out: dict[str, tuple[Image, str]] = {}
    for mv in moves:
        if not mv.base:
            out.setdefault(mv.image.name, (mv.image, mv.after.digest if mv.after else ""))
    return list(out.values())


def write_record(results: Path, reg: Registry, image: Image, moves: list[Move]) -> None:
    """build-results/<image>/published.json: where the row went and the digest to pull it by,
    and where the base it was built on went (no "base" for a registry base)."""
    mine = [mv for mv in moves if mv.image is image and not mv.base]
    record = {"registry": str(reg), "repository": reg.repository(image), "image_id": mine[0].image_id,
              "digest": mine[0].after.digest, "tags": [mv.tag for mv in mine]}
    # rows that share a base share one move, made for the first of them
    base = next((mv for mv in moves if mv.base and mv.after and render.base_ref(mv.image) == render.base_ref(image)), None)
    if base is not None:
        record["base"] = {"image_id": base.image_id, "repository": base.repository(reg), "tag": base.tag,
                          "digest": base.after.digest}
    write_atomic(results / "published.json", json.dumps(record, indent=2) + "\n")
