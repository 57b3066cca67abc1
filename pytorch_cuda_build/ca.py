"""The CA bundle that builds, lock and publish trust: the one given, else pip's or requests'.
A corporate TLS proxy needs it passed to BuildKit (as a secret) and to uv."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import requests

from .errors import BadFile

if TYPE_CHECKING:
    from requests.sessions import _Settings  # typeshed's name for what the merge returns


def default_ca_bundle() -> str | None:
    """The CA file pip or requests is configured with, if any: corporate proxies need it."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return value.strip("'\"")
    return None


def ca_bundle(given: str | None) -> str | None:
    """The CA bundle to use (given, else pip's), checked readable now rather than an hour in."""
    path = given or default_ca_bundle()
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise BadFile(f"cannot read CA bundle {path}: {e.strerror}", path=path) from None
    return path


class _Session(requests.Session):
    """A session whose own CA bundle wins. requests lets REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE replace
    a session's `verify` (psf/requests#3829, open until its 3.0), so a bundle given with --ca-bundle
    was silently swapped for the environment's wherever one is set, as on our machines."""

    def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> _Settings:
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if verify is None and self.verify is not True:  # not given for this request: the session's own
            settings["verify"] = self.verify
        return settings


def session(bundle: str | None) -> requests.Session:
    """An HTTP session that verifies with `bundle` where one is given, whatever the environment says."""
    s = _Session()
    if bundle:
        s.verify = bundle
    return s
