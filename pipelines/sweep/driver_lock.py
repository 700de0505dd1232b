"""One driver per sweep: an flock on ``<sweep>/.driver.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any

from pipelines.sweep.plan import SweepError

LOCK = ".driver.lock"


@contextlib.contextmanager
def driver_lock(sweep_dir: Path) -> Any:
    """One driver per sweep: an flock on ``<sweep>/.driver.lock``, removed when the driver ends (while it still
    holds the lock; a driver that took the lock of a file removed meanwhile sees another inode and is refused)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / LOCK
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not path.exists() or path.stat().st_ino != os.fstat(fh.fileno()).st_ino:
                raise BlockingIOError
        except BlockingIOError:
            raise SweepError(
                f"sweep {sweep_dir.name!r}: another driver is running it ({sweep_dir})"
            ) from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            fcntl.flock(fh, fcntl.LOCK_UN)
