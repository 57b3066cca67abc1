"""BuildKit's progress stream, read as events: one parser for every consumer.

BuildKit reports progress per *vertex* (a Dockerfile step, or an internal one such as
loading the context). Docker 20.10's built-in BuildKit offers only `--progress=plain`,
whose lines are that structure written out:

    #9 [ops-builder 3/5] RUN pip wheel deepspeed     a vertex starts (stage, k of M, command)
    #9 12.3 Collecting torch                          its output, seconds since it started
    #9 DONE 201.5s                                    it finished
    #9 CACHED                                         it was served from the layer cache
    #9 ERROR: process "/bin/sh -c ..." did not ...    it failed

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

PLAIN, RAWJSON = "plain", "rawjson"

_VERTEX = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
_POSITION = re.compile(r"^(?:(\S+) )?(\d+)/(\d+)$")  # "ops-builder 3/5", or "3/5" in an unnamed stage
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
            return [Output(m.group(1), m.group(3))]
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
        self._buf = ""
        self._decoder = json.JSONDecoder()

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
            if digest not in self.steps and name:
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
            elif v.get("completed") and v.get("started"):
                self._ended.add(digest)
                events.append(Done(digest, round((_time(v["completed"]) - _time(v["started"])).total_seconds(), 1)))
        for log in status.get("logs") or []:
            data = base64.b64decode(log.get("data") or "").decode(errors="replace")
            events += [Output(log.get("vertex", ""), ln) for ln in data.splitlines() if ln.strip()]
        return events


def parser(mode: str = PLAIN) -> PlainParser | RawJSONParser:
    return RawJSONParser() if mode == RAWJSON else PlainParser()


def detect(text: str) -> str:
    """Which progress format a saved build log is in (its first line is our `$ command`)."""
    return RAWJSON if "--progress=rawjson" in text.split("\n", 1)[0] else PLAIN


@dataclass
class StepRecord:
    step: Step
    seconds: float = 0.0
    cached: bool = False
    error: str = ""
    output: list[str] = field(default_factory=list)


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
                    r.seconds = ev.seconds
                elif isinstance(ev, Cached):
                    r.cached = True
                elif isinstance(ev, Failed):
                    r.error = ev.message
                else:
                    r.output.append(ev.text)
    return list(records.values())


def steps(text: str) -> list[dict]:
    """The Dockerfile steps (not BuildKit's internal vertices) of a saved log: stage, command, seconds, cached."""
    return [{"stage": r.step.stage, "cmd": r.step.name[:120], "seconds": r.seconds, "cached": r.cached}
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
        end = f"ERROR: {r.error}" if r.error else "CACHED" if r.cached else f"DONE {r.seconds:.1f}s"
        lines.append(f"#{r.step.id[7:19]} {end}")
    return "\n".join(lines) + "\n"
