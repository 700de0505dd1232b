"""One writer per workspace: an exclusive lock (``filelock``, an OS file lock, released by the kernel when its
process dies, so a lock left by a killed process is simply taken over) plus a holder record that names who
has it, for the one-line refusal a second writer gets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

LOCK_FILE = ".tcnn.lock"
HOLDER_FILE = ".tcnn.lock.holder"


class WorkspaceBusy(RuntimeError):
    """Another live process holds the workspace."""


def holder(root: str | os.PathLike) -> dict[str, Any]:
    """The record the current (or last) holder wrote: pid, host, command, since; {} when unreadable."""
    try:
        return json.loads((Path(root) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def workspace_lock(root: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold ``root``'s workspace lock for the block, or raise :class:`WorkspaceBusy` at once naming the
    holder's PID and host. ``what`` (e.g. "python -m stages.pretrain") goes into the holder record."""
    root = Path(root)
    lock = FileLock(str(root / LOCK_FILE), mode=0o644)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        h = holder(root)
        who = f"pid {h.get('pid', '?')} on {h.get('host', '?')}" + (
            f" ({h['what']})" if h.get("what") else ""
        )
        raise WorkspaceBusy(
            f"workspace {root.resolve()} is in use by {who} since {h.get('since', '?')}; "
            "wait for it to finish or stop it"
        ) from None
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}  # fmt: skip
        tmp = root / f"{HOLDER_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, root / HOLDER_FILE)
        yield
    finally:
        lock.release()
