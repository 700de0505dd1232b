"""A stage's system metrics (CPU, memory, disk, network, GPU under ``system/*``), sampled by MLflow's own
monitor while the stage's run is MLflow's fluent active run (``mlflow.start_run(log_system_metrics=True)``),
every ``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` s (10 by default)."""

from __future__ import annotations

import contextlib

from stages.tracking.names import RunStatus
from stages.tracking.store_faults import StoreGuard


def start(uri: str, guard: StoreGuard, run_id: str) -> bool:
    """Make ``run_id`` MLflow's fluent active run with ``log_system_metrics=True``, so MLflow samples the
    system into ``system/*`` until :func:`end`. One per process (a stage): a process that already has a fluent
    run (several trackers) gets none for this run. Returns whether it started."""
    import mlflow

    if mlflow.active_run() is not None:
        return False
    mlflow.set_tracking_uri(uri)
    with guard():
        mlflow.start_run(run_id=run_id, log_system_metrics=True)
    return True


def end(guard: StoreGuard, run_id: str, status: RunStatus) -> None:
    """``mlflow.end_run`` of the fluent run ``run_id``; when the store refuses it, the system metrics monitor
    is stopped all the same."""
    import mlflow

    try:
        with guard():
            mlflow.end_run(status)
    except BaseException:
        stop(run_id)
        raise


def stop(run_id: str | None) -> None:
    """Stop MLflow's system metrics monitor of ``run_id`` (``mlflow.end_run`` does, unless the store refused
    to end the run first); what it fails to write is lost with the store."""
    from mlflow.tracking.fluent import run_id_to_system_metrics_monitor

    monitor = run_id_to_system_metrics_monitor.pop(run_id, None) if run_id else None
    if monitor is not None:
        with contextlib.suppress(Exception):
            monitor.finish()
