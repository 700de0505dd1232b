"""A stage ends with the `dvc repro` (or `dvc exp run`) that started it.

DVC runs a stage's ``cmd`` through a shell and, when it is stopped itself (SIGTERM to ``dvc repro``), exits
at once without passing the signal on: the stage would train on, write its outputs and close its runs
FINISHED for a `dvc.lock` nobody updates. A stage started by DVC (``DVC_STAGE`` in its environment, set by
DVC for every stage command) finds the DVC process among its ancestors and watches it; when it is gone the
stage stops itself with SIGTERM, which ends it as any stop signal does (a resume point where training is
under way, the runs KILLED, exit 75).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import psutil

DVC_STAGE_ENV = "DVC_STAGE"  # set by DVC for every stage command it runs (dvc.env.DVC_STAGE)
POLL_S = 1.0


def _is_dvc(proc: psutil.Process) -> bool:
    try:
        cmd = proc.cmdline()
    except (psutil.Error, OSError):
        return False
    head = [os.path.basename(c) for c in cmd[:3]]
    return "dvc" in head or (len(cmd) > 2 and cmd[1:3] == ["-m", "dvc"])


def dvc_ancestor(proc: psutil.Process | None = None) -> psutil.Process | None:
    """The nearest ancestor process that is DVC itself (``dvc ...`` or ``python -m dvc ...``), if any."""
    proc = proc or psutil.Process()
    with contextlib.suppress(psutil.Error):
        for parent in proc.parents():
            if _is_dvc(parent):
                return parent
    return None


@contextlib.contextmanager
def end_with_dvc(poll_s: float = POLL_S) -> Iterator[psutil.Process | None]:
    """While the block runs, SIGTERM this process once the DVC process that started it has gone (a daemon
    thread polls it every ``poll_s`` s). Outside DVC, or in a rank of a data-parallel stage (its launcher
    watches), nothing is watched."""
    dvc = dvc_ancestor() if os.environ.get(DVC_STAGE_ENV) and "RANK" not in os.environ else None
    if dvc is None:
        yield None
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if not dvc.is_running():  # gone, or its pid reused by another process (is_running checks that)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="tcnn-dvc-watch", daemon=True)
    thread.start()
    try:
        yield dvc
    finally:
        done.set()
