"""A real registry for the publish tests: Debian's docker-registry on 127.0.0.1.

It can be stopped and started again over the same storage, in read-only maintenance
mode, or behind htpasswd auth, which is how the tests make a registry fail mid-push,
refuse writes or ask for credentials.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: only the tests need bcrypt
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt

BINARY = shutil.which("docker-registry")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def start(self, readonly: bool = False, users: dict[str, str] | None = None) -> "LocalRegistry":
        self.stop()
        lines = ["version: 0.1", "log: {level: info}", "storage:",
                 f"  filesystem: {{rootdirectory: {self.storage}}}", "  delete: {enabled: true}",
                 f"  maintenance: {{readonly: {{enabled: {str(readonly).lower()}}}, uploadpurging: {{enabled: false}}}}",
                 f"http: {{addr: '{self.host}'}}"]
        if users:
            htpasswd = self.dir / "htpasswd"
            htpasswd.write_text("".join(f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n" for u, p in users.items()))
            lines.append(f"auth: {{htpasswd: {{realm: test, path: {htpasswd}}}}}")
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
            "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"})
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
