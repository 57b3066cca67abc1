"""The signing key and what users are given to verify with (registry/sign.py), with the real gpg
and no registry: a key only its passphrase opens (and a wrong one fails even right after a right
one, when gpg's agent remembers), one clear line for a folder without a key, and the policy and
registries.d that docs/security.md shows. Signing and verifying against a registry:
tests/integration/test_signing.py."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from pytorch_cuda_build.errors import BadFile, BadValue
from pytorch_cuda_build.registry import sign

pytestmark = pytest.mark.skipif(shutil.which("gpg") is None, reason="gpg missing (Debian: gnupg)")


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    folder = tmp_path_factory.mktemp("key")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(sign.PASSPHRASE_ENV, "right")
        fpr, public = sign.generate(folder)
    return folder, fpr, public


def test_a_new_key_is_in_its_own_gnupg_home_and_its_public_half_is_armored(key):
    folder, fpr, public = key
    assert len(fpr) == 40 and sign.fingerprint(folder) == fpr
    assert oct((folder / sign.HOME).stat().st_mode & 0o777) == "0o700"
    assert public.read_text().startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")


def test_only_its_passphrase_opens_it_even_right_after_the_right_one(key, monkeypatch):
    folder, fpr, _ = key
    monkeypatch.setenv(sign.PASSPHRASE_ENV, "right")
    assert sign.check_key(folder) == fpr
    monkeypatch.setenv(sign.PASSPHRASE_ENV, "wrong")
    with pytest.raises(BadValue, match="does not open its key"):
        sign.check_key(folder)
    # gpg unlinks the output of a failed signature: as root, an output of /dev/null was the host's
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_no_passphrase_and_no_key_are_one_line_each(tmp_path, monkeypatch):
    monkeypatch.delenv(sign.PASSPHRASE_ENV, raising=False)
    with pytest.raises(BadValue, match=f"set {sign.PASSPHRASE_ENV}"):
        sign.passphrase()
    with pytest.raises(BadFile, match=r"no gnupg/ in it; make a key with `build.py signing-key"):
        sign.fingerprint(tmp_path)
    (tmp_path / sign.HOME).mkdir(mode=0o700)
    with pytest.raises(BadFile, match="holds no secret key"):
        sign.fingerprint(tmp_path)


def test_an_existing_key_is_never_replaced(key, monkeypatch):
    monkeypatch.setenv(sign.PASSPHRASE_ENV, "right")
    with pytest.raises(BadFile, match="exists: a new key never replaces one"):
        sign.generate(key[0])


def test_what_users_get_trusts_the_key_for_one_repository_and_reads_the_lookaside(tmp_path):
    policy = sign.policy(tmp_path / "signing-key.pub.asc", "registry.example.com/ml/pytorch-cuda")
    assert policy["transports"]["docker"]["registry.example.com/ml/pytorch-cuda"] == [
        {"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(tmp_path / "signing-key.pub.asc"),
         "signedIdentity": {"type": "matchRepository"}}]
    conf = sign.registries_d(tmp_path / "d", "registry.example.com/ml", "https://sigs.example.com", staging=False)
    assert (conf / "pytorch-cuda.yaml").read_text() == "docker:\n  registry.example.com/ml:\n    lookaside: https://sigs.example.com\n"
