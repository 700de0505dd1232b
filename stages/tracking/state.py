"""What a ``Tracker`` holds, and which run a call goes to: its mode, its store, and the open parent and child
runs (stages/tracking/tracker.py assembles the Tracker; runs.py opens and closes runs, logs.py writes to them)."""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

from stages.tracking.names import HOST_TAG, PID_TAG
from stages.tracking.store import TrackingError, TrackingStore

Mode = Literal["mlflow", "disabled", "unavailable"]


class TrackerState:
    """The state every part of a ``Tracker`` reads: ``mode`` (``"mlflow"``, or ``"disabled"`` /
    ``"unavailable"``: every call a no-op), the store, ``parent_run_id``, ``parent_created`` (whether the last
    ``start_parent`` opened a new run) and ``run_id`` (the open child run)."""

    mode: Mode
    uri: str
    experiment: str
    store: TrackingStore
    parent_run_id: str | None
    parent_created: bool
    run_id: str | None
    _fluent: bool  # whether the child is MLflow's fluent active run (for its system metrics)

    @property
    def enabled(self) -> bool:
        """True when calls reach MLflow."""
        return self.mode == "mlflow"

    @property
    def experiment_id(self) -> str | None:
        return self.store.experiment_id

    @property
    def client(self) -> Any:
        """The store's ``MlflowClient`` (None unless enabled) for what this adapter does not wrap; its calls
        raise a store's fault as a ``StoreFault`` (stages.tracking.store_faults)."""
        return self.store.client

    def _run(self, run_id: str | None) -> str | None:
        """The run a call goes to: ``run_id``, else the open child, else the parent."""
        target = run_id or self.run_id or self.parent_run_id
        if self.enabled and target is None:
            raise TrackingError("tracking: no active run (call start_parent or start_child first)")
        return target

    @staticmethod
    def _process_tags() -> dict[str, str]:
        """The tags naming the process that opened or reopened a run (host, pid)."""
        return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
