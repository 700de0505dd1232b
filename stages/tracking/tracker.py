"""The one tracking adapter (:class:`Tracker`): stages and sweeps log through it, and it works without MLflow.

Modes (``Tracker.mode``):

- ``"mlflow"``: MLflow 3.x through an explicit :class:`mlflow.MlflowClient` (no global fluent state, so several
  trackers can live in one process, e.g. Ray trials); ``tracking.uri`` is ``sqlite:///mlruns.db`` by default
  (a relative sqlite path is resolved against ``base_dir``) or ``http://host:port`` for a server.
- ``"disabled"``: ``tracking.enabled: false``: every call is a no-op and nothing is written.
- ``"unavailable"``: MLflow cannot be imported: same no-op behaviour, with one warning line on stderr.

A Tracker is its store (stages/tracking/store.py, by composition), its runs (runs.py, stale.py) and what it
logs to them (logs.py, system_metrics.py): each part a class or module of its own, assembled here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from stages.tracking.names import resolve_uri
from stages.tracking.runs import RunLifecycle
from stages.tracking.store import TrackingError, TrackingStore, store_client

__all__ = ["ENV_URI", "Tracker", "TrackingError", "store_client"]

#: MLflow's own environment variable for the tracking URI (see :meth:`Tracker.from_params`).
ENV_URI = "MLFLOW_TRACKING_URI"


class Tracker(RunLifecycle):
    """Parent/child MLflow runs behind a small API that degrades to no-ops.

    Typical stage use (one process per stage)::

        tracker = Tracker.from_params(params)
        tracker.start_parent("pipeline", key=workspace_key())      # or re-attaches to the chain's parent
        with tracker.stage("finetune", params=params):             # resumes a killed attempt, ends FINISHED/FAILED
            tracker.log_metrics({"val_acc": 0.9}, step=epoch)
            tracker.log_artifact("runs/finetune/metrics.json")
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        uri: str = "sqlite:///mlruns.db",
        experiment: str = "tcnn",
        base_dir: str | os.PathLike = ".",
    ) -> None:
        self.uri = resolve_uri(uri, base_dir)
        self.experiment = experiment
        self.store = TrackingStore(self.uri)
        self.parent_run_id = None
        self.parent_created = False
        self.run_id = None
        self._fluent = False
        if not enabled:
            self.mode = "disabled"
            return
        try:
            import mlflow  # noqa: F401  (optional at runtime)
        except ImportError as err:  # pragma: no cover - mlflow is a declared dependency
            print(f"tracking: MLflow unavailable ({err}); continuing without tracking", file=sys.stderr)
            self.mode = "unavailable"
            return
        self.store.open()
        self.mode = "mlflow"
        self.store.use_experiment(experiment)

    @classmethod
    def from_params(cls, params: Any, *, base_dir: str | os.PathLike = ".", **kwargs: Any) -> Tracker:
        """A tracker configured by the ``tracking`` section of a validated ``Params``. The params say where runs
        go (they travel with the experiment, DVC records them): an ``$MLFLOW_TRACKING_URI`` that names another
        store is not used, and one line says so."""
        cfg = params.tracking
        env = os.environ.get(ENV_URI)
        if cfg.enabled and env and resolve_uri(env, base_dir) != resolve_uri(cfg.uri, base_dir):
            print(f"tracking: ${ENV_URI} ({env}) is not used: runs go to tracking.uri {cfg.uri} (the params' "
                  "tracking section wins; set tracking.uri to change it)", file=sys.stderr)  # fmt: skip
        return cls(enabled=cfg.enabled, uri=cfg.uri, experiment=cfg.experiment, base_dir=base_dir, **kwargs)
