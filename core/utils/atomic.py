"""Atomic file writes: temp file in the same directory, fsync, os.replace, directory fsync.

The one implementation every writer in the project uses (checkpoints, Parquet sets, JSON, PNG, HTML), so a
killed process never leaves a half-written output. Torch-free, so worker processes stay light.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened for fsync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO[bytes]], None], *, shared: bool = False
) -> Path:
    """Write `path` through `write(fileobj)` into a temp file in the same directory, fsync, then rename.

    The temp file is removed when `write` fails; the destination is never left half-written. `shared`: give
    the file the usual umask permissions (mkstemp's default is 0600) for files meant to be read by others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if shared:
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def remove_stale_temps(directory: str | os.PathLike, patterns: tuple[str, ...] = (".*.tmp",)) -> int:
    """Delete, below `directory`, the temp files of writers that were SIGKILLed mid-write (``atomic_write``
    names them ``.<name>.<random>.tmp``; a killed process cannot clean up after itself). Call it only on a
    directory no other process is writing into (a stage's own output directory). Returns how many went."""
    gone = 0
    for pattern in patterns:
        for f in Path(directory).rglob(pattern):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                gone += 1
    return gone


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, shared: bool = False) -> Path:
    return atomic_write(path, lambda f: f.write(data), shared=shared)


def atomic_write_text(path: str | os.PathLike, text: str, *, shared: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode(), shared=shared)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2, shared: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, allow_nan=True) + "\n", shared=shared)
