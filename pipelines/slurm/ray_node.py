"""One node's side of a Ray-on-SLURM job: its SLURM environment, Ray's token authentication, the Ray
processes and temp dir a previous run of the job left on it, and the launch error."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

RAY_SOCKET_LIMIT = 107  # bytes in a unix socket path (sun_path)
# <temp>/session_YYYY-MM-DD_HH-MM-SS_ffffff_<pid>/sockets/plasma_store: ~68 bytes after <temp>
_RAY_SOCKET_SUFFIX = 70


class SlurmLaunchError(RuntimeError):
    """The Ray cluster on the allocation could not be brought up (one line, with the log to read)."""


def _slurm_env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _job_tag() -> str:
    """``<jobid>-<restart>``: distinguishes a requeued run's rendezvous from the previous one's."""
    job = _slurm_env("SLURM_ARRAY_JOB_ID") or _slurm_env("SLURM_JOB_ID", f"local{os.getpid()}")
    if _slurm_env("SLURM_ARRAY_TASK_ID"):
        job = f"{job}_{_slurm_env('SLURM_ARRAY_TASK_ID')}"
    return f"{job}-{_slurm_env('SLURM_RESTART_COUNT', '0')}"


def _local_cpus() -> int:
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = _slurm_env(name)
        if value.isdigit():
            return int(value)
    return os.cpu_count() or 1


def _local_gpus() -> int:
    visible = _slurm_env("CUDA_VISIBLE_DEVICES")
    if visible and visible not in ("NoDevFiles", "-1"):
        return len([d for d in visible.split(",") if d.strip()])
    return 0


def align_ray_auth() -> str:
    """Make ``ray start`` and ``ray.init(address=...)`` in this job agree on token authentication.

    Ray >= 2.5x: ``ray start`` turns token auth on by itself when ``~/.ray/auth_token`` exists (any earlier
    local ``ray.init()`` creates it), while a driver connecting to an existing cluster only sends the token
    when ``RAY_AUTH_MODE=token`` is set -- so the head rejects its own job's driver ("InvalidAuthToken").
    Unless the user chose a mode, pick it from the token's presence and export it to every process we start.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:
        has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or (Path.home() / ".ray" / "auth_token").is_file()
        mode = "token" if has_token else "disabled"
        os.environ["RAY_AUTH_MODE"] = mode
    return mode


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_IGNORE_USR2_EXEC = 'trap "" USR2; exec "$@"'  # sh -c SCRIPT NAME ARGS...: $@ is the command


def _pids_using(temp: Path) -> list[int]:
    """Processes on this node whose command line names ``temp`` or a path under it (a job's Ray processes)."""
    marks = (f"{temp}/".encode(), f"{temp}\0".encode())  # /proc cmdline: arguments end with NUL
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes()
                if any(m in cmdline for m in marks):
                    pids.append(int(proc.name))
    return pids


def _clear_previous_run(temp: Path, timeout_s: float = 30.0) -> None:
    """Remove what a previous run of this job left on this node: its Ray processes (SIGKILL) and temp dir.

    Ray ignores the time-limit USR2 (see `RayClusterJob._spawn`), so at a requeue it meets SLURM's SIGTERM
    mid-run and shuts down gracefully; where the job step's process tracking loses the orphans (the
    proctrack/linuxproc plugin follows parent links), a slow one can outlive the step and still hold the pinned
    ports when the requeued run starts here."""
    deadline = time.monotonic() + timeout_s
    while pids := _pids_using(temp):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise SlurmLaunchError(f"processes {pids} of a previous run (using {temp}) do not exit")
        time.sleep(0.2)
    shutil.rmtree(temp, ignore_errors=True)
