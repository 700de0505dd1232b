"""A worker node's answer to a lost Ray head: ask SLURM whether the head's node left the job, then requeue it."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipelines.slurm.ray_node import _slurm_env


def _answers(host: str, port: int, timeout_s: float = 5.0) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False


def job_state(job_id: str) -> tuple[str | None, int, list[str]]:
    """(state, restarts, nodes) of a SLURM job now; (None, 0, []) when scontrol cannot tell."""
    try:
        out = subprocess.check_output(["scontrol", "-o", "show", "job", job_id], text=True, timeout=60,
                                      stderr=subprocess.DEVNULL)  # fmt: skip
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        nodelist = fields.get("NodeList", "")
        hosts = ""
        if nodelist and nodelist != "(null)":
            hosts = subprocess.check_output(
                ["scontrol", "show", "hostnames", nodelist], text=True, timeout=60
            )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, 0, []
    return fields.get("JobState"), int(fields.get("Restarts", "0") or 0), hosts.split()


def _say(line: str, said: set[str] | None = None) -> None:
    """One line on this task's stderr (its submitit log), once per distinct line when ``said`` is given."""
    if said is not None:
        if line in said:
            return
        said.add(line)
    print(f"tcnn: {line}", file=sys.stderr, flush=True)


def requeue_if_head_lost(
    head_node: str | None, done: Path, poll_s: float = 5.0, said: set[str] | None = None
) -> bool:
    """Requeue this job once SLURM has dropped ``head_node`` from it (that node died); True when it did.

    Returns False, without requeueing, as soon as the head's ``done`` mark appears, the job is no longer
    RUNNING (SLURM is stopping or requeueing it anyway) or it was requeued already (a later run), or when
    SLURM cannot tell. While the head's node is still in the job (SLURM has not noticed yet: up to its
    SlurmdTimeout) it keeps asking. Each thing it waits for or gives up on is said once in the task's log
    (``said``: the lines said already, kept by the caller across calls)."""
    job = _slurm_env("SLURM_JOB_ID")
    if not job or not head_node:
        return False
    said = said if said is not None else set()
    restart = int(_slurm_env("SLURM_RESTART_COUNT", "0") or 0)
    while not done.exists():
        state, restarts, nodes = job_state(job)
        if state is None:
            _say(
                f"the head's GCS does not answer and SLURM cannot tell job {job}'s state now; asking again",
                said,
            )
            return False
        if state != "RUNNING" or restarts != restart:
            _say(f"the head's GCS does not answer; job {job} is {state} (restarts {restarts}): leaving it to SLURM",
                 said)  # fmt: skip
            return False
        if head_node not in nodes:
            _say(f"the head's node {head_node} left job {job}: requeueing it")
            res = subprocess.run(["scontrol", "requeue", job], timeout=60, capture_output=True, text=True)
            if res.returncode != 0:
                _say(f"scontrol requeue {job} failed ({res.returncode}): {res.stderr.strip()[:200]}")
            return res.returncode == 0
        _say(f"the head's GCS does not answer; waiting for SLURM to drop {head_node} from job {job} "
             f"(its nodes: {','.join(nodes)})", said)  # fmt: skip
        time.sleep(poll_s)
    return False
