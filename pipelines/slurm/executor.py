"""The submitit SLURM executor (one task per node, the Ray layout), its sbatch options, and following a job.

submitit asks ``sacct`` for job states; without an accounting database (small or test clusters) the executor
here falls back to ``squeue``.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Any

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob


class SqueueFallbackWatcher(SlurmInfoWatcher):
    """submitit's watcher asks ``sacct``; without slurmdbd that fails, so ask ``squeue --states=all``."""

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        job_ids = ",".join(arg for prev, arg in zip(command, command[1:]) if prev == "-j")
        attempts = (
            (command, self.read_info),
            (["squeue", "--noheader", "--states=all", "-o", "%i|%T|%N", "-j", job_ids], self._read_squeue),
        )
        for cmd, parse in attempts:
            try:
                out = subprocess.check_output(cmd, stderr=subprocess.DEVNULL, timeout=60)
            except (OSError, subprocess.SubprocessError):
                continue
            self._info_dict.update(parse(out))
            break
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _read_squeue(self, output: bytes | str) -> dict[str, dict[str, str]]:
        text = output.decode() if isinstance(output, bytes) else output
        return self.read_info("JobID|State|NodeList\n" + text)


class SqueueSlurmJob(SlurmJob):
    watcher = SqueueFallbackWatcher(delay_s=60)


class SlurmExecutor(submitit.SlurmExecutor):
    """submitit's SLURM executor with the squeue fallback for job states."""

    job_class = SqueueSlurmJob


def make_executor(
    folder: str | os.PathLike,
    *,
    nodes: int = 1,
    cpus_per_node: int = 1,
    gpus_per_node: int | str = 0,
    mem_gb: float | None = None,
    timeout_min: int = 60,
    partition: str | None = None,
    job_name: str = "tcnn",
    signal_delay_s: int = 120,
    additional: dict[str, Any] | None = None,
    max_num_timeout: int = 3,
    no_kill: bool | None = None,
) -> SlurmExecutor:
    """A submitit executor for ``nodes`` nodes, one task per node with ``cpus_per_node`` CPUs and
    ``gpus_per_node`` GPUs (a count, or ``TYPE:COUNT`` such as ``a100:8``). ``folder`` must be on a filesystem
    every node sees (logs, pickles, rendezvous). ``additional``: further sbatch options (``account``,
    ``constraint``, ``qos``, ...; :func:`sbatch_options` parses them from ``KEY=VALUE`` text).

    ``signal_delay_s``: SLURM sends USR2 that long before the time limit; submitit then checkpoints and
    requeues (``max_num_timeout`` times at most).

    ``no_kill`` (default: on for several nodes): ``sbatch --no-kill`` and ``srun --no-kill``, so that the loss
    of a node ends only that node's task; the job and its other tasks (the Ray head, the driver) go on. Without
    it SLURM ends the whole job step when one node fails. The job's other nodes keep their allocation.
    """
    if nodes < 1 or cpus_per_node < 1 or gpu_count(gpus_per_node) < 0:
        raise ValueError(
            f"make_executor: bad resources nodes={nodes} cpus={cpus_per_node} gpus={gpus_per_node}"
        )
    executor = SlurmExecutor(folder=folder, max_num_timeout=max_num_timeout)
    kwargs: dict[str, Any] = {
        "nodes": nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": cpus_per_node,
        "time": timeout_min,
        "job_name": job_name,
        "signal_delay_s": signal_delay_s,
    }
    if gpu_count(gpus_per_node):
        kwargs["gpus_per_node"] = gpus_per_node
    if mem_gb is not None:
        kwargs["mem"] = f"{int(mem_gb * 1024)}MB"
    if partition:
        kwargs["partition"] = partition
    extra = dict(additional or {})
    if no_kill if no_kill is not None else nodes > 1:
        extra.setdefault("no_kill", True)
        kwargs["srun_args"] = ["--no-kill"]
    if extra:
        kwargs["additional_parameters"] = extra
    executor.update_parameters(**kwargs)
    return executor


#: sbatch options make_executor sets from its own arguments (tcnn sweep has an option for each)
RESERVED_SBATCH = ("nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "time", "partition", "mem",
                   "job-name", "signal", "output", "error", "open-mode", "array")  # fmt: skip
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")
_GPUS = re.compile(r"^(?:([A-Za-z0-9_.-]+):)?(\d+)$")


def gpu_count(gpus: int | str) -> int:
    """The number in ``--gpus-per-node`` (``8`` or ``a100:8``); ValueError for anything else."""
    if isinstance(gpus, int):
        return gpus
    m = _GPUS.match(gpus.strip())
    if not m:
        raise ValueError(f"GPUs per node {gpus!r}: expected COUNT or TYPE:COUNT (e.g. 4 or a100:4)")
    return int(m.group(2))


def sbatch_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` (or a bare ``KEY`` for a flag) -> submitit's ``additional_parameters``.

    ``account=proj42 constraint=a100 qos=high exclusive`` -> ``--account=proj42 --constraint=a100 --qos=high
    --exclusive``. Options with their own argument (:data:`RESERVED_SBATCH`) are refused, naming it."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not _SBATCH_KEY.match(key) or (sep and not value):
            raise ValueError(f"--sbatch {item!r}: expected KEY=VALUE or KEY (e.g. account=proj42)")
        if key.replace("_", "-") in RESERVED_SBATCH:
            raise ValueError(f"--sbatch {item!r}: {key} is set by tcnn (its own option, or the Ray layout)")
        out[key.replace("-", "_")] = value if sep else True
    return out


def wait_result(
    job: submitit.Job, *, timeout_s: float | None = None, poll_s: float = 1.0, state_every_s: float = 10.0
) -> Any:
    """Block until ``job`` ends; return task 0's result (the driver's, for a Ray cluster job).

    The result file is checked every ``poll_s``, the scheduler (sacct, else squeue) every ``state_every_s``.
    Raises ``TimeoutError`` after ``timeout_s`` (the job keeps running: cancel it yourself), and submitit's
    ``FailedJobError`` / ``UncompletedJobError`` (with the job's stderr) when it failed or was killed. Only
    task 0 has to leave a result: a worker node lost mid-job (``no_kill``) never writes one.
    """
    start = time.monotonic()
    last_state = start
    while True:
        now = time.monotonic()
        force = now - last_state >= state_every_s
        if force:
            last_state = now
        if job.done(force_check=force):
            break
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(f"SLURM job {job.job_id} not done after {timeout_s:.0f}s (state {job.state})")
        time.sleep(poll_s)
    return head_result(job)


def head_result(job: submitit.Job) -> Any:
    """Task 0's result (the driver's); raises as ``job.results()`` would, but ignores the other tasks."""
    return job.task(0).result()
