#!/usr/bin/env python3
"""Build, test and tag pinned PyTorch + CUDA images: `python build.py --torch 2.7 --cuda 12.1`.

A thin entry point. On first use it creates .venv with the host tool's pinned
dependencies (pytorch_cuda_build/requirements.txt) and re-runs itself there, so a fresh
clone needs nothing but Python 3.10+. The pipeline itself is in pytorch_cuda_build/.
"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
REQUIREMENTS = ROOT / "pytorch_cuda_build" / "requirements.txt"


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _ensure_venv() -> None:
    stamp = VENV / ".requirements-sha256"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == want and _venv_python().exists():
        return
    print("==> setting up .venv for the build tool (once)", file=sys.stderr, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([str(_venv_python()), "-m", "pip", "install", "--quiet", "--quiet", "-r", str(REQUIREMENTS)], check=True)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: could not set up {VENV} (exit {e.returncode}); is python3-venv installed and the package index reachable?")
    stamp.write_text(want)


if __name__ == "__main__":
    if sys.version_info < (3, 10):
        sys.exit("error: build.py needs Python 3.10 or newer")
    if Path(sys.prefix).resolve() != VENV.resolve():
        _ensure_venv()
        os.execv(str(_venv_python()), [str(_venv_python()), str(Path(__file__).resolve()), *sys.argv[1:]])
    sys.path.insert(0, str(ROOT))
    from pytorch_cuda_build.cli import main

    sys.exit(main())
