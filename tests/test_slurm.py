"""The local SLURM cluster and submitit on it: plain jobs, squeue fallback, preemption and requeue."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
from slurm_cluster import SlurmCluster, start_cluster

from pipelines.slurm.executor import make_executor, wait_result

# The job processes cannot import this test module (tests/ is not on their path): ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    return start_cluster()


def _add(a: int, b: int) -> tuple[int, str, str]:
    return a + b, os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_CPUS_PER_TASK", "")


def test_srun_and_sbatch(cluster: SlurmCluster, tmp_path: Path) -> None:
    assert cluster.cpus >= 1
    assert cluster.run("srun", "-N1", "-n1", "hostname", timeout=60).stdout.strip() == cluster.node
    out = tmp_path / "wrap.out"
    res = cluster.run(
        "sbatch", "--parsable", "--wait", "-c", "1", "-o", str(out), "--wrap", "echo job=$SLURM_JOB_ID; hostname",
        timeout=120,
    )  # fmt: skip
    job_id = res.stdout.strip().split(";")[0]
    assert out.read_text().split() == [f"job={job_id}", cluster.node]
    # No accounting database: sacct fails, which is why submitit needs another way to see job states.
    assert cluster.run("sacct", "-j", job_id, check=False).returncode != 0


def test_submitit_autoexecutor_runs_a_function(cluster: SlurmCluster, tmp_path: Path) -> None:
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, cpus_per_task=1, slurm_partition=cluster.partition)
    job = executor.submit(_add, 2, 3)
    total, job_id, cpus = job.result()
    assert (total, job_id, cpus) == (5, job.job_id, "1")


@pytest.mark.slow
def test_squeue_fallback_sees_a_cancelled_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    """submitit alone polls sacct only, so a job that dies without a result looks UNKNOWN forever; the
    executor of pipelines.slurm.executor falls back to squeue and reports it."""
    executor = make_executor(
        tmp_path / "submitit", cpus_per_node=1, timeout_min=5, partition=cluster.partition
    )
    job = executor.submit(time.sleep, 300)
    deadline = time.monotonic() + 60
    while cluster.job_field(job.job_id, "JobState") != "RUNNING":
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.5)
    assert job.state == "RUNNING"
    cluster.run("scancel", job.job_id)
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        wait_result(job, timeout_s=120)
    assert job.state.startswith("CANCELLED")


class _Counter(submitit.helpers.Checkpointable):
    """Counts to ``n`` slowly, logging each step with the SLURM restart count; resumable via checkpoint()."""

    def __init__(self, log: str, n: int) -> None:
        self.log = log
        self.n = n
        self.done = 0

    def __call__(self) -> int:
        while self.done < self.n:
            time.sleep(0.5)
            self.done += 1
            with open(self.log, "a") as f:
                f.write(f"{self.done} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
        return self.done


def _lines(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [tuple(map(int, ln.split())) for ln in path.read_text().splitlines() if ln.strip()]


def _wait_steps(path: Path, k: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_lines(path)) < k:
        assert time.monotonic() < deadline, f"fewer than {k} steps after {timeout}s"
        time.sleep(0.2)


@pytest.mark.slow
def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """USR2 (SLURM's time-limit signal for submitit jobs): submitit calls checkpoint(), requeues the job with
    `scontrol requeue`, and the restarted job continues from the checkpointed state."""
    log = tmp_path / "steps.txt"
    executor = make_executor(
        tmp_path / "submitit", cpus_per_node=1, timeout_min=10, partition=cluster.partition
    )
    job = executor.submit(_Counter(str(log), 12))
    _wait_steps(log, 3)
    # USR2 alone, as SLURM sends it `signal_delay_s` before the time limit. (submitit's `_interrupt()` default
    # also sends SIGTERM 5 ms earlier, which can kill the `scontrol requeue` the USR2 handler starts.)
    job._interrupt(timeout=True)
    cluster.release_requeued(job.job_id, log_dir=tmp_path / "submitit")
    assert wait_result(job, timeout_s=240) == 12
    steps = _lines(log)
    assert [s for s, _ in steps] == list(range(1, 13))  # resumed where it stopped: no step twice, none lost
    restarts = [r for _, r in steps]
    assert restarts[0] == 0 and restarts[-1] == 1 and restarts == sorted(restarts)
    assert cluster.job_field(job.job_id, "Restarts") == "1"


def _resumable_count(log: str, n: int) -> int:
    """Keeps its progress on disk (what a sweep does through Tune checkpoints), so a hard requeue that never
    calls checkpoint() still resumes. Each step is recorded atomically before the next one starts."""
    path = Path(log)
    done = len(path.read_text().splitlines()) if path.exists() else 0
    while done < n:
        time.sleep(0.5)
        done += 1
        with open(path, "a") as f:
            f.write(f"{done} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
            f.flush()
            os.fsync(f.fileno())
    return done


@pytest.mark.slow
def test_scontrol_requeue_restarts_the_job_which_resumes(cluster: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "steps.txt"
    executor = make_executor(
        tmp_path / "submitit", cpus_per_node=1, timeout_min=10, partition=cluster.partition
    )
    # submitit ignores SIGTERM, so the old run goes on until SIGKILL (KillWait=5 s): count for longer than that.
    job = executor.submit(_resumable_count, str(log), 24)
    _wait_steps(log, 3)
    cluster.run("scontrol", "requeue", job.job_id)
    cluster.release_requeued(job.job_id, log_dir=tmp_path / "submitit")
    assert wait_result(job, timeout_s=240) == 24
    steps = _lines(log)
    assert [s for s, _ in steps] == list(range(1, 25))
    restarts = [r for _, r in steps]
    assert restarts[0] == 0 and restarts[-1] == 1 and restarts == sorted(restarts)
    assert cluster.job_field(job.job_id, "Restarts") == "1"


def test_local_cluster_script_is_idempotent(cluster: SlurmCluster) -> None:
    script = Path(__file__).resolve().parents[1] / "infra" / "slurm" / "local_cluster.sh"
    if os.geteuid() != 0:
        pytest.skip("start needs root")
    res = subprocess.run([str(script), "start"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "already running" in res.stderr
    status = subprocess.run([str(script), "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and status.stdout.startswith("up: node ")
