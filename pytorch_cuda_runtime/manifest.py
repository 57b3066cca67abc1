"""The build-time manifest and pure helpers to compare versions and GPU archs.

No torch: used by the banner, the smoke orchestrator and unit tests alike. Versions are
read with packaging.version, which every environment that runs this code has (DeepSpeed
requires it; so does the host tool's pytest).
"""
import json
import os
import re
from typing import Any, Iterable

DEFAULT_PATH = "/opt/pytorch-cuda/manifest.json"


def manifest_path() -> str:
    return os.environ.get("PYTORCH_CUDA_MANIFEST") or DEFAULT_PATH


def load(path: str | None = None) -> dict[str, Any]:
    """Return the manifest dict; raises OSError/ValueError with the path in it."""
    path = path or manifest_path()
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    # Facts measured at build time live beside the rendered manifest: what the installed
    # torch reports (its arch list) and how the DeepSpeed ops were built (their arch list,
    # toolkit, patches). The manifest's own keys win.
    for name in ("torch-facts.json", "ops-facts.json"):
        facts = os.path.join(os.path.dirname(path), name)
        if os.path.exists(facts):
            with open(facts, encoding="utf-8") as f:
                data = {**json.load(f), **data}
    return data


def release(v: object) -> tuple[int, ...]:
    """'2.7.1+cu126' -> (2, 7, 1): the release numbers (the local part names the build, not
    the release); () for what is no version at all ('N/A' from a driver query, say)."""
    # Imported here, not at the top: the banner runs at every container start and needs
    # versions only when it sees a GPU.
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(v).strip()).release
    except InvalidVersion:
        return ()


def versions_match(expected: object, actual: object) -> bool:
    """True when the two versions agree on every component both of them state.

    The manifest may be more precise than a library can report (cuDNN
    '9.5.1.17' vs 9.5.1 from torch) or less ('3.11' vs '3.11.2'), so compare the
    common prefix, but require at least major.minor.
    """
    if expected is None or actual is None:
        return expected == actual
    e, a = release(expected), release(actual)
    n = min(len(e), len(a))
    if n < 2 and not (len(e) == len(a) == 1):
        return False
    return e[:n] == a[:n]


def cudnn_version_string(v: int | str | None) -> str | None:
    """torch.backends.cudnn.version() int -> 'X.Y.Z' (cuDNN 9 changed the encoding)."""
    if v is None:
        return None
    v = int(v)
    if v >= 90000:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def cap_to_sm(cap: str | tuple[int, int]) -> str:
    """'8.9' or (8, 9) -> 'sm_89'."""
    major, minor = cap.strip().split(".")[:2] if isinstance(cap, str) else cap
    return f"sm_{int(major)}{int(minor)}"


def arch_supported(cap: str | tuple[int, int], arch_list: Iterable[str] | None) -> tuple[bool, str]:
    """(ok, how) for a device capability against torch's arch list.

    A cubin for sm_XY runs on any device of the same major and minor >= Y, so
    an sm_89 GPU is served by sm_86 code; PTX (compute_XY) JIT-compiles for
    anything newer, at a start-up cost.
    """
    sm = cap_to_sm(cap)
    major, minor = int(sm[3:-1]), int(sm[-1])
    archs = set(arch_list or [])
    if sm in archs:
        return True, f"{sm} in arch list"
    cubins = [(int(m.group(1)), int(m.group(2)), a) for a in archs
              for m in [re.fullmatch(r"sm_(\d+)(\d)a?", a)] if m]
    same = [c for c in cubins if c[0] == major and c[1] <= minor]
    if same:
        return True, f"{sm} runs {max(same)[2]} code (same major)"
    ptx = [(int(m.group(1)), int(m.group(2)), a) for a in archs
           for m in [re.fullmatch(r"compute_(\d+)(\d)", a)] if m]
    ptx = [c for c in ptx if c[:2] <= (major, minor)]
    if ptx:
        return True, f"{sm} via PTX {max(ptx)[2]} (JIT at first use)"
    return False, f"{sm} not in arch list {' '.join(sorted(archs))}"
