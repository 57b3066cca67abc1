"""Signatures of published images: GPG "simple signing" signatures (containers/image's format:
podman, skopeo and CRI-O verify them with a `signedBy` policy), made with a local key, no
outside service.

Why GPG and not sigstore (cosign's format): Debian's skopeo 1.9.3 and podman 4.3 carry a
"Debian-local change: sigstore disabled" in both directions. They refuse to make a sigstore
signature, and a `sigstoreSigned` policy rejects even a correctly signed image with that message
(seen here, 2026-11-27, with a cosign-format signature stored as its attachment). cosign is not
in Debian. So on these machines a sigstore signature could be written but not checked by the
tools a user has, while GPG signing and `signedBy` verification work end to end.

A signature names the image's manifest digest and, as its identity, the reference it was
published under. skopeo writes it, while copying the pushed manifest onto its own tag, to a
"lookaside" store: a directory (`lookaside-staging` in registries.d) whose files are then served
over HTTP(S) from anywhere (`lookaside` in the users' registries.d), laid out as
`<namespace>/<name>@sha256=<hex>/signature-1`. A policy that trusts the key for the repository
(`matchRepository`) accepts any tag of it pointing at a signed digest, and refuses an unsigned
image, an image whose digest no signature names (another image put under a signed tag), and a
signed image copied to another repository.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import BadFile, BadValue, CommandFailed, EnvironmentProblem
from .client import RegistryAPI

PASSPHRASE_ENV = "PYTORCH_CUDA_SIGN_PASSPHRASE"
HOME = "gnupg"  # the key's own GnuPG home, inside the folder signing-key writes
PUBLIC = "signing-key.pub.asc"
UID = "pytorch-cuda image signing"


def passphrase() -> str:
    value = os.environ.get(PASSPHRASE_ENV, "")
    if not value:
        raise BadValue(f"set {PASSPHRASE_ENV}: the signing key's passphrase (it is never read from the command line)", name=PASSPHRASE_ENV)
    return value


def _gpg(home: Path, *args: str, secret: str | None = None) -> subprocess.CompletedProcess:
    if not (gpg := shutil.which("gpg")):
        raise EnvironmentProblem("gpg is not installed (signing uses it): apt-get install gnupg")
    cmd = [gpg, "--homedir", str(home), "--batch", "--no-tty", *(["--pinentry-mode", "loopback", "--passphrase-fd", "0"] if secret else []), *args]
    return subprocess.run(cmd, input=secret or "", capture_output=True, text=True)


def stop_agent(home: Path) -> None:
    """No gpg-agent left behind: it would outlive the command and remember the passphrase."""
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True)


def fingerprint(folder: Path) -> str:
    """The fingerprint of the one secret key in folder's GnuPG home; BadFile if there is none."""
    home = folder / HOME
    if not home.is_dir():
        raise BadFile(f"--sign-key {folder}: no {HOME}/ in it; make a key with `build.py signing-key {folder}`", path=folder)
    out = _gpg(home, "--with-colons", "--list-secret-keys").stdout
    fprs = re.findall(r"^fpr:+([0-9A-F]{40}):", out, re.M)
    if not fprs:
        raise BadFile(f"--sign-key {folder}: its {HOME}/ holds no secret key", path=folder)
    return fprs[0]


def check_key(folder: Path) -> str:
    """Before anything is pushed: the key is there and the passphrase opens it (a test signature)."""
    fpr = fingerprint(folder)
    # A test signature of an empty file to stdout: never `--output /dev/null`, which gpg, as root,
    # unlinks when signing fails (a wrong passphrase), leaving the host without /dev/null.
    try:
        with tempfile.NamedTemporaryFile(prefix="pytorch-cuda-sign-") as empty:
            proc = _gpg(folder / HOME, "--local-user", fpr, "--armor", "--output", "-", "--sign", empty.name, secret=passphrase())
    finally:  # a later wrong passphrase must still fail
        stop_agent(folder / HOME)
    if proc.returncode != 0:
        raise BadValue(f"--sign-key {folder}: the passphrase in {PASSPHRASE_ENV} does not open its key "
                         f"({(proc.stderr.strip().splitlines() or ['gpg failed'])[-1]})", name=PASSPHRASE_ENV)
    return fpr


def generate(folder: Path) -> tuple[str, Path]:
    """A new RSA-3072 signing key, valid 2 years, in folder/gnupg, its public half armored in
    folder/signing-key.pub.asc; folder must not hold a key yet. (fingerprint, public key path)."""
    home, public = folder / HOME, folder / PUBLIC
    for path in (home, public):
        if path.exists():
            raise BadFile(f"{path} exists: a new key never replaces one (remove it, or name another folder)", path=path)
    secret = passphrase()
    home.mkdir(parents=True, mode=0o700)
    made = _gpg(home, "--quick-generate-key", UID, "rsa3072", "sign", "2y", secret=secret)
    if made.returncode != 0:
        raise CommandFailed("gpg --quick-generate-key", made.returncode, (made.stderr.strip().splitlines() or [""])[-1])
    fpr = fingerprint(folder)
    exported = _gpg(home, "--armor", "--export", fpr)
    public.write_text(exported.stdout)
    stop_agent(home)
    return fpr, public


def registries_d(folder: Path, registry: str, lookaside: str, staging: bool) -> Path:
    """A registries.d folder that stores (staging) or reads signatures of registry (HOST[:PORT]/NAMESPACE) at lookaside."""
    folder.mkdir(parents=True, exist_ok=True)
    key = "lookaside-staging" if staging else "lookaside"
    (folder / "pytorch-cuda.yaml").write_text(f"docker:\n  {registry}:\n    {key}: {lookaside}\n")
    return folder


def policy(public_key: Path, repository: str) -> dict:
    """A containers-policy.json (podman, skopeo, CRI-O) that takes images of repository
    (HOST[:PORT]/NAMESPACE/NAME) only when signed with this key, and anything else as the
    system's default would (replace that default with your own)."""
    return {"default": [{"type": "insecureAcceptAnything"}],
            "transports": {"docker": {repository: [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(public_key),
                                                    "signedIdentity": {"type": "matchRepository"}}]}}}


def sign(api: RegistryAPI, name: str, digest: str, tag: str, folder: Path, signatures: Path) -> Path:
    """Sign name@digest (in api's registry) under the identity name:tag, into the lookaside
    directory signatures; the manifest is copied onto the tag it already has, so nothing in the
    registry changes. The signature file's path."""
    fpr = fingerprint(folder)
    registry = f"{api.reg.host}/{api.reg.namespace}"
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-sign-") as tmp:
        secret = Path(tmp) / "passphrase"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(passphrase())
        conf = registries_d(Path(tmp) / "registries.d", registry, signatures.resolve().as_uri(), staging=True)
        try:
            api.signed_copy(name, digest, tag, fpr, secret, conf, gnupg_home=folder / HOME)
        finally:
            stop_agent(folder / HOME)
    written = signatures / api.reg.namespace / f"{name}@{digest.replace(':', '=')}"
    found = sorted(written.glob("signature-*"))
    if not found:
        raise EnvironmentProblem(f"skopeo reported success but wrote no signature under {written}")
    return found[-1]
