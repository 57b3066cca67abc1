"""A run that is stopped (`timeout`, Ctrl-C, a job's end) still writes what it found.

The smoke suite and gpucheck each take minutes to an hour; when a GPU machine is lent for
a fixed time, the run is often cut by `timeout`, and a report of the finished steps is worth
more than nothing. Inside `catching()`, SIGTERM, SIGINT and SIGHUP raise `Interrupted` in the
main thread; the caller records it, writes its report and exits 128 + the signal's number.
"""
import contextlib
import signal
from types import FrameType
from typing import Iterator, NoReturn

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(BaseException):
    """BaseException, as KeyboardInterrupt: no `except Exception` in a step swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int, _frame: FrameType | None) -> NoReturn:
    raise Interrupted(signum)


@contextlib.contextmanager
def catching() -> Iterator[None]:
    old = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
