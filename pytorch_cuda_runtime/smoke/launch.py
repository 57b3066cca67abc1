"""Run one suite step as a child process group, with a hard timeout.

A hung collective or launcher must not hang the suite: each step runs in its own
session and, on timeout, the whole process group (launcher + ranks) is killed.
"""
import os
import signal
import subprocess
import time


def _kill_group(proc, grace=5.0):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path, n=15):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run_step(cmd, env, timeout, log_path, cwd=None):
    """Return dict(rc, timed_out, seconds, log)."""
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:  # Ctrl-C: do not leave ranks behind
            _kill_group(proc)
            raise
        # Ranks may outlive a launcher that exited: never leave them running.
        if not timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return {"rc": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.monotonic() - t0, 1), "log": log_path}
