"""Following a training stage's epochs as they end, from the resume state it rewrites at every epoch end: the
watcher thread, and a shared stage's epochs reported to Tune by each trial that runs or waits for it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.harness import chain

if TYPE_CHECKING:
    from pipelines.sweep.tune_report import Reporter


class EpochWatcher(threading.Thread):
    """Follows the finetune stage's resume state (``runs/.partial/finetune/resume.pt``, rewritten at every
    epoch end) and calls ``emit(row)`` for each new epoch row of its history."""

    def __init__(self, resume_path: Path, emit: Callable[[dict[str, Any]], None], poll_s: float = 1.0):
        super().__init__(daemon=True, name="tcnn-epoch-watcher")
        self.path = resume_path
        self.emit = emit
        self.poll_s = poll_s
        self.seen = 0
        self._stop_event = threading.Event()
        self._mtime: int | None = None

    def poll(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        import torch

        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception:  # replaced while reading: the next poll sees the new file
            self._mtime = None
            return
        self.rows(list(state.get("history") or []))

    def rows(self, history: list[dict[str, Any]]) -> None:
        for row in history[self.seen :]:
            self.emit(row)
        self.seen = max(self.seen, len(history))

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            with contextlib.suppress(Exception):
                self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


@contextlib.contextmanager
def shared_progress(directory: Path, stage: str, report: Reporter) -> Iterator[None]:
    """While a trial runs (or waits for) a shared stage in ``directory`` (the pretraining, a grid's shared
    control), each of its epochs is reported to Tune as ``<stage>_epoch`` with its losses and accuracies
    under ``<stage>_`` names (not the names a scheduler acts on: those are the trial's own fine-tuning's)."""
    keys = ("train_loss", "train_acc", "val_loss", "val_acc")

    def emit(row: dict[str, Any]) -> None:
        epoch = row.get("finetune_epoch", row.get("epoch"))
        if isinstance(epoch, int | float):
            values = {f"{stage}_{k}": float(row[k]) for k in keys if isinstance(row.get(k), int | float)}
            report({"stage": stage, f"{stage}_epoch": int(epoch), **values})

    watcher = EpochWatcher(directory / chain.partial_dir(stage) / "resume.pt", emit)
    watcher.start()
    try:
        yield
    finally:
        watcher.stop()
