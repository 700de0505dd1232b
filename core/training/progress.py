"""Progress of a training epoch where people look: tqdm's bar on a terminal; elsewhere (`dvc repro` into a pipe
or a file, a SLURM job's log, a Ray trial's log) one plain line at a steady pace -- epoch, step, images/s, the
run's ETA and the last validation accuracy -- so a long stage never runs for minutes without a word.

``TCNN_QUIET=1``: neither. ``TCNN_PROGRESS_EVERY_S``: the lines' pace in seconds (default 30).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

EVERY_S_ENV = "TCNN_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0


def mode() -> Literal["off", "bar", "lines"]:
    """``off`` under TCNN_QUIET=1; ``bar`` when stderr is a terminal (and not CI=true); else ``lines``."""
    if os.environ.get("TCNN_QUIET", "").lower() in ("1", "true", "yes"):
        return "off"
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return "bar" if tty and not ci else "lines"


def every_s() -> float:
    """The pace of the plain lines (:data:`EVERY_S_ENV`); a bad value is the default."""
    try:
        value = float(os.environ.get(EVERY_S_ENV, DEFAULT_EVERY_S))
    except ValueError:
        return DEFAULT_EVERY_S
    return value if value >= 0 else DEFAULT_EVERY_S


def hms(seconds: float) -> str:
    """``3725`` -> ``"1:02:05"``."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class LineProgress:
    """The plain-line stand-in for tqdm's bar (the loop calls ``update``, ``set_postfix`` and ``close``, reads
    ``n`` and ``total``): a line through ``log`` whenever ``every`` seconds passed since the last one. The ETA
    is the run's remaining steps at this epoch's pace so far (validation passes not counted)."""

    def __init__(
        self,
        desc: str,
        epoch: int,
        epochs: int,
        steps_per_epoch: int,
        start: int,
        log: Callable[[str], None],
        *,
        last_val_acc: float | None = None,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.epoch, self.epochs, self.total = desc, epoch, epochs, steps_per_epoch
        self.n = self._start = start
        self.log, self.last_val_acc, self.clock = log, last_val_acc, clock
        self.every = every_s() if every is None else every
        self.t0 = self.last = clock()
        self.postfix: dict[str, Any] = {}

    def update(self, k: int = 1) -> None:
        self.n += k
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.log(self.line(now))

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix.update(values)

    def close(self) -> None:
        pass

    def line(self, now: float) -> str:
        """``desc: epoch 2/10 step 120/391 (31%) | loss 0.412 | 1830 img/s | ETA 0:41:07 | val_acc 0.8712``."""
        done, elapsed = self.n - self._start, now - self.t0
        left = (self.epochs - self.epoch - 1) * self.total + (self.total - self.n)
        parts = [f"{self.desc}: epoch {self.epoch + 1}/{self.epochs} step {self.n}/{self.total} "
                 f"({100 * self.n // max(self.total, 1)}%)"]  # fmt: skip
        if "loss" in self.postfix:
            parts.append(f"loss {self.postfix['loss']}")
        if "img_s" in self.postfix:
            parts.append(f"{self.postfix['img_s']} img/s")
        parts.append(f"ETA {hms(left * elapsed / done)}" if done > 0 and elapsed > 0 else "ETA -")
        if self.last_val_acc is not None:
            parts.append(f"val_acc {self.last_val_acc:.4f}")
        return " | ".join(parts)
