"""Check 1: library versions as reported at run time equal the baked manifest."""
from typing import Any, Callable

from .. import manifest as mf
from .results import FAIL, PASS, Record, record

# (check name, manifest key, probe key, how to turn the probe value into a version)
FIELDS: list[tuple[str, str, str, Callable[[Any], str | None]]] = [
    ("versions.torch", "torch", "torch", str),
    ("versions.torch_cuda", "torch_cuda", "torch_cuda", str),
    ("versions.cudnn", "cudnn", "cudnn", mf.cudnn_version_string),
    ("versions.nccl", "nccl", "nccl", str),
    ("versions.python", "python", "python", str),
    ("versions.deepspeed", "deepspeed", "deepspeed", str),
]


def check(manifest: dict[str, Any], facts: dict[str, Any]) -> list[Record]:
    out = []
    for name, mkey, pkey, conv in FIELDS:
        expected = manifest.get(mkey)
        if expected is None:
            out.append(record(name, FAIL, detail=f"manifest has no '{mkey}'"))
            continue
        raw = facts.get(pkey)
        actual = conv(raw) if raw is not None else None
        ok = mf.versions_match(expected, actual)
        err = facts.get(f"{pkey}_error", "")
        out.append(record(name, PASS if ok else FAIL, expected=str(expected), actual=actual,
                          detail="" if ok else (err or "library reports a different version")))
    out.append(_arch_list(manifest, facts))
    return out


def _arch_list(manifest, facts):
    expected, actual = manifest.get("cuda_arch_list"), facts.get("arch_list")
    if expected is None:
        return record("versions.cuda_arch_list", FAIL,
                      detail="manifest has no 'cuda_arch_list' (the banner needs it)")
    ok = sorted(expected) == sorted(actual or [])
    return record("versions.cuda_arch_list", PASS if ok else FAIL, expected=expected,
                  actual=" ".join(actual) if ok else actual)
