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


def requeue_if_head_lost(head_node: str | None, done: Path, poll_s: float = 5.0) -> bool:
    """Requeue this job once SLURM has dropped ``head_node`` from it (that node died); True when it did.

    Returns False, without requeueing, as soon as the head's ``done`` mark appears, the job is no longer
    RUNNING (SLURM is stopping or requeueing it anyway) or it was requeued already (a later run), or when
    SLURM cannot tell. While the head's node is still in the job (SLURM has not noticed yet: up to its
    SlurmdTimeout) it keeps asking."""
    job = _slurm_env("SLURM_JOB_ID")
    if not job or not head_node:
        return False
    restart = int(_slurm_env("SLURM_RESTART_COUNT", "0") or 0)
    while not done.exists():
        state, restarts, nodes = job_state(job)
        if state != "RUNNING" or restarts != restart:
            return False
        if head_node not in nodes:
            print(
                f"tcnn: the head's node {head_node} left job {job}: requeueing it",
                file=sys.stderr,
                flush=True,
            )
            return subprocess.run(["scontrol", "requeue", job], timeout=60).returncode == 0
        time.sleep(poll_s)
    return False
