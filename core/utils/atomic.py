"""Atomic file writes: temp file in the same directory, fsync, os.replace, directory fsync.

The one implementation every writer in the project uses (checkpoints, Parquet sets, JSON, PNG, HTML), so a
killed process never leaves a half-written output. Torch-free, so worker processes stay light.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened for fsync
        fsync_file(directory)


def umask() -> int:
    """This process's umask, read thread-safely from /proc where it can be (``os.umask`` sets while it reads)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file (0644 under the usual umask 022)."""
    return 0o666 & ~umask()


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Write `path` through `write(fileobj)` into a temp file in the same directory, fsync, then rename.

    The temp file is removed when `write` fails; the destination is never left half-written. The file gets
    the permissions of a plainly created one (:func:`file_mode`; mkstemp's own are 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        # torch's zip writer reports a failed write (full disk, file size limit) as a RuntimeError of its
        # inline_container.cc ("file write failed", then "unexpected pos" while it closes the archive)
        if isinstance(err, RuntimeError) and "inline_container.cc" in str(err):
            raise OSError(errno.EIO, f"writing failed ({_free(path.parent)})", str(path)) from err
        raise
    fsync_dir(path.parent)
    return path


def _free(directory: Path) -> str:
    """How much room the file system holding `directory` has left, for a failed write's message."""
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.0f} MiB free there"
    except OSError:
        return "free space unknown"


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, allow_nan=True) + "\n")


def atomic_write_parquet(path: str | os.PathLike, table: Any) -> Path:
    """A pyarrow table as a Parquet file, atomically."""
    import pyarrow.parquet as pq

    return atomic_write(path, lambda f: pq.write_table(table, f))


def append_json_line(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line (a single O_APPEND write, fsynced: concurrent appenders do not interleave)."""
    data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode())
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
