"""A registry client for publish: where a registry is (HOST[:PORT]/NAMESPACE), its credentials,
and what it holds under a tag (manifest digest and config digest), read with skopeo.

Errors are sorted by what to do about them: absent (no such tag yet), refused (credentials),
not a registry, or transient (worth another attempt).
"""
from __future__ import annotations

import base64
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

import docker
import docker.auth
import docker.errors
import requests

from ..errors import BadValue, EnvironmentProblem, PublishError, RegistryRefused
from ..matrix import Image
from .retry import Transient

_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # the distribution spec's path component
_ADDRESS = re.compile(rf"^(?P<host>{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::(?P<port>[0-9]+))?/(?P<ns>{_PATH}(?:/{_PATH})*)$")
USER_ENV, PASSWORD_ENV = "PYTORCH_CUDA_REGISTRY_USER", "PYTORCH_CUDA_REGISTRY_PASSWORD"
# skopeo's limit on a push of an image's blobs (a read's is 30 s): 6 GB at 1 MB/s, with room
PUSH_TIMEOUT = 4 * 3600


@dataclass(frozen=True)
class Registry:
    host: str  # as written, with the port: what docker tags and pushes carry
    namespace: str

    @classmethod
    def parse(cls, text: str) -> "Registry":
        m = _ADDRESS.match(text or "")
        if not m:
            raise BadValue(f"malformed registry address {text!r}: expected HOST[:PORT]/NAMESPACE, e.g. 127.0.0.1:5000/ml (no scheme, lowercase namespace)", name="--registry")
        if m["port"] is not None and not 0 < int(m["port"]) < 65536:
            raise BadValue(f"malformed registry address {text!r}: port {m['port']} is not 1-65535", name="--registry")
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
            raise BadValue(f"set both {USER_ENV} and {PASSWORD_ENV}, or neither", name=USER_ENV)
        return {"username": user, "password": password}
    found = docker.auth.resolve_authconfig(docker.auth.load_config(), reg.host) or {}
    found = {k.lower(): v for k, v in found.items()}
    if found.get("username") and found.get("password"):
        return {"username": found["username"], "password": found["password"]}
    return None


ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"
_GZIP_LAYERS = ("application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip")


@dataclass(frozen=True)
class Remote:
    digest: str  # manifest digest: what `pull REPO@DIGEST` takes
    config: str | None  # config digest: the classic store's image ID
    layers: tuple[str, ...] = ()  # each layer's mediaType, in order

    @property
    def form(self) -> str:
        """How its layers are compressed: gzip, zstd, or mixed (anything else, such as none at all)."""
        if self.layers and all(m == ZSTD_LAYER for m in self.layers):
            return "zstd"
        if self.layers and all(m in _GZIP_LAYERS for m in self.layers):
            return "gzip"
        return "mixed"


class RegistryAPI:
    """Reads a tag's manifest with skopeo (containers/image: the client of podman and CRI-O),
    which speaks the distribution API with Basic and Bearer-token auth, TLS and redirects.
    Pushes go through the Docker daemon (publish.push_one), except the OCI layouts of an index or
    of an image's zstd form and a copy of a manifest to another tag, which skopeo pushes with
    --preserve-digests (what is pushed is what was written). Credentials reach skopeo through a
    private auth file, never its command line."""

    def __init__(self, reg: Registry, creds: dict | None, ca_bundle: str | None, timeout: float = 30):
        self.reg, self.creds, self.ca_bundle, self.timeout = reg, creds, ca_bundle, timeout
        self.binary = shutil.which("skopeo")

    def _missing(self) -> RegistryRefused:
        return RegistryRefused(f"registry {self.reg.host} needs credentials: `docker login {self.reg.host}` or set {USER_ENV} and {PASSWORD_ENV}", host=self.reg.host)

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

    def _skopeo(self, *args: str, side: str | tuple[str, ...] = "", timeout: float | None = None,
                global_opts: tuple[str, ...] = (), env: dict | None = None) -> bytes:
        """skopeo ARGS with this registry's TLS and credentials options, for the sides of a copy
        that are the registry (side "dest": --dest-tls-verify, ...; ("src", "dest"): both) or for
        a read (side "")."""
        if not self.binary:
            raise EnvironmentProblem("skopeo is not installed (the registry read-back uses it): apt-get install skopeo")
        sides = (side,) if isinstance(side, str) else side
        with tempfile.TemporaryDirectory(prefix="pytorch-cuda-skopeo-") as tmp:
            options = self._options(Path(tmp))
            opts = [o.replace("--", f"--{s}-", 1) if s else o for s in sides for o in options]
            cmd = [self.binary, f"--command-timeout={timeout or self.timeout:g}s", *global_opts, args[0], "--retry-times=0",
                   *opts, *args[1:]]
            # HOME in the scratch directory: skopeo reads no auth or registries.conf of the user's
            # but the auth file given (containers/image looks in ~/.config/containers, ~/.docker).
            proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, env={**os.environ, "HOME": tmp, **(env or {})})
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
            return RegistryRefused(f"registry {self.reg.host} refused the credentials given{token}: {msg}", host=self.reg.host) if self.creds else self._missing()
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

    def raw(self, name: str, reference: str) -> bytes | None:
        """The manifest or index bytes of name:tag, or name@digest (None: absent)."""
        sep = "@" if reference.startswith("sha256:") else ":"
        try:
            return self._skopeo("inspect", "--raw", f"docker://{self.reg.host}/{self.reg.namespace}/{name}{sep}{reference}")
        except _Absent:
            return None

    def config(self, name: str, digest: str) -> bytes:
        """The config blob of the image manifest name@digest, as served (its digest is checked by the caller)."""
        return self._skopeo("inspect", "--config", "--raw", f"docker://{self.reg.host}/{self.reg.namespace}/{name}@{digest}")

    def copy_to_layout(self, name: str, digest: str, layout: Path) -> None:
        """The image manifest name@digest, blobs and all, into an OCI layout, unchanged (verify reads its layers)."""
        self._skopeo("copy", "--preserve-digests", "--quiet", f"docker://{self.reg.host}/{self.reg.namespace}/{name}@{digest}",
                     f"oci:{layout}", side="src", timeout=PUSH_TIMEOUT)

    def signed_copy(self, name: str, digest: str, tag: str, fingerprint: str, passphrase_file: Path, registries_d: Path,
                    gnupg_home: Path) -> None:
        """name@digest onto name:tag, unchanged, with a GPG signature by fingerprint (from gnupg_home),
        which skopeo stores where registries_d says. The source is this registry's own image by
        digest, so no policy is asked to accept it."""
        repo = f"docker://{self.reg.host}/{self.reg.namespace}/{name}"
        self._skopeo("copy", "--preserve-digests", "--quiet", f"--sign-by={fingerprint}", f"--sign-passphrase-file={passphrase_file}",
                     f"{repo}@{digest}", f"{repo}:{tag}", side=("src", "dest"),
                     global_opts=("--insecure-policy", f"--registries.d={registries_d}"), env={"GNUPGHOME": str(gnupg_home)})

    def push_index(self, layout: Path, ref_name: str, name: str, tag: str) -> None:
        """The index that an OCI layout names ref_name to name:tag, byte for byte; its manifests
        must be in the repository already (--multi-arch index-only)."""
        self._skopeo("copy", "--multi-arch", "index-only", "--preserve-digests", "--quiet", f"oci:{layout}:{ref_name}",
                     f"docker://{self.reg.host}/{self.reg.namespace}/{name}:{tag}", side="dest")

    def put_manifest(self, name: str, tag: str, raw: bytes, media_type: str) -> None:
        """raw (a manifest or index whose blobs and children the repository holds) to name:tag, byte for
        byte, with the distribution API's PUT. For what skopeo 1.9 cannot push unchanged: an OCI index
        whose entries carry artifactType (the referrers fallback), which it would re-serialize without it.
        Auth as a registry asks: Basic, or a Bearer token from the realm its challenge names."""
        scheme = "http" if self.reg.loopback else "https"
        url = f"{scheme}://{self.reg.host}/v2/{self.reg.namespace}/{name}/manifests/{tag}"
        verify = self.ca_bundle or True
        basic = (self.creds["username"], self.creds["password"]) if self.creds else None
        headers = {"Content-Type": media_type}
        try:
            resp = requests.put(url, data=raw, headers=headers, auth=basic, verify=verify, timeout=self.timeout)
            challenge = resp.headers.get("WWW-Authenticate", "")
            if resp.status_code == 401 and challenge.lower().startswith("bearer "):
                params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
                query = {k: v for k, v in params.items() if k in ("service", "scope")}
                query.setdefault("scope", f"repository:{self.reg.namespace}/{name}:pull,push")
                token = requests.get(params["realm"], params=query, auth=basic, verify=verify, timeout=self.timeout)
                if token.status_code != 200:
                    raise (RegistryRefused(f"registry {self.reg.host} refused the credentials given (token)", host=self.reg.host) if self.creds else self._missing())
                body = token.json()
                headers["Authorization"] = f"Bearer {body.get('token') or body.get('access_token')}"
                resp = requests.put(url, data=raw, headers=headers, verify=verify, timeout=self.timeout)
        except requests.RequestException as e:
            raise Transient(f"registry {self.reg.host} unreachable: {e}") from None
        if resp.status_code in (401, 403):
            raise RegistryRefused(f"registry {self.reg.host} refused the credentials given", host=self.reg.host) if self.creds else self._missing()
        if resp.status_code >= 300:
            raise PublishError(f"registry {self.reg.host} refused {name}:{tag} ({resp.status_code}: {resp.text[:200]})")

    def push_layout(self, layout: Path, ref_name: str, name: str, tag: str) -> None:
        """The image that an OCI layout names ref_name to name:tag, blobs and manifest byte for byte:
        blobs the repository holds already are not sent again (skopeo checks each by digest)."""
        try:
            self._skopeo("copy", "--preserve-digests", "--quiet", f"oci:{layout}:{ref_name}",
                         f"docker://{self.reg.host}/{self.reg.namespace}/{name}:{tag}", side="dest", timeout=PUSH_TIMEOUT)
        except _Absent as e:  # ECR, for one, says so of a repository nobody created
            raise PublishError(f"registry {self.reg.host} has no repository {self.reg.namespace}/{name} to push to ({e})") from None

    def retag(self, name: str, digest: str, tag: str) -> None:
        """name@digest, a manifest the repository holds, to name:tag unchanged; its blobs are there
        already, so only the manifest (and the small config, read and found) crosses."""
        repo = f"docker://{self.reg.host}/{self.reg.namespace}/{name}"
        try:
            self._skopeo("copy", "--preserve-digests", "--quiet", f"{repo}@{digest}", f"{repo}:{tag}", side=("src", "dest"))
        except _Absent as e:
            raise PublishError(f"{name}@{digest} is gone from the registry ({e}); it cannot be copied to {tag}") from None

    def manifest(self, image: Image, tag: str, repository: str | None = None) -> Remote | None:
        """The tag in the row's repository, or in `repository` (the base's) under the same namespace."""
        name = repository or image.repository
        raw = self._read(f"{self.reg.namespace}/{name}", tag)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            config = (doc.get("config") or {}).get("digest")
            layers = tuple(layer.get("mediaType", "") for layer in doc.get("layers") or [])
        except (ValueError, AttributeError):
            raise PublishError(f"registry {self.reg.host} served {name}:{tag} as something other than a manifest") from None
        # The digest of the bytes served: what `docker pull REPO@DIGEST` and the push report.
        return Remote("sha256:" + hashlib.sha256(raw).hexdigest(), config, layers)


class _Absent(Exception):
    """The registry answered: no such tag (or no such repository yet)."""


# skopeo's messages (containers/image errors and the registry's error codes), by what to do.
_ABSENT = re.compile(r"manifest unknown|name unknown|repository name not known", re.I)
_REFUSED = re.compile(r"unauthori[sz]ed|authentication required|invalid username/password|denied", re.I)
_NOT_A_REGISTRY = re.compile(r"V1 container registry|invalid status code from registry 40[0-9]", re.I)
_TRANSIENT = re.compile(r"connection refused|connection reset|i/o timeout|deadline exceeded|no route to host|EOF|"
                        r"invalid status code from registry (5\d\d|429)|status(?: code)? (5\d\d|429)|toomanyrequests|"
                        r"server misbehaving|TLS handshake timeout", re.I)
