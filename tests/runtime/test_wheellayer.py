"""wheellayer.py, the step of each wheel layer: in a real venv with pip, from a folder of locked wheel files
(no network). A layer installs its wheels, gives every file and directory it wrote the epoch,
and touches nothing an earlier layer installed: a byte-code file of an earlier wheel rewritten
would be copied into this layer."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pytorch_cuda_runtime import wheellayer  # noqa: E402

from helpers import make_wheel  # noqa: E402

SCRIPT = ROOT / "pytorch_cuda_runtime" / "wheellayer.py"
EPOCH = 1767225600
# Apart from the venv's folder, whose time the first test holds still.
SCRATCH = Path(tempfile.gettempdir()) / f"wheellayer-scratch-{os.getpid()}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A venv with pip, and a wheelhouse of two tiny wheels; pip reads only the wheelhouse."""
    tmp = tmp_path_factory.mktemp("wheellayer")
    venv.create(tmp / "venv", with_pip=True)
    house = tmp / "house"
    house.mkdir()
    hashes = {
        "alpha": make_wheel(house, "alpha", "1.0", {"alpha/__init__.py": "A = 1\n", "alpha/include/alpha.h": "#pragma once\n",
                                                       "alpha/include/__init__.py": "",
                                                       "alpha/py399.py": "def f(x) => x\n"}),  # not this Python's syntax
        "beta": make_wheel(house, "beta", "2.0", {"beta/__init__.py": "B = 2\n"}),
        "gamma": make_wheel(house, "gamma", "3.0", {"gamma/__init__.py": "G = 3\n", "gamma/sub/data.txt": "g\n"}),
    }
    run_env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)}
    return tmp / "venv" / "bin" / "python", house, hashes, run_env


def site(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True)
    return Path(out.stdout.strip())


def layer(python: Path, house: Path, run_env: dict, *args: str) -> subprocess.CompletedProcess:
    """One layer's step: the wheels from `house` (read only in a build: a bind mount of the store's
    files), pip's scratch space in house's sibling `scratch` (a tmpfs in a build)."""
    scratch = SCRATCH
    scratch.mkdir(exist_ok=True)
    return subprocess.run([str(python), str(SCRIPT), "--epoch", str(EPOCH), "--wheels", str(house), "--scratch", str(scratch), *args],
                          capture_output=True, text=True, env=run_env, timeout=300)


def test_a_layer_installs_its_wheel_compiles_and_dates_its_own_files_and_leaves_earlier_ones(env):
    python, house, hashes, run_env = env
    venv_dir = python.parent.parent
    outside = venv_dir.parent.stat().st_mtime_ns
    first = layer(python, house, run_env, f"alpha==1.0 --hash=sha256:{hashes['alpha']}")
    assert first.returncode == 0, first.stderr
    assert "wheellayer: no byte-code for " in first.stdout and "py399.py: not Python" in first.stdout  # as pip leaves it
    sp = site(python)
    header, init = sp / "alpha/include/alpha.h", sp / "alpha/__init__.py"
    pyc = Path(importlib.util.cache_from_source(str(init)))
    include_pyc = Path(importlib.util.cache_from_source(str(sp / "alpha/include/__init__.py")))
    dist_info = sp / "alpha-1.0.dist-info"
    for p in (header, init, pyc, include_pyc, dist_info / "RECORD", pyc.parent, sp / "alpha", sp, sp.parent, dist_info):
        assert p.stat().st_mtime == EPOCH, p  # files, byte-code and every directory above them
    assert venv_dir.stat().st_mtime == EPOCH
    assert venv_dir.parent.stat().st_mtime_ns == outside  # nothing above the venv: not the layer's, maybe not ours
    flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
    assert flags == 0b01, "hash-based byte-code, unchecked (flags 1)"
    assert not list((SCRATCH / ".tmp").iterdir())  # pip's scratch space was the scratch mount's, and is gone
    assert not (house / ".tmp").exists()  # the wheels' folder is only read
    earlier = {p: p.stat().st_mtime_ns for p in (header, init, pyc)}
    lock = house / "requirements.lock"
    lock.write_text(f"# header\nalpha==1.0 \\\n    --hash=sha256:{hashes['alpha']}\nbeta==2.0 \\\n    --hash=sha256:{hashes['beta']}\n    # via x\n")
    second = layer(python, house, run_env, "--rest", str(lock))
    assert second.returncode == 0, second.stderr
    assert "1 wheel(s) in this layer: beta==2.0" in second.stdout
    assert Path(importlib.util.cache_from_source(str(sp / "beta/__init__.py"))).exists()
    assert {p: p.stat().st_mtime_ns for p in earlier} == earlier  # alpha's files untouched
    assert (sp / "beta").stat().st_mtime == EPOCH
    again = layer(python, house, run_env, "--rest", str(lock))
    assert again.returncode == 0 and "every pin is installed already" in again.stdout


def test_a_wheel_whose_hash_is_not_the_locked_one_fails_the_layer(env, tmp_path):
    python, house, hashes, run_env = env
    own = tmp_path / "house"  # a file whose hash is not the one asked for: refused before pip (beta is installed already)
    own.mkdir()
    (own / "beta-2.0-py3-none-any.whl").write_bytes((house / "beta-2.0-py3-none-any.whl").read_bytes())
    proc = layer(python, own, {**run_env, "PIP_FIND_LINKS": str(own)}, f"beta==2.0 --hash=sha256:{'0' * 64}")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"wheellayer: no file in {own} has a locked hash of beta==2.0"


def test_owner_and_group_rights_go_to_the_layers_own_entries_only(env):
    """--owner: the layer's files and the directories above them get the owner, and the group the
    owner's rights (so uid 1000 and any uid in group 0 may pip install over them); an earlier
    layer's files keep theirs. As root, the image's own 1000:0; otherwise this user's own ids."""
    python, house, hashes, run_env = env
    uid, gid = (1000, 0) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    sp = site(python)
    before = (sp / "alpha/__init__.py").stat() if (sp / "alpha/__init__.py").exists() else None
    proc = layer(python, house, run_env, "--owner", f"{uid}:{gid}", f"gamma==3.0 --hash=sha256:{hashes['gamma']}")
    assert proc.returncode == 0, proc.stderr
    pyc = Path(importlib.util.cache_from_source(str(sp / "gamma/__init__.py")))
    for p in (sp / "gamma/__init__.py", sp / "gamma/sub/data.txt", pyc, pyc.parent, sp / "gamma/sub", sp / "gamma", sp,
              python.parent.parent, sp / "gamma-3.0.dist-info/RECORD"):
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (uid, gid), p
        assert (st.st_mode >> 3) & 0o7 == (st.st_mode >> 6) & 0o7, f"{p}: {oct(st.st_mode)} (group rights != owner's)"
    if before is not None:  # an earlier layer's file: neither owner nor mode touched
        after = (sp / "alpha/__init__.py").stat()
        assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
    bad = layer(python, house, run_env, "--owner", "trainer:0", f"gamma==3.0 --hash=sha256:{hashes['gamma']}")
    assert bad.returncode == 2 and "--owner takes numeric UID:GID, not 'trainer:0'" in bad.stderr, bad.stderr


def test_arguments_and_lock_reading():
    lock = "# h\nalpha==1.0 \\\n    --hash=sha256:aa\n    # via b\nBeta_Two==2.0 \\\n    --hash=sha256:bb\n"
    assert [(p.name, p.version) for p in wheellayer.pins(lock)] == [("alpha", "1.0"), ("beta-two", "2.0")]
    assert [p.name for p in wheellayer.rest(lock, {"alpha": "1.0", "beta-two": "1.9"})] == ["beta-two"]  # older: replaced
    assert wheellayer.same_version("2026.09.1", "2026.9.1") and not wheellayer.same_version(None, "1")
    with pytest.raises(SystemExit):
        wheellayer.main(["--epoch", "1"])  # neither requirements nor --rest
