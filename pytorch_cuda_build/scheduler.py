"""Many rows (`build.py build --all --jobs N`): `--jobs` rows at once, each through its own
pipeline (pipeline.py) as its own `build.py build` process (its own signal handling, its own
container cleanup, its log in build-results/<image>/run.log). Each child writes a typed
RowResult to a JSON file that this scheduler reads back. BuildKit merges the steps
concurrent builds share, so a layer common to several rows is built once.
"""
from __future__ import annotations

import concurrent.futures as futures
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .console import Quiet
from .engine import docker_env
from .errors import NoSuchRow, PipelineError
from .matrix import Image, Matrix
from .pipeline import Options, RowResult, build_platforms, build_row, check_inputs, recorded, results_dir

# ---- many rows -----------------------------------------------------------------


def select_rows(m: Matrix, torch: str | None, cuda: str | None, flavor: str) -> list[Image]:
    images = [i for i in m.images if i.flavor == flavor and torch in (None, i.torch, i.torch_minor) and cuda in (None, i.cuda)]
    if not images:
        raise NoSuchRow(f"no rows match --torch {torch} --cuda {cuda} --flavor {flavor}", name="--torch")
    return images


# A row's own `build.py` command line, given where it writes its RowResult (arguments.BuildOptions.child_argv).
ChildArgv = Callable[[Image, Path], list[str]]


class RowProcesses:
    """A scheduler's worker: each row as its own `build.py build` process, its stdout and
    stderr in build-results/<image>/run.log, its RowResult read from the JSON it writes."""

    def __init__(self, root: Path, child_argv: ChildArgv) -> None:
        self.root, self.child_argv = root, child_argv
        self.running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def log_path(self, image: Image) -> Path:
        return results_dir(self.root, image) / "run.log"

    def __call__(self, image: Image) -> RowResult:
        results = results_dir(self.root, image)
        results.mkdir(parents=True, exist_ok=True)
        result_file = results / "result.json"
        result_file.unlink(missing_ok=True)  # never read an earlier run's answer
        cmd = [sys.executable, str(self.root / "build.py"), *self.child_argv(image, result_file)]
        with open(self.log_path(image), "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            with self._lock:
                self.running.add(proc)
            try:
                rc = proc.wait()
            finally:
                with self._lock:
                    self.running.discard(proc)
        try:
            result = RowResult.from_json(result_file.read_text())
        except (OSError, ValueError, TypeError):
            return RowResult(image.name, False, rc or 1, error=[f"exit {rc} without a result (see {self.log_path(image)})"])
        if rc != 0 and result.ok:  # the process's own word is final
            result.ok, result.exit_code = False, rc
        return result

    def stop(self) -> None:
        """SIGTERM every running row: each removes its containers and moves no tag."""
        with self._lock:
            procs = list(self.running)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()


def schedule(images: list[Image], worker: Callable[[Image], RowResult], jobs: int, console: Quiet,
             log_path: Callable[[Image], Path], stop: Callable[[], None] = lambda: None) -> list[RowResult]:
    """Run worker on every row, `jobs` at once; the results in the rows' order.

    A worker's typed error (PipelineError) is that row's failed result; any other exception
    is a bug: the other rows are stopped and it goes up. On Ctrl-C or SIGTERM the rows not
    started never start and the running ones are stopped before the interrupt goes up.
    """
    done: dict[str, RowResult] = {}

    def one(image: Image) -> RowResult:
        console.log(f"{image.name}: started (log: {log_path(image)})")
        console.row_started(image.name, log_path(image))
        t0 = time.monotonic()
        try:
            result = worker(image)
        except PipelineError as e:
            result = RowResult(image.name, False, e.exit_code, error=e.lines())
        finally:
            console.row_done(image.name)
        console.log(f"{image.name}: {'ok' if result.ok else 'FAILED'} after {time.monotonic() - t0:.0f} s")
        return result

    pool = futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="row")
    pending = {pool.submit(one, image): image for image in images}
    try:
        while pending:
            finished, _ = futures.wait(pending, timeout=0.5, return_when=futures.FIRST_COMPLETED)
            for f in finished:
                done[pending.pop(f).name] = f.result()
    except BaseException:
        for f in pending:
            f.cancel()
        stop()
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
    return [done[i.name] for i in images]


def failures(results: list[RowResult]) -> PipelineError | None:
    failed = [r.image for r in results if not r.ok]
    if not failed:
        return None
    return PipelineError(f"{len(failed)} of {len(results)} rows failed: {', '.join(failed)} (each row's run.log under build-results/)")


def build_many(root: Path, m: Matrix, images: list[Image], jobs: int, console: Quiet, child_argv: ChildArgv) -> list[RowResult]:
    """Every row of images through its own pipeline, `jobs` at a time."""
    check_inputs(root, m, images)
    docker_env.ensure_engine(console.log)
    worker = RowProcesses(root, child_argv)
    return schedule(images, worker, jobs, console, worker.log_path, worker.stop)


def build(root: Path, m: Matrix, images: list[Image], on: list[Image], opts: Options, console: Quiet, *, every: bool, jobs: int,
          child_argv: ChildArgv, result_json: Path | None) -> list[RowResult]:
    """`build`: every row of images as child processes (--all), or one row, on each of its
    platforms `on` (one: recorded to result_json for a parent scheduler)."""
    if every:
        results = build_many(root, m, images, jobs, console, child_argv)
    elif len(on) == 1:
        results = [recorded(result_json, on[0], lambda: build_row(root, on[0], opts, console))]
    else:
        results = build_platforms(root, on, opts, console)
    console.summary(results, root / "build-results" if every else results_dir(root, on[0] if len(on) == 1 else images[0]))
    return results
