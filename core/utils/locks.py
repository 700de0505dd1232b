"""A shared result built once: an exclusive ``fcntl.flock`` on a lock file in the result's directory. The first
process to get it does the work; the others block until it is done and then find the result complete. The
kernel drops the lock when its holder dies, so a killed process never leaves it held."""

from __future__ import annotations

import contextlib
import fcntl
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK = ".lock"


@contextlib.contextmanager
def locked(directory: Path, what: str, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """An exclusive flock on ``directory/.lock``; says so (once) when it has to wait for another holder."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.monotonic()
            say(log, f"{what}: waiting for another process that holds {directory / LOCK}")
            fcntl.flock(fh, fcntl.LOCK_EX)
            say(log, f"{what}: lock acquired after {time.monotonic() - t0:.1f}s")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def say(log: Callable[[str], None] | None, msg: str) -> None:
    """``log(msg)``, or one line on stderr without a log."""
    if log is not None:
        log(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
