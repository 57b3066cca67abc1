"""Check results: one record per (check, run, rank), a table and a JSON report.

Workers (one process per rank) write their records to a JSON file after every
check, so a rank killed by a timeout still leaves what it had proven.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIPPED", "INFO"
Record = dict[str, Any]  # one check's record: check, status, run, rank, expected, actual, detail (record())


def record(check: str, status: str, run: str = "", rank: int | None = None, expected: Any = None, actual: Any = None,
           detail: str = "") -> Record:
    return {"check": check, "status": status, "run": run, "rank": rank,
            "expected": expected, "actual": actual, "detail": detail}


def describe(r: Record) -> str:
    """One line that says what was expected and what was seen."""
    parts = []
    if r["status"] == FAIL and (r["expected"] is not None or r["actual"] is not None):
        parts.append(f"expected {r['expected']!r}, got {r['actual']!r}")
    elif r["actual"] is not None:
        parts.append(str(r["actual"]))
    if r["detail"]:
        parts.append(r["detail"])
    return "; ".join(parts)


def table(records: Iterable[Record], width: int = 100) -> str:
    rows = [("CHECK", "RUN", "RANK", "STATUS", "DETAIL")]
    for r in records:
        rank = "-" if r["rank"] is None else str(r["rank"])
        d = describe(r).replace("\n", " ")
        rows.append((r["check"], r["run"] or "-", rank, r["status"],
                     d if len(d) <= width else d[:width - 3] + "..."))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {s:<{w[3]}}  {d}".rstrip()
                     for a, b, c, s, d in rows)


def summary(records: Iterable[Record]) -> dict[str, int]:
    out = {PASS: 0, FAIL: 0, SKIP: 0, INFO: 0}
    for r in records:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def failed(records: Iterable[Record]) -> bool:
    return any(r["status"] == FAIL for r in records)


def write_report(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


class Recorder:
    """Per-rank collector used inside worker processes."""

    def __init__(self, out_dir: str | None, run: str, rank: int) -> None:
        self.path = os.path.join(out_dir, f"rank{rank}.json") if out_dir else None
        self.run, self.rank = run, rank
        self.records: list[Record] = []

    def add(self, check: str, status: str, expected: Any = None, actual: Any = None, detail: str = "") -> None:
        self.records.append(record(check, status, self.run, self.rank, expected, actual, detail))
        if self.path:  # flush every time: survive being killed later
            write_report(self.path, self.records)

    def check(self, check: str, ok: bool, expected: Any = None, actual: Any = None, detail: str = "") -> bool:
        self.add(check, PASS if ok else FAIL, expected, actual, detail)
        return ok

    def info(self, check: str, actual: Any, detail: str = "") -> None:
        self.add(check, INFO, actual=actual, detail=detail)


def read_rank_files(out_dir: str) -> list[Record]:
    recs: list[Record] = []
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                recs.extend(json.load(f))
    return recs
