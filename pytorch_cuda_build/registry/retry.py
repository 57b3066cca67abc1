"""The one retry policy for calls over the network (a registry's, the engine's push, PyPI's
advisory API): another attempt on a Transient failure only, waits doubling from the first
($PYTORCH_CUDA_RETRY_BACKOFF seconds, default 2) up to WAIT_CAP, each retry logged."""
from __future__ import annotations

import os
from typing import Callable, Protocol, TypeVar

import tenacity

from ..errors import BadValue

BACKOFF_ENV = "PYTORCH_CUDA_RETRY_BACKOFF"  # seconds before the first retry (the tests shorten it)
WAIT_CAP = 60  # seconds: the longest wait between two attempts
T = TypeVar("T")


class Transient(Exception):
    """Worth another attempt: connection refused or reset, a timeout, HTTP 429 or 5xx, a push stream error."""


class Retry(Protocol):
    def __call__(self, fn: Callable[[], T], what: str) -> T: ...


def retry_backoff() -> float:
    """The first retry's wait: $PYTORCH_CUDA_RETRY_BACKOFF seconds (default 2), doubling after."""
    text = os.environ.get(BACKOFF_ENV, "2")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value <= 600):
        raise BadValue(f"${BACKOFF_ENV} takes seconds from 0 to 600 (the first retry's wait), not {text!r}", name=BACKOFF_ENV)
    return value


def retrying(attempts: int, backoff: float, log: Callable[[str], None] = lambda _: None) -> Retry:
    """retry(fn, what): fn again on a Transient failure, at most `attempts` calls in all, with
    exponential backoff from `backoff` seconds; each retry logged as `what` failing. The last
    attempt's Transient goes up."""
    def retry(fn: Callable[[], T], what: str) -> T:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None and state.next_action is not None  # both set before a sleep
            log(f"{what} failed: {state.outcome.exception()}; attempt {state.attempt_number + 1}/{attempts} in {state.next_action.sleep:.0f}s")
        r = tenacity.Retrying(stop=tenacity.stop_after_attempt(attempts), reraise=True,
                              wait=tenacity.wait_exponential(multiplier=backoff, max=WAIT_CAP),
                              retry=tenacity.retry_if_exception_type(Transient), before_sleep=before_sleep)
        return r(fn)
    return retry
