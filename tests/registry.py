"""A real registry for the publish tests: Debian's docker-registry on 127.0.0.1.

It can be stopped and started again over the same storage, in read-only maintenance
mode, behind htpasswd auth (Basic), or behind token auth (Bearer: the flow of ghcr.io,
Docker Hub and ECR) with TokenIssuer, a small token service kept to the test suite.
That is how the tests make a registry fail mid-push, refuse writes or ask for credentials.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from pathlib import Path

from helpers import free_port, require

with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: only the tests need bcrypt
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt

BINARY = shutil.which("docker-registry")


def require_binary() -> None:
    """A test that needs docker-registry: a failure in CI (selftest installs it), a skip elsewhere."""
    require(BINARY, "no docker-registry binary: run `python build.py selftest` or apt-get install docker-registry")


class LocalRegistry:
    def __init__(self, workdir: Path):
        self.dir = workdir
        self.storage = workdir / "storage"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "registry.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def address(self, namespace: str) -> str:
        return f"{self.host}/{namespace}"

    def start(self, readonly: bool = False, users: dict[str, str] | None = None,
              tokens: "TokenIssuer | None" = None) -> "LocalRegistry":
        self.stop()
        lines = ["version: 0.1", "log: {level: info}", "storage:",
                 f"  filesystem: {{rootdirectory: {self.storage}}}", "  delete: {enabled: true}",
                 f"  maintenance: {{readonly: {{enabled: {str(readonly).lower()}}}, uploadpurging: {{enabled: false}}}}",
                 f"http: {{addr: '{self.host}'}}"]
        if users:
            htpasswd = self.dir / "htpasswd"
            htpasswd.write_text("".join(f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n" for u, p in users.items()))
            lines.append(f"auth: {{htpasswd: {{realm: test, path: {htpasswd}}}}}")
        if tokens:
            lines.append(f"auth: {{token: {{realm: '{tokens.realm}', service: {tokens.service}, "
                         f"issuer: {tokens.issuer}, rootcertbundle: {tokens.cert}}}}}")
        config = self.dir / "config.yml"
        config.write_text("\n".join(lines) + "\n")
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
                return self
            except urllib.error.HTTPError:
                return self  # 401: up, and asking for credentials
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"docker-registry exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
                time.sleep(0.2)
        raise RuntimeError("docker-registry did not answer within 30 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # an outage, not a graceful shutdown
            self.proc.wait(timeout=30)
        self.proc = None

    def wait_for_log(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log.read_text(errors="replace"):
                return True
            time.sleep(0.2)
        return False

    def manifest(self, repo: str, ref: str) -> tuple[str, dict] | None:
        """(digest, manifest) of repo:ref as the registry serves it, None if absent."""
        req = urllib.request.Request(f"http://{self.host}/v2/{repo}/manifests/{ref}", headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json, "
                      "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.headers["Docker-Content-Digest"], json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def catalog(self) -> list[str]:
        with urllib.request.urlopen(f"http://{self.host}/v2/_catalog", timeout=30) as r:
            return json.loads(r.read())["repositories"]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenIssuer:
    """A token service as docker/distribution's token auth expects one, for the tests only.

    GET /token?service=S&scope=repository:NAME:pull,push with HTTP Basic credentials answers
    {"token": JWT} granting the scope; a wrong password, or none, is refused with 401. The JWT
    is RS256-signed with a key made here by openssl; its certificate travels in the header's
    x5c and is the registry's rootcertbundle, which is how the registry checks the signature.
    """

    service, issuer = "pcb-test-registry", "pcb-test-issuer"

    def __init__(self, workdir: Path, users: dict[str, str]):
        self.dir, self.users = workdir, users
        self.key, self.cert = workdir / "token.key", workdir / "token.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=pcb-test-issuer", "-keyout", str(self.key), "-out", str(self.cert)],
                       check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
                             check=True, capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.requests: list[dict] = []  # what each /token call asked for, and for whom
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def start(self) -> "TokenIssuer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def sign(self, claims: dict) -> str:
        head = _b64url(json.dumps({"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}).encode())
        body = _b64url(json.dumps(claims).encode())
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=f"{head}.{body}".encode(),
                             check=True, capture_output=True).stdout
        return f"{head}.{body}.{_b64url(sig)}"

    def token(self, user: str, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        return self.sign({"iss": self.issuer, "sub": user, "aud": self.service, "iat": now, "nbf": now - 10,
                          "exp": now + 300, "jti": hashlib.sha256(f"{user}{now}{scopes}".encode()).hexdigest()[:16],
                          "access": access})

    def _handler(self):
        issuer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                user = None
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                    user = name if issuer.users.get(name) == password else None
                issuer.requests.append({"user": user, "basic": bool(auth), "scope": query.get("scope", []),
                                        "service": query.get("service", [""])[0]})
                if url.path != "/token" or user is None or query.get("service", [""])[0] != issuer.service:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"token": issuer.token(user, query.get("scope", [])), "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler


def push_small_image(reg: LocalRegistry, repo: str, tag: str, bearer: str) -> tuple[str, str]:
    """A one-layer OCI image pushed over the distribution API with a token: (manifest digest,
    config digest). Tests of the read-back need an image in a token-auth registry, not a build."""
    def put_blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = urllib.request.Request(f"http://{reg.host}/v2/{repo}/blobs/uploads/", method="POST",
                                       headers={"Authorization": f"Bearer {bearer}", "Content-Length": "0"})
        with urllib.request.urlopen(start, timeout=30) as r:
            location = urllib.parse.urljoin(f"http://{reg.host}", r.headers["Location"])
        sep = "&" if "?" in location else "?"
        done = urllib.request.Request(f"{location}{sep}digest={digest}", data=data, method="PUT",
                                      headers={"Authorization": f"Bearer {bearer}", "Content-Type": "application/octet-stream"})
        urllib.request.urlopen(done, timeout=30).close()
        return digest

    layer = b"\x1f\x8b" + b"not really gzip, the registry does not look" * 4
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": len(config),
                                      "digest": put_blob(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "size": len(layer),
                                       "digest": put_blob(layer)}]}).encode()
    req = urllib.request.Request(f"http://{reg.host}/v2/{repo}/manifests/{tag}", data=manifest, method="PUT",
                                 headers={"Authorization": f"Bearer {bearer}",
                                          "Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers["Docker-Content-Digest"], json.loads(manifest)["config"]["digest"]


# ---- small images for registry tests, built by Docker 20.10 -------------------------------------

def small_image(tmp: Path, files: dict[str, str], labels: dict[str, str] | None = None) -> str:
    """FROM scratch with files (path in the image: text), built by Docker 20.10 (classic store: the
    config pushed is the config built); its local tag, which the caller removes."""
    ctx = tmp / f"ctx-{uuid.uuid4().hex[:8]}"
    ctx.mkdir(parents=True)
    lines = ["FROM scratch"]
    for n, (path, text) in enumerate(files.items()):
        (ctx / f"f{n}").write_text(text)
        lines.append(f"COPY f{n} {path}")
    (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
    tag = f"pcb-small-test:{uuid.uuid4().hex[:12]}"
    args = [a for k, v in (labels or {}).items() for a in ("--label", f"{k}={v}")]
    proc = subprocess.run(["/usr/bin/docker", "build", "-q", *args, "-t", tag, str(ctx)], capture_output=True, text=True,
                          env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert proc.returncode == 0, proc.stderr
    return tag


def push_small(local: str, target: str) -> str:
    """local pushed as target (REGISTRY/NS/NAME:TAG); the name target removed again (the image stays
    under local); the manifest digest the push reports."""
    subprocess.run(["/usr/bin/docker", "tag", local, target], check=True)
    try:
        proc = subprocess.run(["/usr/bin/docker", "push", target], capture_output=True, text=True)
    finally:
        subprocess.run(["/usr/bin/docker", "image", "rm", target], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    return next(w for line in proc.stdout.splitlines() for w in line.split() if w.startswith("sha256:"))


@contextlib.contextmanager
def small_published(tmp: Path, tag: str):
    """A registry on 127.0.0.1 with a small image pushed to ml/pytorch-cuda:tag: (the registry, a
    reader of it, the image's digest, the image's local tag); the registry stopped and the local
    image removed after. For the tests of what a push attaches beside an image."""
    from pytorch_cuda_build.registry.client import Registry, RegistryAPI

    require_binary()
    reg = LocalRegistry(tmp / "registry").start()
    local = small_image(tmp, {"/f": uuid.uuid4().hex})
    digest = push_small(local, f"{reg.address('ml')}/pytorch-cuda:{tag}")
    try:
        yield reg, RegistryAPI(Registry(reg.host, "ml"), None, None), digest, local
    finally:
        reg.stop()
        subprocess.run(["/usr/bin/docker", "image", "rm", "--force", local], capture_output=True)
