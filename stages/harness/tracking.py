"""The one tracking adapter: stages and sweeps log through it, and it works without MLflow. What runs are
called and keyed by is stages/harness/tracking_names.py; the DVC path's per-stage protocol is stages/harness/stage_run.py.

Modes (``Tracker.mode``):

- ``"mlflow"``: MLflow 3.x through an explicit :class:`mlflow.MlflowClient` (no global fluent state, so several
  trackers can live in one process, e.g. Ray trials); ``tracking.uri`` is ``sqlite:///mlruns.db`` by default
  (a relative sqlite path is resolved against ``base_dir``) or ``http://host:port`` for a server.
- ``"disabled"``: ``tracking.enabled: false``: every call is a no-op and nothing is written.
- ``"unavailable"``: MLflow cannot be imported: same no-op behaviour, with one warning line on stderr.

Runs: one *parent* run per pipeline execution (or sweep) and one *child* run per stage (or trial), nested
through MLflow's ``mlflow.parentRunId`` tag (what ``mlflow.start_run(parent_run_id=...)`` sets). A sweep hands
its parent's id to its trials explicitly. The stages under ``dvc repro`` are separate processes that DVC
starts one after another, with nothing of ours around them to hand an id down (MLflow's own ``MLFLOW_RUN_ID``
resumes a run, it does not nest under one), so ``start_parent(key=...)`` re-attaches to the *open* parent of
the same key (one per workspace; see ``CHAIN_TAG``). Parent runs get MLflow's own context tags (git commit, branch, repository,
source, user: ``mlflow.tracking.context.registry.resolve_tags``); a stage's system metrics come from
``mlflow.start_run(log_system_metrics=True)``, sampled every ``$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` s
(10 by default).

A killed process leaves its run RUNNING. Re-starting the same stage under the same parent finds that run
(tag ``tcnn.stage``) and resumes it (``on_stale="resume"``, the default; ``tcnn.attempt`` counts attempts) or
marks it FAILED and opens a new one (``on_stale="fail"``); either way no run stays RUNNING forever and no
stage gets two live runs. Params are flattened with stable names (:func:`flatten_params`) so the compare view
lines runs up.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from core.utils.mlflow_ui import VIEW_KEY, VIEW_TAG_PREFIX, shared_view
from stages.harness.catalogue import VIEW_METRICS, VIEW_PARAMS
from stages.harness.store_faults import (
    StoreClient,
    StoreGuard,
    lock_fault,
    quiet_store_logging,
)
from stages.harness.store_location import artifact_root, follow_workspace
from stages.harness.tracking_names import (
    ATTEMPT_TAG,
    CHAIN_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    HOST_TAG,
    KEY_TAG,
    KIND_TAG,
    PARENT_TAG,
    PID_TAG,
    RESUMES_TAG,
    STAGE_TAG,
    TERMINAL_STATUSES,
    UV_LOCK_FILE,
    RunStatus,
    compatible_params,
    flatten_params,
    is_flat_str,
    resolve_uri,
    str_tags,
)

#: MLflow's own environment variable for the tracking URI (see :meth:`Tracker.from_params`).
ENV_URI = "MLFLOW_TRACKING_URI"


def experiment_tags() -> dict[str, str]:
    """The tags of tcnn's experiment: MLflow's experiment kind (the UI's "Model training" workflow opens it on
    its runs) and the saved view of the runs table (:data:`core.utils.mlflow_ui.VIEW_KEY`)."""
    return {
        EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
        VIEW_TAG_PREFIX + VIEW_KEY: shared_view(VIEW_METRICS, VIEW_PARAMS),
    }


class TrackingError(RuntimeError):
    """Tracking is enabled but cannot work (server down, unknown run id): one line naming the thing."""


def _http_alive(uri: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ---------------------------------------------------------------------------------------------- tracker


class Tracker:
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
        self.parent_run_id: str | None = None
        self.parent_created = False  # whether the last start_parent opened a new run
        self.run_id: str | None = None  # the active child (stage) run
        self._client: Any = None
        self._experiment_id: str | None = None
        self._fluent = False  # whether the child is MLflow's fluent active run (for its system metrics)
        self._guard = StoreGuard(_sqlite_path(self.uri) if self.uri.startswith("sqlite:///") else None)
        if not enabled:
            self.mode = "disabled"
            return
        try:
            import mlflow  # noqa: F401  (optional at runtime)
        except ImportError as err:  # pragma: no cover - mlflow is a declared dependency
            print(f"tracking: MLflow unavailable ({err}); continuing without tracking", file=sys.stderr)
            self.mode = "unavailable"
            return
        if self.uri.startswith(("http://", "https://")) and not _http_alive(self.uri):
            raise TrackingError(
                f"tracking.uri {self.uri}: no MLflow server answers "
                "(start one with infra/mlflow/server.sh, or set tracking.enabled: false)"
            )
        self.mode = "mlflow"
        quiet_store_logging()  # a store fault is the stage's one line, not MLflow's and SQLAlchemy's tracebacks
        self._open_store()
        self._experiment_id = self._get_or_create_experiment(experiment)

    def _open_store(self) -> None:
        """Open the store (a new sqlite store: its schema, under a lock; a copied one: its artifact locations
        follow it) with every call of the client guarded (stages.harness.store_faults)."""
        from mlflow import MlflowClient

        db = self._guard.db
        # A new sqlite store: one process creates its schema (under the lock).
        with self._guard(), _store_creation_lock(self.uri):
            if db is not None and (moved := follow_workspace(db)):
                print(f"tracking: {db} was copied from {moved}; its artifact locations now point into this "
                      "workspace's mlartifacts")  # fmt: skip
            self._client = StoreClient(MlflowClient(tracking_uri=self.uri), self._guard)
            self._client.search_experiments(max_results=1)  # the store (and its schema) exists from here on
            self._guard.opened_now()

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

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        """True when calls reach MLflow."""
        return self.mode == "mlflow"

    @property
    def experiment_id(self) -> str | None:
        return self._experiment_id

    @property
    def client(self) -> Any:
        """The store's ``MlflowClient`` (None unless enabled) for what this adapter does not wrap; its calls
        raise a store's fault as a ``StoreFault`` (stages.harness.store_faults)."""
        return self._client

    def _get_or_create_experiment(self, name: str) -> str:
        """The experiment's id, created if needed, tagged a model-training experiment and carrying tcnn's saved
        runs-table view (core.utils.mlflow_ui: the headline's columns), both set again if missing or stale."""
        tags = experiment_tags()
        exp = self._client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self._client.restore_experiment(exp.experiment_id)
            for key, value in tags.items():
                if exp.tags.get(key) != value:
                    self._client.set_experiment_tag(exp.experiment_id, key, value)
            return exp.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):
            # Artifacts next to the database, not in whatever the working directory happens to be.
            location = artifact_root(_sqlite_path(self.uri))
        try:
            return self._client.create_experiment(name, artifact_location=location, tags=tags)
        except Exception:  # another process created it first
            exp = self._client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _process_tags(self) -> dict[str, str]:
        return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}

    def _run(self, run_id: str | None) -> str | None:
        target = run_id or self.run_id or self.parent_run_id
        if self.enabled and target is None:
            raise TrackingError("tracking: no active run (call start_parent or start_child first)")
        return target

    def _search(self, filter_string: str, *, max_results: int = 100) -> list[Any]:
        return list(
            self._client.search_runs(
                [self._experiment_id],
                filter_string=filter_string,
                max_results=max_results,
                order_by=["attributes.start_time DESC"],
            )
        )

    def _reopen(self, run_id: str, tags: Mapping[str, Any] | None) -> None:
        run = self._client.get_run(run_id)
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1")) + 1
        if run.info.status != "RUNNING":
            self._client.update_run(run_id, status="RUNNING")
        self._set_tags(run_id, {**(tags or {}), **self._process_tags(), ATTEMPT_TAG: str(attempt)})

    # ------------------------------------------------------------------ runs

    def start_parent(
        self,
        name: str = "pipeline",
        tags: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        key: str | None = None,
        params: Any = None,
    ) -> str | None:
        """Open (or re-attach to) the parent run; returns its id (None when not enabled).

        Order: an explicit ``run_id`` (must exist) -> the newest *open* parent tagged with ``key`` (a chain
        whose last stage has not run yet: its earlier stages closed it FINISHED, or a failure FAILED, or a
        SIGKILL left it RUNNING), reopened -> a new parent run, open, with MLflow's context tags. With
        ``params``, an open parent of ``key`` whose logged params differ is not re-attached (params are
        write-once): it is marked superseded (FAILED if a killed process left it RUNNING) and a new parent is
        opened; the params are logged on the parent. ``self.parent_created`` says whether a new run was
        opened; ``tcnn.resumes`` counts how often a FAILED or KILLED execution was continued.
        """
        if not self.enabled:
            return None
        from mlflow.exceptions import MlflowException

        flat = flatten_params(params) if params is not None else {}
        found: str | None = None
        own = False
        if run_id is not None:
            try:
                self._client.get_run(run_id)
            except MlflowException:
                raise TrackingError(f"tracking: parent run {run_id} does not exist in {self.uri}") from None
            found = run_id
        elif key is not None:
            found = self._find_parent_by_key(key, flat)
            own = True  # a parent of this workspace: it carries this execution's params
        self.parent_created = found is None
        if found is not None:
            run = self._client.get_run(found)
            self.parent_run_id = found  # from here on a failed write still leaves a run to close
            extra: dict[str, Any] = {}
            if run.info.status != "RUNNING":  # the chain's next stage, or an interrupted execution continued
                self._client.update_run(found, status="RUNNING")
            if run.info.status in ("FAILED", "KILLED"):
                extra[RESUMES_TAG] = int(run.data.tags.get(RESUMES_TAG, "0")) + 1
            self._set_tags(found, {**(tags or {}), **self._process_tags(), **extra})
        else:
            from mlflow.tracking.context.registry import resolve_tags

            all_tags = {KIND_TAG: "parent", ATTEMPT_TAG: "1", **self._process_tags(), **(tags or {})}
            if key is not None:
                all_tags.update({KEY_TAG: key, CHAIN_TAG: "open"})
            all_tags = resolve_tags(str_tags(all_tags))  # MLflow's git, source and user tags
            run = self._client.create_run(self._experiment_id, run_name=name, tags=all_tags)
            found = run.info.run_id
            self.parent_run_id = found
        if flat and (own or self.parent_created):  # never onto a shared parent (a sweep's, by id or env)
            self.log_params(flat, run_id=found)
        return found

    def _find_parent_by_key(self, key: str, flat: Mapping[str, str]) -> str | None:
        """The open parent run of ``key`` to re-attach to, or None (see :meth:`start_parent`)."""
        base = f"tags.`{KIND_TAG}` = 'parent' and tags.`{KEY_TAG}` = {_quote(key)} and tags.`{CHAIN_TAG}` = 'open'"
        found: str | None = None
        for run in self._search(base, max_results=20):  # newest first
            if found is None and compatible_params(run.data.params, flat):
                found = run.info.run_id
                continue
            # An execution with other params (or an older duplicate): it will not be continued.
            self._client.set_tag(run.info.run_id, CHAIN_TAG, "superseded")
            self.close_children(run.info.run_id, "FAILED")
            if run.info.status == "RUNNING":  # left by a killed process
                self._client.set_terminated(run.info.run_id, status="FAILED")
        return found

    def close_children(
        self, parent_run_id: str, status: RunStatus = "FAILED", reason: str = "its parent was superseded"
    ) -> int:
        """End every RUNNING child of ``parent_run_id`` (left by killed processes) with ``status``, tagged
        ``tcnn.stale`` = ``reason``; returns how many were closed."""
        left = self._search(
            f"tags.`{PARENT_TAG}` = {_quote(parent_run_id)} and attributes.status = 'RUNNING'",
            max_results=1000,
        )
        for run in left:
            self._client.set_tag(run.info.run_id, "tcnn.stale", reason)
            self._client.set_terminated(run.info.run_id, status=status)
        return len(left)

    def start_child(
        self,
        stage: str,
        *,
        params: Any = None,
        tags: Mapping[str, Any] | None = None,
        on_stale: Literal["resume", "fail"] = "resume",
        system_metrics: bool = False,
        run_name: str | None = None,
        run_id: str | None = None,
    ) -> str | None:
        """Open the run of one stage (or trial) under the parent, resuming a killed attempt of it.

        A RUNNING run with the same ``stage`` under the same parent is a leftover of a killed process: it is
        resumed (``on_stale="resume"``; unless its logged params differ from ``params``, which MLflow cannot
        overwrite) or marked FAILED (``on_stale="fail"``). ``params`` are logged with :func:`flatten_params`.
        ``run_id``: reopen exactly this run (e.g. the id a Ray trial kept in its checkpoint), whatever its state.
        """
        if not self.enabled:
            return None
        if self.parent_run_id is None:
            self.start_parent()
        assert self.parent_run_id is not None
        flat = flatten_params(params) if params is not None else {}
        if run_id is not None:
            self._reopen_existing(run_id, tags)
            child = run_id
        else:
            child = self._stale_child(stage, flat, on_stale)
            if child is not None:
                self._reopen(child, tags)
            else:
                child = self._create_child(stage, tags, run_name)
        self.run_id = child
        if flat:
            self.log_params(flat)
        if system_metrics:
            self._start_system_metrics(child)
        return child

    def _reopen_existing(self, run_id: str, tags: Mapping[str, Any] | None) -> None:
        """Reopen the run ``run_id`` whatever its state (TrackingError when the store has no such run)."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            raise TrackingError(f"tracking: run {run_id} does not exist in {self.uri}") from None
        self._reopen(run_id, tags)

    def _stale_child(
        self, stage: str, flat: Mapping[str, str], on_stale: Literal["resume", "fail"]
    ) -> str | None:
        """The RUNNING run of ``stage`` under the parent to resume: with ``on_stale="resume"``, the newest
        whose logged params agree with ``flat``. Every other RUNNING one (a killed attempt) is tagged
        ``tcnn.stale`` and marked FAILED, so no stage gets two live runs."""
        stale = self._search(
            f"tags.`{PARENT_TAG}` = {_quote(self.parent_run_id)} and tags.`{STAGE_TAG}` = {_quote(stage)} "
            "and attributes.status = 'RUNNING'"
        )
        resume_id: str | None = None
        for run in stale:  # newest first
            compatible = compatible_params(run.data.params, flat)
            if on_stale == "resume" and resume_id is None and compatible:
                resume_id = run.info.run_id
            else:
                self._client.set_tag(run.info.run_id, "tcnn.stale", "killed attempt, superseded")
                self._client.set_terminated(run.info.run_id, status="FAILED")
        return resume_id

    def _create_child(self, stage: str, tags: Mapping[str, Any] | None, run_name: str | None) -> str:
        """A new run of ``stage`` under the parent (named ``run_name``, default the stage), attempt 1."""
        all_tags = {
            PARENT_TAG: self.parent_run_id,
            KIND_TAG: "stage",
            STAGE_TAG: stage,
            ATTEMPT_TAG: "1",
            **self._process_tags(),
            **(tags or {}),
        }
        run = self._client.create_run(
            self._experiment_id, run_name=run_name or stage, tags=str_tags(all_tags)
        )
        return run.info.run_id

    def find_child(self, stage: str, *, status: str | None = None) -> list[Any]:
        """The child runs of the parent for ``stage`` (newest first), optionally only those in ``status``."""
        if not self.enabled or self.parent_run_id is None:
            return []
        flt = f"tags.`{PARENT_TAG}` = {_quote(self.parent_run_id)} and tags.`{STAGE_TAG}` = {_quote(stage)}"
        if status is not None:
            flt += f" and attributes.status = {_quote(status)}"
        return self._search(flt)

    def end(self, status: RunStatus = "FINISHED") -> None:
        """End the active child run, or the parent when no child is open."""
        if not self.enabled:
            return
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"end: status must be one of {TERMINAL_STATUSES}, got {status!r}")
        if self.run_id is not None:
            if self._fluent:  # MLflow stops its system metrics monitor and ends the run
                self._fluent = False
                self._end_fluent(status)
            else:
                self._client.set_terminated(self.run_id, status=status)
            self.run_id = None
        elif self.parent_run_id is not None:
            self.end_parent(status)

    def end_parent(self, status: RunStatus = "FINISHED") -> None:
        """End the parent run (the last stage of a pipeline, or the sweep driver, calls this)."""
        if not self.enabled or self.parent_run_id is None:
            return
        if self.run_id is not None:
            self.end(status)
        self._client.set_terminated(self.parent_run_id, status=status)
        self.parent_run_id = None

    def _end_fluent(self, status: RunStatus) -> None:
        """``mlflow.end_run``; when the store refuses it, the system metrics monitor is stopped all the same."""
        import mlflow

        try:
            with self._guard():
                mlflow.end_run(status)
        except BaseException:
            _stop_system_metrics(self.run_id)
            raise

    @contextlib.contextmanager
    def stage(self, stage: str, **kwargs: Any) -> Iterator[Tracker]:
        """``start_child`` + ``end``: FINISHED on success, FAILED on an exception, KILLED on Ctrl-C."""
        self.start_child(stage, **kwargs)
        try:
            yield self
        except KeyboardInterrupt:
            self.end("KILLED")
            raise
        except BaseException:
            self.end("FAILED")
            raise
        self.end("FINISHED")

    # ------------------------------------------------------------------ logging

    def log_params(self, params: Any, *, run_id: str | None = None) -> None:
        """Log a ``Params`` or a (nested) mapping under stable flattened names (write-once in MLflow)."""
        if not self.enabled:
            return
        from mlflow.entities import Param

        target = self._run(run_id)
        flat = params if is_flat_str(params) else flatten_params(params)
        existing = self._client.get_run(target).data.params
        items = [Param(k, v) for k, v in flat.items() if existing.get(k) != v]
        self._client.log_batch(target, params=items)  # MLflow splits it into batches of its limits

    def log_metrics(
        self, metrics: Mapping[str, float], step: int | None = None, *, run_id: str | None = None
    ) -> None:
        """Log scalar metrics at ``step`` (epoch or global step; 0 when omitted)."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        target = self._run(run_id)
        now = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"log_metrics: metric {key!r} is not a number ({value!r})") from None
            items.append(Metric(key, number, now, int(step or 0)))
        self._client.log_batch(target, metrics=items)

    def set_tags(self, tags: Mapping[str, Any], *, run_id: str | None = None) -> None:
        if not self.enabled:
            return
        self._set_tags(self._run(run_id), tags)

    def _set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._client.log_batch(run_id, tags=[RunTag(k, v) for k, v in str_tags(tags).items()])

    def log_artifact(
        self, path: str | os.PathLike, artifact_path: str | None = None, *, run_id: str | None = None
    ) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        if not self.enabled:
            return
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"log_artifact: {path} does not exist")
        target = self._run(run_id)
        if path.is_dir():
            self._client.log_artifacts(target, str(path), artifact_path)
        else:
            self._client.log_artifact(target, str(path), artifact_path)

    def log_dict(
        self, obj: Mapping[str, Any] | list, artifact_file: str, *, run_id: str | None = None
    ) -> None:
        """Store a JSON (or YAML, by extension) artifact built from ``obj``."""
        if not self.enabled:
            return
        self._client.log_dict(self._run(run_id), obj, artifact_file)

    def log_dataset(
        self,
        name: str,
        digest: str,
        source: str,
        *,
        context: str = "train",
        profile: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        """Record a dataset input (``mlflow.log_input`` equivalent) by name, digest (e.g. manifest sha256)
        and source (a path or URI)."""
        if not self.enabled:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(
            name=name,
            digest=digest[:36],
            source_type="local",
            source=json.dumps({"uri": str(source)}),
            profile=json.dumps(dict(profile)) if profile else None,
        )
        tags = [InputTag("mlflow.data.context", context)]
        self._client.log_inputs(self._run(run_id), datasets=[DatasetInput(dataset, tags)])

    def log_environment(self, root: str | os.PathLike = ".", *, run_id: str | None = None) -> None:
        """Log the environment on ``run_id`` (default: the parent): ``uv.lock`` as it is in ``root`` (what
        the README commands installed, hashes included) and the resolved distributions as installed
        (``environment/requirements.txt``), so a run names the exact environment it ran in."""
        run_id = run_id or self.parent_run_id
        if not self.enabled or run_id is None:
            return
        with contextlib.suppress(Exception):  # nice to have: never fail a stage for it
            self._client.log_text(run_id, resolved_environment(), "environment/requirements.txt")
            lock = Path(root) / UV_LOCK_FILE
            if lock.is_file():
                self._client.log_artifact(run_id, str(lock), "environment")

    @contextlib.contextmanager
    def activate(self, run_id: str | None = None) -> Iterator[Any]:
        """Make the active run MLflow's fluent active run for calls this adapter does not wrap
        (``mlflow.pytorch.log_model``...). Yields the ``mlflow`` module, or None when not enabled."""
        if not self.enabled:
            yield None
            return
        import mlflow

        target = self._run(run_id)
        if self._fluent and target == self.run_id:  # already MLflow's active run (it logs system metrics)
            yield mlflow
            return
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(self.uri)
        try:
            with self._guard(), mlflow.start_run(run_id=target):
                yield mlflow
                # Leaving start_run() would mark the run FINISHED: put it back to RUNNING below.
        finally:
            with contextlib.suppress(Exception):
                self._client.update_run(target, status="RUNNING")
            mlflow.set_tracking_uri(previous)

    def log_checkpoint_model(self, checkpoint: Path, name: str) -> None:
        """The model of a checkpoint through ``mlflow.pytorch.log_model`` (loadable with
        ``mlflow.pytorch.load_model``; it gives the logits of ``core.training.checkpoint.load_model``)."""
        if not self.enabled or not checkpoint.is_file():
            return
        from core.training.checkpoint import load_model

        self.log_torch_model(load_model(checkpoint), name=name)

    def log_torch_model(self, model: Any, name: str = "model", **kwargs: Any) -> None:
        """``mlflow.pytorch.log_model`` on the active run; pins torch instead of inferring requirements
        (slow). MLflow 3's default format ('pt2', a traced graph) needs ``input_example=``; without one the
        model is pickled (its classes must be importable where it is loaded)."""
        if not self.enabled:
            return
        import torch

        kwargs.setdefault("pip_requirements", [f"torch=={torch.__version__.split('+')[0]}"])
        if kwargs.get("input_example") is None:
            kwargs.setdefault("serialization_format", "pickle")
        with self.activate() as mlflow:
            import mlflow.pytorch  # noqa: F401

            mlflow.pytorch.log_model(model, name=name, **kwargs)

    # ------------------------------------------------------------------ system metrics

    def _start_system_metrics(self, run_id: str) -> None:
        """Make ``run_id`` MLflow's fluent active run with ``log_system_metrics=True``, so MLflow samples CPU,
        memory, disk, network (and GPU) into ``system/*`` until :meth:`end`. One per process (a stage); a
        process that already has a fluent run (several trackers) gets none for this run."""
        import mlflow

        if mlflow.active_run() is not None:
            return
        mlflow.set_tracking_uri(
            self.uri
        )  # MLflow samples every $MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL s (10)
        with self._guard():
            mlflow.start_run(run_id=run_id, log_system_metrics=True)
        self._fluent = True


def _stop_system_metrics(run_id: str | None) -> None:
    """Stop MLflow's system metrics monitor of ``run_id`` (``mlflow.end_run`` does, unless the store refused
    to end the run first); what it fails to write is lost with the store."""
    from mlflow.tracking.fluent import run_id_to_system_metrics_monitor

    monitor = run_id_to_system_metrics_monitor.pop(run_id, None) if run_id else None
    if monitor is not None:
        with contextlib.suppress(Exception):
            monitor.finish()


def _sqlite_path(uri: str) -> Path:
    return Path(uri[len("sqlite:///") :])


def store_client(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri`` whose store exists: a new sqlite store's schema is created under the same
    lock a ``Tracker`` takes, so a reader (a script polling a running sweep) never migrates the schema while a
    writer does (sqlite: 'database is locked')."""
    from mlflow import MlflowClient

    quiet_store_logging()
    guard = StoreGuard(_sqlite_path(uri) if uri.startswith("sqlite:///") else None)
    with guard(), _store_creation_lock(uri):
        client = StoreClient(MlflowClient(tracking_uri=uri), guard)
        client.search_experiments(max_results=1)
    guard.opened_now()
    return client


@contextlib.contextmanager
def _store_creation_lock(uri: str) -> Iterator[None]:
    """For a sqlite store: an exclusive lock next to the database (``<db>.lock``, filelock) while a client
    opens it, so that processes starting at once on a new store (``dvc queue start -j 4``) do not run
    MLflow's schema migrations concurrently (sqlite: 'duplicate column name'). Other stores: no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(db) + ".lock", timeout=600, mode=0o644)
    try:
        lock.acquire()
    except OSError as err:  # a read-only folder: the store cannot be written either
        raise lock_fault(db, err) from err
    try:
        yield
    finally:
        lock.release()


def resolved_environment() -> str:
    """The resolved Python environment as ``pip freeze``-style lines (from the installed distributions'
    metadata: the same set pip reports, without starting pip), headed by the interpreter and platform."""
    import importlib.metadata as md
    import platform

    seen: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    head = f"# python {platform.python_version()} ({sys.executable}) on {platform.platform()}\n"
    return head + "\n".join(sorted(seen.values(), key=str.lower)) + "\n"
