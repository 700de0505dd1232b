"""A sweep trial's reports to Ray Tune: ``tune.report`` with a checkpoint holding the trial's MLflow run id,
and the state of the checkpoint a restarted trial resumes from."""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Any

from pipelines.sweep.replay import STATE
from pipelines.sweep.trial_files import read_json


class Reporter:
    """``tune.report`` with a checkpoint holding the run id (thread-safe: the epoch watcher reports too).

    Once Tune has stopped the trial (a scheduler's STOP, the driver's stop), every later call raises
    ``SystemExit``: Ray ends the thread blocked in the report that got the STOP with ``SystemExit`` and then shuts
    the trial's session down, after which ``tune.report`` returns silently while the training thread, not yet
    killed, goes on. Without this, an epoch trained after the stop would be logged to MLflow and a ``done.json``
    written for a trial that Tune recorded as stopped at an earlier epoch (the flaky search test of issue 56)."""

    def __init__(self, tid: str, run_id: str | None, enabled: bool = True) -> None:
        self.tid = tid
        self.run_id = run_id
        self.enabled = enabled
        self.halted = False
        self._lock = threading.Lock()

    def __call__(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from ray import tune

        with self._lock, tempfile.TemporaryDirectory(prefix="tcnn-ckpt-") as d:
            if self.halted or not _in_session():
                self.halted = True
                raise SystemExit(0)
            state = {"tid": self.tid, "mlflow_run_id": self.run_id, **metrics}
            (Path(d) / STATE).write_text(json.dumps(state, default=str))
            try:
                tune.report({"tid": self.tid, **metrics}, checkpoint=tune.Checkpoint.from_directory(d))
            except SystemExit:
                self.halted = True
                raise


def _in_session() -> bool:
    """Whether this process still has its Tune trial session (Ray shuts it down when it stops the trial;
    ``tune.report`` without one only warns and returns)."""
    from ray.train._internal.session import get_session

    return get_session() is not None


def checkpoint_state() -> dict[str, Any]:
    """The state in the Tune checkpoint this trial restarts from ({} when none)."""
    try:
        from ray import tune

        ckpt = tune.get_checkpoint()
    except Exception:  # not inside Tune
        return {}
    if ckpt is None:
        return {}
    with ckpt.as_directory() as d:
        return read_json(Path(d) / STATE) or {}
