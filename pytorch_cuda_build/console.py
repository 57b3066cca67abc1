"""What a person (or CI) sees while rows build; the full raw log always goes to build.log.

Four consoles, picked by `make()`:
- `Quiet` (--quiet): the `==> ` lines only.
- `CI` (stdout or stderr not a terminal, or $CI set): one line per finished build step and
  smoke step, with its time: `[ops-builder 5/9] RUN python opsbuild.py ... 705.2s`.
- `Verbose` (--verbose): BuildKit's raw log as it streams, the smoke steps as in CI.
- `Live` (a terminal): a rich live view of the current stage, the build steps running with
  their elapsed time (BuildKit's step k of M of a stage), the smoke checks as they pass;
  finished steps scroll above it.
Every console ends with one summary table on stdout.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

from . import progress

NAME_WIDTH = 60
_SMOKE_STEP = re.compile(r"^\s+(\S+): rc=(-?\d+) (\d+(?:\.\d+)?)s( TIMEOUT)?$")  # pytorch_cuda_runtime/smoke/cli.py, Suite.step
_SMOKE_TOTAL = re.compile(r"^\d+ passed, \d+ failed, \d+ skipped")  # its last line


def short(name: str, width: int = NAME_WIDTH) -> str:
    name = " ".join(name.split())
    return name if len(name) <= width else name[:width - 4] + " ..."


def step_line(step: progress.Step, seconds: float | None = None, cached: bool = False, error: str = "") -> str:
    """One finished build step, as CI shows it."""
    head = f"[{step.label}] {short(step.name)}"
    if error:
        return f"{head} FAILED after {seconds or 0:.1f}s: {short(error, 100)}"
    return f"{head} CACHED" if cached else f"{head} {seconds or 0:.1f}s"


def smoke_line(line: str) -> str | None:
    """A smoke-suite line worth a line of its own (a finished step, the totals), else None."""
    line = line.rstrip()
    if m := _SMOKE_STEP.match(line):
        name, rc, secs, timeout = m.groups()
        verdict = "TIMEOUT" if timeout else "ok" if rc == "0" else f"FAILED (exit {rc})"
        return f"[smoke] {name} {verdict} {float(secs):.1f}s"
    if _SMOKE_TOTAL.match(line):
        return f"[smoke] {line.split(';')[0]}"
    return None


def _stage_names(results: Iterable) -> list[str]:
    names: list[str] = []
    for r in results:
        names += [k for k in r.seconds if k not in names]
    return names


def summary_table(results: list) -> list[str]:
    """One row per result (pipeline.RowResult): row, result, size, seconds per stage, total, tags."""
    stages = _stage_names(results)
    rows = [("ROW", "RESULT", "SIZE", *[s.upper() for s in stages], "TOTAL", "TAGS")]
    for r in results:
        size = f"{r.size_bytes / 1e9:.2f} GB" if r.size_bytes else "-"
        times = [f"{r.seconds[s]:.1f}s" if s in r.seconds else "-" for s in stages]
        rows.append((r.image, "ok" if r.ok else f"exit {r.exit_code}", size, *times, f"{r.total:.1f}s", " ".join(r.tags) or "-"))
    lines = columns(rows)
    lines += [f"{r.image}: {r.error[0]}" for r in results if not r.ok and r.error]
    return lines


class Quiet:
    """The `==> ` lines and the summary; nothing of the build's progress."""

    follows_smoke = False

    def __init__(self, err: TextIO | None = None, out: TextIO | None = None) -> None:
        self.err, self.out = err or sys.stderr, out or sys.stdout
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            print(text, file=self.err, flush=True)

    def log(self, msg: str) -> None:
        self.say(f"==> {msg}")

    def stage_start(self, name: str) -> None:
        pass

    def stage_end(self, name: str, seconds: float) -> None:
        pass

    def build_sink(self, mode: str = progress.PLAIN) -> Callable[[str], None] | bool:
        """What build.run gets as `echo`: False (nothing), True (raw to stderr) or a line callback."""
        return False

    def smoke(self, line: str) -> None:
        pass

    def row_started(self, name: str, log_path: Path) -> None:
        pass

    def row_done(self, name: str) -> None:
        pass

    def summary(self, results: list, logs: Path | None = None) -> None:
        for line in summary_table(results):
            print(line, file=self.out)
        if logs:
            print(f"logs:   {logs}", file=self.out)
        self.out.flush()

    def close(self) -> None:
        pass

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CI(Quiet):
    """One line per finished step, with its time: greppable, and readable in a CI log."""

    follows_smoke = True

    def stage_end(self, name: str, seconds: float) -> None:
        self.log(f"{name}: {seconds:.1f}s")

    def build_sink(self, mode: str = progress.PLAIN) -> Callable[[str], None] | bool:
        parser, started = progress.parser(mode), {}

        def sink(line: str) -> None:
            for ev in parser.feed(line):
                if isinstance(ev, progress.Started):
                    started[ev.step.id] = (ev.step, time.monotonic())
                elif not isinstance(ev, progress.Output) and ev.step_id in started:
                    step, t0 = started.pop(ev.step_id)
                    if step.position:  # BuildKit's internal vertices are noise here
                        self.step_finished(step, ev, time.monotonic() - t0)
                    elif isinstance(ev, progress.Failed) and ev.message != "canceled":
                        self.step_finished(step, ev, time.monotonic() - t0)
                else:
                    self.step_output(ev)
        return sink

    def step_finished(self, step: progress.Step, ev: Any, elapsed: float) -> None:
        if isinstance(ev, progress.Done):
            self.say(step_line(step, ev.seconds))
        elif isinstance(ev, progress.Cached):
            self.say(step_line(step, cached=True))
        elif ev.message != "canceled":
            self.say(step_line(step, elapsed, error=ev.message))

    def step_output(self, ev: Any) -> None:
        pass

    def smoke(self, line: str) -> None:
        shown = smoke_line(line)
        if shown:
            self.say(shown)


class Verbose(CI):
    """BuildKit's raw log as it streams (as before this console existed)."""

    def build_sink(self, mode: str = progress.PLAIN) -> Callable[[str], None] | bool:
        return True


class Live(CI):
    """A rich live view on the terminal; finished steps scroll above it."""

    def __init__(self, err: TextIO | None = None, out: TextIO | None = None) -> None:
        super().__init__(err, out)
        from rich.console import Console as RichConsole  # here: rich only where a terminal shows it
        from rich.live import Live as RichLive  # here: rich only where a terminal shows it

        self.con = RichConsole(file=self.err)
        self.stdout = RichConsole(file=self.out)
        self.stage, self.stage_t0 = "", time.monotonic()
        self.running: dict[str, tuple[progress.Step, float]] = {}
        self.steps_done = 0
        self.smoke_done: list[str] = []
        self.rows: dict[str, tuple[float, Path]] = {}
        self.live = RichLive(get_renderable=self._render, console=self.con, refresh_per_second=4, transient=True)
        self.live.start()

    def say(self, text: str) -> None:
        from rich.text import Text  # here: rich only where a terminal shows it
        self.con.print(Text(text), soft_wrap=True)

    def stage_start(self, name: str) -> None:
        self.stage, self.stage_t0 = name, time.monotonic()
        self.running.clear()

    def stage_end(self, name: str, seconds: float) -> None:
        self.say(f"==> {name}: {seconds:.1f}s")
        self.stage = ""

    def build_sink(self, mode: str = progress.PLAIN) -> Callable[[str], None] | bool:
        sink = super().build_sink(mode)
        assert callable(sink)  # CI's: a line parser
        parser = progress.parser(mode)

        def both(line: str) -> None:
            for ev in parser.feed(line):  # a second parser keeps what is running now
                if isinstance(ev, progress.Started) and ev.step.position:
                    self.running[ev.step.id] = (ev.step, time.monotonic())
                elif not isinstance(ev, (progress.Started, progress.Output)) and ev.step_id in self.running:
                    del self.running[ev.step_id]
                    self.steps_done += 1
            sink(line)
        return both

    def smoke(self, line: str) -> None:
        shown = smoke_line(line)
        if shown:
            self.smoke_done.append(shown)
            self.say(shown)

    def row_started(self, name: str, log_path: Path) -> None:
        self.rows[name] = (time.monotonic(), log_path)

    def row_done(self, name: str) -> None:
        self.rows.pop(name, None)

    def _render(self) -> Any:
        from rich.console import Group  # here: rich only where a terminal shows it
        from rich.spinner import Spinner  # here: rich only where a terminal shows it
        from rich.text import Text  # here: rich only where a terminal shows it

        now = time.monotonic()
        parts: list[Spinner | Text] = []
        if self.stage:
            parts.append(Spinner("dots", Text(f"{self.stage}  {now - self.stage_t0:.0f}s", style="bold")))
        for step, t0 in list(self.running.values()):
            assert step.position is not None  # only steps with a position are kept in running (above)
            k, total = step.position[1:]
            parts.append(Text(f"   step {k} of {total}  [{step.label}] {short(step.name)}  {now - t0:.0f}s"))
        if self.stage == "build" and self.steps_done:
            parts.append(Text(f"   {self.steps_done} step(s) finished", style="dim"))
        if self.stage == "test" and self.smoke_done:
            parts.append(Text(f"   smoke: {len(self.smoke_done)} step(s) done; last: {self.smoke_done[-1][8:]}", style="dim"))
        for name, (t0, log_path) in list(self.rows.items()):
            parts.append(Spinner("dots", Text(f"{name}  {now - t0:.0f}s  {short(_last_line(log_path), 80)}")))
        return Group(*parts)

    def summary(self, results: list, logs: Path | None = None) -> None:
        self.close()
        from rich.table import Table  # here: rich only where a terminal shows it

        stages = _stage_names(results)
        table = Table("row", "result", "size", *stages, "total", "tags", title="pytorch-cuda")
        for r in results:
            table.add_row(r.image, "[green]ok[/]" if r.ok else f"[red]exit {r.exit_code}[/]",
                          f"{r.size_bytes / 1e9:.2f} GB" if r.size_bytes else "-",
                          *[f"{r.seconds[s]:.1f}s" if s in r.seconds else "-" for s in stages],
                          f"{r.total:.1f}s", "\n".join(r.tags) or "-")
        self.stdout.print(table)
        for r in results:
            if not r.ok and r.error:
                self.stdout.print(f"{r.image}: {r.error[0]}", markup=False, highlight=False)
        if logs:
            self.stdout.print(f"logs:   {logs}", markup=False, highlight=False)

    def close(self) -> None:
        if self.live.is_started:
            self.live.stop()


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 2048))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    except OSError:
        return ""


def make(verbose: bool = False, quiet: bool = False) -> Quiet:
    if quiet:
        return Quiet()
    if verbose:
        return Verbose()
    terminal = sys.stdout.isatty() and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    return Live() if terminal and not os.environ.get("CI") else CI()


def columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as aligned text lines, two spaces between columns."""
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
