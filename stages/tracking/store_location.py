"""A workspace's sqlite tracking store keeps its artifacts inside the workspace, also after it was copied.

MLflow stores absolute artifact locations: the experiment's (``file://<workspace>/mlartifacts``, set by
stages.tracking.store where the store is created) and every run's and logged model's below it. A copy of a workspace
(``cp -a``, as people copy them) would log its new runs' artifacts into the original's folder. MLflow has no
API to move an experiment's artifact location, so when a store finds itself in another folder than the one
its locations name, the locations are rewritten to this folder in one sqlite transaction (the copy holds the
artifacts too: ``mlartifacts`` travelled with ``mlruns.db``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from urllib.parse import unquote

ARTIFACTS_DIR = "mlartifacts"  # next to the store: stages.tracking.store creates experiments there
#: MLflow's columns that hold artifact locations (schema of MLflow 3: runs, experiments, logged models)
LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
)


def artifact_root(db: Path) -> str:
    """The artifact location of experiments in the store ``db``: ``mlartifacts`` next to it, as a file URI."""
    return (db.parent.resolve() / ARTIFACTS_DIR).as_uri()


def _old_roots(con: sqlite3.Connection, here: Path) -> set[str]:
    """The workspace folders (as file URIs) whose ``mlartifacts`` the store's experiments name, not this one."""
    roots = set()
    for (loc,) in con.execute("SELECT artifact_location FROM experiments"):
        if (
            isinstance(loc, str)
            and loc.startswith("file://")
            and loc.rstrip("/").endswith("/" + ARTIFACTS_DIR)
        ):
            root = loc.rstrip("/")[: -len(ARTIFACTS_DIR) - 1]
            if Path(unquote(root.removeprefix("file://"))).resolve() != here:
                roots.add(root)
    return roots


def follow_workspace(db: Path) -> str | None:
    """Rewrite the artifact locations of a store copied from another folder to this one's; returns the folder
    it was copied from (None: nothing to do, a new store, or one MLflow itself will report as damaged). A write
    that fails (sqlite3.Error) is rolled back and the connection closed, so no ``-journal`` stays beside it."""
    if not db.is_file():
        return None
    here = db.parent.resolve()
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as con:
        try:  # no MLflow schema yet, or not a database: MLflow's own error says which
            olds = _old_roots(con, here)
        except sqlite3.DatabaseError:
            return None
        if not olds:
            return None
        try:
            _rewrite(con, here, olds)
        except sqlite3.Error:  # a full disk, the file-size limit: the store as it was, and no journal left
            with contextlib.suppress(sqlite3.Error):
                con.rollback()
            raise
    return ", ".join(sorted(unquote(o.removeprefix("file://")) for o in olds))


def _rewrite(con: sqlite3.Connection, here: Path, olds: set[str]) -> None:
    """Rewrite every artifact location below one of ``olds`` to ``here``, in one transaction (committed)."""
    tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for old in sorted(olds):
        for table, column in LOCATION_COLUMNS:
            if table in tables:
                con.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
                    (here.as_uri(), len(old) + 1, len(old) + 1, old + "/"),
                )
    con.commit()
