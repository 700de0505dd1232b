"""An MLflow tracking store, opened: the sqlite file (its schema created under a lock) or a server probed over
HTTP, a client whose every call turns a store fault into one line, and tcnn's experiment in it.

MLflow 3's embedded store is sqlite (``sqlite:///mlruns.db``); many writers at once (Ray workers on several
nodes) go through one ``mlflow server`` and an http URI, which must answer its ``/health`` before a run opens.
Processes that start at once on a new sqlite store (``dvc queue start -j 4``) must not run MLflow's schema
migrations concurrently, so a client opens a sqlite store under an exclusive file lock beside it.
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.tracking.store_faults import StoreClient, StoreGuard, lock_fault, quiet_store_logging
from stages.tracking.store_location import artifact_root, follow_workspace
from stages.tracking.view import experiment_tags

SQLITE = "sqlite:///"


class TrackingError(RuntimeError):
    """Tracking is enabled but cannot work (server down, unknown run id): one line naming the thing."""


def http_alive(uri: str, timeout_s: float = 5.0) -> bool:
    """Whether an MLflow server answers ``uri``'s ``/health`` with 200."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI; None for other stores."""
    return Path(uri[len(SQLITE) :]) if uri.startswith(SQLITE) else None


def quote(value: str) -> str:
    """``value`` as a quoted string of an MLflow search filter."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@contextlib.contextmanager
def creation_lock(uri: str) -> Iterator[None]:
    """For a sqlite store: an exclusive lock next to the database (``<db>.lock``, filelock) while a client
    opens it, so that processes starting at once on a new store (``dvc queue start -j 4``) do not run
    MLflow's schema migrations concurrently (sqlite: 'duplicate column name'). Other stores: no lock."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    from filelock import FileLock

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


def _connect(uri: str, guard: StoreGuard) -> StoreClient:
    """A guarded ``MlflowClient`` on ``uri`` after one call that makes the store (and its schema) exist; call it
    under ``guard()`` and :func:`creation_lock`."""
    from mlflow import MlflowClient

    client = StoreClient(MlflowClient(tracking_uri=uri), guard)
    client.search_experiments(max_results=1)
    return client


def store_client(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri`` whose store exists: a new sqlite store's schema is created under the same
    lock a ``Tracker`` takes, so a reader (a script polling a running sweep) never migrates the schema while a
    writer does (sqlite: 'database is locked')."""
    quiet_store_logging()
    guard = StoreGuard(sqlite_path(uri))
    with guard(), creation_lock(uri):
        client = _connect(uri, guard)
    guard.opened_now()
    return client


class TrackingStore:
    """One store of a ``Tracker``: its URI, the :class:`StoreGuard` every call goes through, the guarded
    client (None until :meth:`open`) and the id of the experiment runs go to (:meth:`use_experiment`)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.guard = StoreGuard(sqlite_path(uri))
        self.client: Any = None
        self.experiment_id: str | None = None

    def open(self) -> None:
        """Open the store: a server must answer (else :class:`TrackingError`); a new sqlite store gets its
        schema under the lock; a copied one has its artifact locations follow it (stages.tracking.store_location);
        every call of the client is guarded (stages.tracking.store_faults)."""
        if self.uri.startswith(("http://", "https://")) and not http_alive(self.uri):
            raise TrackingError(
                f"tracking.uri {self.uri}: no MLflow server answers "
                "(start one with infra/mlflow/server.sh, or set tracking.enabled: false)"
            )
        quiet_store_logging()  # a store fault is the stage's one line, not MLflow's and SQLAlchemy's tracebacks
        db = self.guard.db
        with self.guard(), creation_lock(self.uri):
            if db is not None and (moved := follow_workspace(db)):
                print(f"tracking: {db} was copied from {moved}; its artifact locations now point into this "
                      "workspace's mlartifacts")  # fmt: skip
            self.client = _connect(self.uri, self.guard)
            self.guard.opened_now()

    def use_experiment(self, name: str) -> str:
        """Runs go to the experiment ``name`` (created if needed: its artifacts next to a sqlite database);
        it is tagged a model-training experiment and carries tcnn's saved runs-table view, both set again if
        missing or stale (:func:`stages.tracking.view.experiment_tags`). Returns its id."""
        self.experiment_id = self._existing(name) or self._created(name)
        return self.experiment_id

    def _existing(self, name: str) -> str | None:
        """The id of the experiment ``name`` (restored if deleted, its tags brought up to date), None if none."""
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            return None
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        for key, value in experiment_tags().items():
            if exp.tags.get(key) != value:
                self.client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id

    def _created(self, name: str) -> str:
        """Create the experiment ``name``; another process that created it first wins."""
        db = self.guard.db  # artifacts next to the database, not in whatever the working directory is
        location = artifact_root(db) if db is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=location, tags=experiment_tags())
        except Exception:  # another process created it first
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def search(self, filter_string: str, *, max_results: int = 100) -> list[Any]:
        """The experiment's runs that match ``filter_string``, newest first."""
        return list(
            self.client.search_runs(
                [self.experiment_id],
                filter_string=filter_string,
                max_results=max_results,
                order_by=["attributes.start_time DESC"],
            )
        )
