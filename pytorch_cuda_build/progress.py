"""BuildKit's progress stream, read as events: one parser for every consumer.

BuildKit reports progress per *vertex* (a Dockerfile step, or an internal one such as
loading the context). Docker 20.10's built-in BuildKit offers only `--progress=plain`,
whose lines are that structure written out:

    #9 [ops-builder 3/5] RUN pip wheel deepspeed     a vertex starts (stage, k of M, command)
    #9 12.3 Collecting torch                          its output, seconds since it started
    #9 DONE 201.5s                                    it finished
    #9 CACHED                                         it was served from the layer cache
    #9 ERROR: process "/bin/sh -c ..." did not ...    it failed

A vertex with none of the three ends (the build was interrupted, or the daemon or the client
went away) did not finish: it is shown as NOT FINISHED, with how long it ran as far as the
log tells, never as done.

buildx >= 0.12 also offers `--progress=rawjson`: BuildKit's SolveStatus objects as JSON
(vertexes with started/completed times, base64 logs). Both parsers yield the same events,
so the console, the benchmark and the failure report never match log text themselves.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

PLAIN, RAWJSON = "plain", "rawjson"

_VERTEX = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
# "ops-builder 3/5", or "3/5" in an unnamed stage; BuildKit pads k to M's width ("train  2/15").
_POSITION = re.compile(r"^(?:(\S+) +| *)(\d+)/(\d+)$")
_DONE = re.compile(r"^#(\d+) DONE (\d+(?:\.\d+)?)s$")
_CACHED = re.compile(r"^#(\d+) CACHED$")
_ERROR = re.compile(r"^#(\d+) (?:ERROR:? ?(.*)|CANCELED)$")
_OUTPUT = re.compile(r"^#(\d+) (?:(\d+(?:\.\d+)?) )?(.*)$")


@dataclass(frozen=True)
class Step:
    """A vertex: `[stage k/M] command`; internal vertices have no position."""

    id: str
    label: str  # what BuildKit shows between the brackets: "ops-builder 3/5", "internal"
    name: str  # the command: "RUN pip wheel deepspeed"

    @property
    def position(self) -> tuple[str, int, int] | None:
        """(stage, k, M) for a Dockerfile step, None for an internal vertex."""
        m = _POSITION.match(self.label)
        return (m.group(1) or "", int(m.group(2)), int(m.group(3))) if m else None

    @property
    def stage(self) -> str:
        return self.position[0] if self.position else self.label

    def __str__(self) -> str:
        return f"[{self.label}] {self.name}"


@dataclass(frozen=True)
class Started:
    step: Step


@dataclass(frozen=True)
class Output:
    step_id: str
    text: str
    seconds: float | None = field(default=None, compare=False)  # since its step started, where the stream says


@dataclass(frozen=True)
class Done:
    step_id: str
    seconds: float


@dataclass(frozen=True)
class Cached:
    step_id: str


@dataclass(frozen=True)
class Failed:
    step_id: str
    message: str


Event = Started | Output | Done | Cached | Failed


class PlainParser:
    """`--progress=plain` lines to events; a vertex is announced once, however often it is re-printed."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}
        self._seen: dict[str, float] = {}

    def elapsed(self, step_id: str) -> float | None:
        """How long an unfinished step had run by its last output line (a lower bound), or None."""
        return self._seen.get(step_id)

    def feed(self, line: str) -> list[Event]:
        line = line.rstrip("\n")
        if m := _VERTEX.match(line):
            n, label, name = m.groups()
            if n in self.steps:
                return []
            self.steps[n] = Step(n, label, name)
            return [Started(self.steps[n])]
        if m := _DONE.match(line):
            return [Done(m.group(1), float(m.group(2)))]
        if m := _CACHED.match(line):
            return [Cached(m.group(1))]
        if m := _ERROR.match(line):
            return [Failed(m.group(1), m.group(2) or "canceled")]
        if m := _OUTPUT.match(line):
            seconds = float(m.group(2)) if m.group(2) else None
            if seconds is not None:
                self._seen[m.group(1)] = max(seconds, self._seen.get(m.group(1), 0.0))
            return [Output(m.group(1), m.group(3), seconds)]
        return []  # the command line we logged, BuildKit's error summary, blank lines


def _time(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    s = re.sub(r"(\.\d{6})\d+", r"\1", s.replace("Z", "+00:00"))  # Go writes nanoseconds
    return dt.datetime.fromisoformat(s)


class RawJSONParser:
    """`--progress=rawjson` to events. BuildKit may indent the objects over several lines,
    so lines are buffered until a whole object decodes."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}
        self._ended: set[str] = set()
        self._started: dict[str, dt.datetime] = {}
        self._now: dt.datetime | None = None  # the latest time the stream has named
        self._buf = ""
        self._decoder = json.JSONDecoder()

    def elapsed(self, step_id: str) -> float | None:
        """How long an unfinished step had run by the last time the stream named, or None."""
        t0 = self._started.get(step_id)
        return round((self._now - t0).total_seconds(), 1) if t0 and self._now else None

    def _saw(self, when: str | None) -> dt.datetime | None:
        t = _time(when)
        if t is not None and (self._now is None or t > self._now):
            self._now = t
        return t

    def feed(self, line: str) -> list[Event]:
        self._buf += line
        events: list[Event] = []
        while self._buf.strip():
            text = self._buf.lstrip()
            try:
                obj, end = self._decoder.raw_decode(text)
            except json.JSONDecodeError:
                if not text.startswith(("{", "[")):  # not JSON at all (our `$ command` header): skip the line
                    self._buf = text.partition("\n")[2]
                    continue
                break  # an object cut mid-way: wait for more lines
            self._buf = text[end:]
            if isinstance(obj, dict):
                events += self._status(obj)
        return events

    def _status(self, status: dict) -> list[Event]:
        events: list[Event] = []
        for v in status.get("vertexes") or []:
            digest, name = v.get("digest", ""), v.get("name", "")
            started, _ = self._saw(v.get("started")), self._saw(v.get("completed"))
            if started is not None:
                self._started.setdefault(digest, started)
            # BuildKit lists vertices it has not started yet (no times): those have not begun
            if digest not in self.steps and name and (started or v.get("completed") or v.get("error")):
                m = re.match(r"^\[([^\]]+)\] (.*)$", name)
                self.steps[digest] = Step(digest, *(m.groups() if m else ("internal", name)))
                events.append(Started(self.steps[digest]))
            if digest in self._ended or digest not in self.steps:
                continue
            if v.get("error"):
                self._ended.add(digest)
                events.append(Failed(digest, v["error"]))
            elif v.get("cached") and v.get("completed"):
                self._ended.add(digest)
                events.append(Cached(digest))
            elif v.get("completed"):
                self._ended.add(digest)
                t0, t1 = started or self._started.get(digest), _time(v["completed"])
                events.append(Done(digest, round((t1 - t0).total_seconds(), 1) if t0 and t1 else 0.0))
        for st in status.get("statuses") or []:  # progress of pulls and transfers: only their times matter here
            self._saw(st.get("timestamp"))
        for log in status.get("logs") or []:
            data = base64.b64decode(log.get("data") or "").decode(errors="replace")
            when, t0 = self._saw(log.get("timestamp")), self._started.get(log.get("vertex", ""))
            seconds = round((when - t0).total_seconds(), 1) if when and t0 else None
            events += [Output(log.get("vertex", ""), ln, seconds) for ln in data.splitlines() if ln.strip()]
        return events


def parser(mode: str = PLAIN) -> PlainParser | RawJSONParser:
    return RawJSONParser() if mode == RAWJSON else PlainParser()


def detect(text: str) -> str:
    """Which progress format a saved build log is in (its first line is our `$ command`)."""
    return RAWJSON if "--progress=rawjson" in text.split("\n", 1)[0] else PLAIN


@dataclass
class StepRecord:
    step: Step
    seconds: float = 0.0  # unfinished: how long it ran as far as the log tells
    cached: bool = False
    error: str = ""
    output: list[str] = field(default_factory=list)
    finished: bool = False  # BuildKit reported DONE, CACHED or ERROR/CANCELED

    @property
    def end(self) -> str:
        """How the step ended, as plain progress writes it; NOT FINISHED where it never said."""
        if not self.finished:
            return f"NOT FINISHED after {self.seconds:.1f}s" if self.seconds else "NOT FINISHED"
        return f"ERROR: {self.error}" if self.error else "CACHED" if self.cached else f"DONE {self.seconds:.1f}s"


def replay(text: str, mode: str | None = None) -> list[StepRecord]:
    """Every vertex of a saved build log, in the order BuildKit started them."""
    p = parser(mode or detect(text))
    records: dict[str, StepRecord] = {}
    for line in text.splitlines(keepends=True):
        for ev in p.feed(line):
            if isinstance(ev, Started):
                records[ev.step.id] = StepRecord(ev.step)
            elif (r := records.get(ev.step_id)) is not None:
                if isinstance(ev, Done):
                    r.seconds, r.finished = ev.seconds, True
                elif isinstance(ev, Cached):
                    r.cached = r.finished = True
                elif isinstance(ev, Failed):
                    r.error, r.finished = ev.message, True
                else:
                    r.output.append(ev.text)
    for r in records.values():
        if not r.finished:
            r.seconds = p.elapsed(r.step.id) or 0.0
    return list(records.values())


def steps(text: str) -> list[dict]:
    """The Dockerfile steps (not BuildKit's internal vertices) of a saved log: stage, command, seconds,
    cached, finished (False: the build stopped while it ran; seconds is then how long it had run)."""
    return [{"stage": r.step.stage, "cmd": r.step.name[:120], "seconds": r.seconds, "cached": r.cached, "finished": r.finished}
            for r in replay(text) if r.step.position and r.step.stage]


def _failed(text: str) -> StepRecord | None:
    """The first Dockerfile step that failed (an internal vertex if none did); steps BuildKit
    cancelled because another failed ("canceled" in plain, "context canceled" in rawjson) are not it."""
    bad = [r for r in replay(text) if r.error and not r.error.endswith("canceled")]
    mine = [r for r in bad if r.step.position] or bad
    return mine[0] if mine else None


def failed_step(text: str) -> str | None:
    """The first Dockerfile step that failed, e.g. `[python-env 2/2] RUN ...`, or None."""
    r = _failed(text)
    return str(r.step)[:120] if r else None


def failure_tail(text: str, n: int = 25) -> str:
    """The last n lines a user needs after a build: the failed step's own output and its error
    where one failed, the log's last lines otherwise. rawjson groups output by step, so the last
    lines of its readable form are whichever step started last, rarely the one that failed."""
    r = _failed(text)
    if r is None:
        return "\n".join(readable(text).splitlines()[-n:])
    return "\n".join([str(r.step), *r.output[-(n - 2):], f"ERROR: {r.error}"])


def readable(text: str) -> str:
    """A saved log as plain lines: itself for plain, the decoded output for rawjson."""
    if detect(text) == PLAIN:
        return text
    lines = [text.split("\n", 1)[0]]
    for r in replay(text, RAWJSON):
        lines.append(f"#{r.step.id[7:19]} {r.step}")
        lines += [f"#{r.step.id[7:19]} {ln}" for ln in r.output]
        lines.append(f"#{r.step.id[7:19]} {r.end}")
    return "\n".join(lines) + "\n"


def log_tail(log_path: Path, n: int = 25) -> str:
    """The last lines of a build log worth showing: failure_tail of the file."""
    return failure_tail(log_path.read_text(errors="replace"), n)
