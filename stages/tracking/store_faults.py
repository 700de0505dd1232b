"""Faults of the sqlite tracking store as one line: what happened to the file, found by looking at it.

MLflow reports a failing sqlite store as an ``MlflowException`` around SQLAlchemy's error around sqlite's, and
sqlite's words say what it saw, not what happened to the file (a store deleted under a running stage is
"attempt to write a readonly database"). A :class:`StoreGuard` turns such an error into a :class:`StoreFault`,
an ``OSError`` whose one line names the store and what happened to it (deleted, its folder removed, replaced,
read-only, not an sqlite database, damaged, locked, the disk full, a write past the file-size limit), and
:class:`StoreClient` guards every call of an ``MlflowClient`` so. A fault that left no store to write to
(deleted, replaced, its folder gone) is raised again by every later call without touching the store, so no
call recreates an empty ``mlruns.db`` in its place. Before every call the guard refuses a store larger than
the process's file-size limit (:func:`check_size_limit`): sqlite could neither write its pages past the limit
nor roll a failed write back, and would leave a hot ``-journal`` beside it. A store within the limit only
grows past it, and sqlite rolls such a failed write back (it restores pages below the limit).

MLflow, SQLAlchemy and alembic log such faults themselves (a traceback per failed statement, the system-metrics
thread's warnings) and a working store's life too (its tables created, the monitor started and stopped);
:func:`quiet_store_logging` holds those records back, since a fault reaches the stage as an exception that
ends it with one line (stages.harness.runner). ``MLFLOW_LOGGING_LEVEL=DEBUG`` shows them.
Nothing here imports MLflow.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SQLITE_HEADER = b"SQLite format 3\x00"
#: The loggers (and their children) whose records :class:`StoreLogFilter` looks at; MLflow gives the first,
#: ``sqlalchemy.engine`` and ``alembic`` its stderr handler, the rest of SQLAlchemy's pass on to the root logger.
STORE_LOGGERS = ("mlflow", "sqlalchemy", "sqlalchemy.engine", "alembic")
#: Of them, those that only ever speak of the store or of a monitor thread writing to it.
_STORE_ONLY = ("mlflow.store", "mlflow.system_metrics", "sqlalchemy", "alembic")


class StoreFault(OSError):
    """The tracking store's file could not be read or written. ``str()`` is one line: the store, what happened
    to it, and in parentheses ``detail`` (sqlite's own words); ``gone``: no store is left to write to (deleted,
    replaced, its folder removed)."""

    def __init__(self, path: Path, what: str, detail: str = "", *, gone: bool = False) -> None:
        super().__init__(errno.EIO, what, str(path))
        self.path, self.what, self.detail, self.gone = path, what, detail, gone

    def __str__(self) -> str:
        tail = f" ({self.detail})" if self.detail else ""
        return f"the MLflow store {_shown(self.path)} {self.what}{tail}"


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else as it is."""
    with contextlib.suppress(OSError, ValueError):  # the working directory itself may be gone
        return str(path.relative_to(Path.cwd()))
    return str(path)


def database_error(err: BaseException) -> BaseException | None:
    """The database error (SQLAlchemy's or sqlite's) in ``err``'s chain, None when there is none."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sqlite3.Error) or type(e).__module__.split(".")[0] == "sqlalchemy":
            return e
        e = e.__cause__ or e.__context__
    return None


def _sqlite_words(err: BaseException) -> str:
    """sqlite's message of a database error (SQLAlchemy's wraps it with the statement and its parameters)."""
    orig = getattr(err, "orig", None) or err
    return str(orig).splitlines()[0] if str(orig) else type(orig).__name__


def file_id(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of ``path``, None when there is no file."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _is_sqlite(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except OSError:
        return True  # unreadable: not this question's answer
    return head in (b"", SQLITE_HEADER)  # an empty file is a database sqlite has not written yet


def size_limit() -> int | None:
    """This process's file-size limit (RLIMIT_FSIZE, ``ulimit -f``) in bytes, None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def check_size_limit(db: Path) -> None:
    """Refuse (:class:`StoreFault`) a store larger than the file-size limit before anything writes to it."""
    limit = size_limit()
    size = db.stat().st_size if limit is not None and db.is_file() else 0
    if limit is not None and size > limit:
        raise StoreFault(
            db,
            f"cannot be written: it is larger ({_size(size)}) than this process's file-size limit "
            f"(ulimit -f: {_size(limit)}), past which sqlite could neither write nor roll a write back",
        )


def _gone(db: Path, opened: tuple[int, int] | None) -> str | None:
    """What removed or replaced the store since it was opened (``opened``: its file id then), or None."""
    if not db.parent.is_dir():
        return f"was removed during the run with its folder {_shown(db.parent)}/"
    now = file_id(db)
    if now is None:
        return "was deleted during the run"
    if opened is not None and now != opened:
        kind = "an sqlite database" if _is_sqlite(db) else "a file that is not an sqlite database"
        return f"was replaced during the run by {kind}"
    return None


def _unwritable(db: Path, words: str) -> str | None:
    """Why the store cannot be written (read-only file or folder, full disk, file-size limit), or None."""
    if not os.access(db.parent, os.W_OK | os.X_OK):
        return "cannot be written: its folder is read-only (sqlite writes its journal beside it)"
    if "readonly" in words or (db.exists() and not os.access(db, os.W_OK)):
        return "cannot be written: it is read-only"
    if "full" in words:
        free = shutil.disk_usage(db.parent).free
        return f"could not be written: the disk is full ({_size(free)} free there)"
    limit = size_limit()
    if "I/O error" in words and limit is not None:
        return f"could not be written past this process's file-size limit (ulimit -f: {_size(limit)})"
    return None


def diagnose(db: Path, err: BaseException, opened: tuple[int, int] | None = None) -> StoreFault:
    """The :class:`StoreFault` for the database error ``err`` of the store ``db`` (``opened``: the store's
    file id when it was opened), found by looking at the file."""
    words = _sqlite_words(err)
    detail = f"tracking store: {words}"
    if gone := _gone(db, opened):
        return StoreFault(db, gone, detail, gone=True)
    return StoreFault(db, _what(db, words), detail)


def _what(db: Path, words: str) -> str:
    """What is wrong with a store that is still in its place, from the file and sqlite's ``words``."""
    if not _is_sqlite(db):
        return "is not an sqlite database (damaged, or another file in its place)"
    if "malformed" in words:
        return "is damaged"
    if "locked" in words or "busy" in words:
        return "is locked by another process that writes to it"
    if why := _unwritable(db, words):
        return why
    if "unable to open" in words:
        return "could not be opened"
    return "could not be read or written"


def lock_fault(db: Path, err: OSError) -> StoreFault:
    """The :class:`StoreFault` for the store ``db`` whose lock file (beside it) could not be opened."""
    what = _unwritable(db, "") or "could not be locked"
    return StoreFault(db, what, f"{_shown(Path(err.filename or db))}: {err.strerror or err}")


class StoreGuard:
    """Turns database errors of one sqlite store into :class:`StoreFault`; after a fault that left no store
    (:attr:`StoreFault.gone`) it raises that fault again at once, and before every call it refuses a store that
    has come to be larger than the file-size limit (:func:`check_size_limit`: also a limit lowered while the
    stage runs)."""

    def __init__(self, db: Path | None) -> None:
        self.db = db
        self.opened: tuple[int, int] | None = None  # the store's file id once opened (see :meth:`opened_now`)
        self.fault: StoreFault | None = None

    def opened_now(self) -> None:
        """Record the store's file id: a later fault compares the file against it (was it replaced?)."""
        if self.db is not None:
            self.opened = file_id(self.db)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.fault is not None:
            raise self.fault
        if self.db is not None:
            check_size_limit(self.db)
        try:
            yield
        except StoreFault as fault:
            self.fault = fault if fault.gone else self.fault
            raise
        except Exception as err:
            if self.db is None or (cause := database_error(err)) is None:
                raise
            fault = diagnose(self.db, cause, self.opened)
            self.fault = fault if fault.gone else None
            raise fault from err


class StoreClient:
    """An ``MlflowClient`` whose every call goes through a :class:`StoreGuard` (other attributes as they are)."""

    def __init__(self, client: Any, guard: StoreGuard) -> None:
        self._client = client
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return _guarded_call(attr, self._guard)


def _guarded_call(fn: Callable[..., Any], guard: StoreGuard) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with guard():
            return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    return call


class StoreLogFilter(logging.Filter):
    """Of the records of :data:`STORE_LOGGERS` (others pass), holds back every one of MLflow's store, its
    system-metrics thread, SQLAlchemy and alembic (what they say of a working store is noise, of a failing one
    a traceback per statement) and any other WARNING or ERROR that carries a traceback; everything passes when
    the ``mlflow`` logger is at DEBUG (``MLFLOW_LOGGING_LEVEL=DEBUG``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        debugging = logging.getLogger("mlflow").isEnabledFor(logging.DEBUG)
        if debugging or record.name.split(".")[0] not in STORE_LOGGERS:
            return True
        if record.name.startswith(_STORE_ONLY):
            return False
        return not (record.levelno >= logging.WARNING and record.exc_info)


def quiet_store_logging() -> None:
    """Put a :class:`StoreLogFilter` on every handler a record of :data:`STORE_LOGGERS` can reach: theirs
    (MLflow's stderr handler), the root logger's and logging's last resort (where SQLAlchemy's pool and ORM
    records go). Call it after ``import mlflow``, which sets up MLflow's logging; calling it again changes
    nothing."""
    handlers = [h for name in (*STORE_LOGGERS, "") for h in logging.getLogger(name).handlers]
    for handler in [*handlers, logging.lastResort]:
        if handler is not None and not any(isinstance(f, StoreLogFilter) for f in handler.filters):
            handler.addFilter(StoreLogFilter())
