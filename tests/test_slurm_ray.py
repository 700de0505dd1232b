"""Ray on SLURM: the submitit launcher of pipelines/slurm/ and the plain sbatch template, on the local cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from slurm_cluster import SlurmCluster, start_cluster

from pipelines.slurm.executor import make_executor, wait_result
from pipelines.slurm.ray_cluster import RayClusterConfig, launch_ray_cluster
from pipelines.slurm.ray_ports import RayPorts

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
OBJECT_STORE = 200 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    return start_cluster()


def _processes(marker: str) -> dict[int, tuple[str, str]]:
    """Live processes whose command line mentions ``marker`` (a job's Ray temp dir): pid -> (name, command line)."""
    found = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_text().replace("\0", " ").strip() if proc.name.isdigit() else ""
            if marker in cmdline:
                found[int(proc.name)] = ((proc / "comm").read_text().strip(), cmdline)
    return found


def _ray_processes(marker: str, grace_s: float = 30) -> list[str]:
    """Command lines of the processes that mention ``marker`` and still live after ``grace_s`` seconds (the
    Ray processes of a finished job exit within moments of it, later on a loaded machine)."""
    deadline = time.monotonic() + grace_s
    while (left := [cmdline for _, cmdline in _processes(marker).values()]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _usr2(pid: int) -> str:
    """How process ``pid`` treats SIGUSR2, from the SigIgn/SigCgt masks in /proc: ignored, caught or default."""
    masks = dict(
        ln.split(":\t") for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in ln
    )
    bit = 1 << (signal.SIGUSR2 - 1)  # signal n is bit n-1
    if int(masks["SigIgn"], 16) & bit:
        return "ignored"
    return "caught" if int(masks["SigCgt"], 16) & bit else "default"


def _driver(values: list[int]) -> dict:
    """Runs on the head node inside the SLURM job, with ray.init(address=...) already done."""
    import ray

    @ray.remote(num_cpus=1)
    def square(x: int) -> tuple[int, str, str]:
        return x * x, os.environ.get("SLURM_JOB_ID", ""), _usr2(os.getpid())

    results = ray.get([square.remote(v) for v in values])
    job = os.environ.get("SLURM_JOB_ID", "")
    return {
        "squares": [r[0] for r in results],
        "task_job_ids": sorted({r[1] for r in results}),
        "usr2": {
            "driver": _usr2(os.getpid()),
            "task workers": sorted({r[2] for r in results}),
            **{
                name: _usr2(pid)
                for pid, (name, _) in _processes(f"/tmp/tcnn-ray-{job}/").items()
                if name in ("gcs_server", "raylet")
            },
        },
        "resources": ray.cluster_resources(),
        "address": os.environ.get("RAY_ADDRESS"),
        "nodes": len([n for n in ray.nodes() if n["Alive"]]),
        "job_id": os.environ.get("SLURM_JOB_ID"),
    }


def test_ray_cluster_on_slurm_via_submitit(cluster: SlurmCluster, tmp_path: Path) -> None:
    ports = RayPorts.find_free()
    config = RayClusterConfig(ports=ports, object_store_memory=OBJECT_STORE, startup_timeout_s=240)
    executor = make_executor(
        tmp_path / "submitit", nodes=1, cpus_per_node=1, timeout_min=10, partition=cluster.partition
    )
    t0 = time.monotonic()
    job = launch_ray_cluster(executor, _driver, [1, 2, 3, 4], config=config)
    try:
        out = wait_result(job, timeout_s=420)
    except BaseException:
        cluster.run("scancel", job.job_id, check=False)
        raise
    took = time.monotonic() - t0
    print(f"Ray-on-SLURM job {job.job_id}: {took:.1f}s from submit to result")
    assert out["squares"] == [1, 4, 9, 16]
    assert out["task_job_ids"] == [job.job_id]  # the tasks ran inside the allocation
    assert out["job_id"] == job.job_id
    assert out["nodes"] == 1
    assert out["resources"]["CPU"] == 1.0  # --num-cpus from SLURM_CPUS_PER_TASK, not the machine's count
    assert out["resources"].get("GPU", 0) == 0
    assert out["resources"]["object_store_memory"] == pytest.approx(OBJECT_STORE, rel=0.01)
    assert out["address"].endswith(f":{ports.gcs}")  # the pinned GCS port
    # USR2 (the time-limit warning reaches every process of the step) is submitit's to handle in the driver;
    # Ray's processes ignore it, so the runtime survives until the requeue stops it.
    assert out["usr2"] == {
        "driver": "caught",
        "task workers": ["ignored"],
        "gcs_server": "ignored",
        "raylet": "ignored",
    }
    # Clean shutdown: the job ended, its Ray processes and temp dir are gone, the rendezvous file removed.
    deadline = time.monotonic() + 60
    while cluster.job_field(job.job_id, "JobState") not in ("COMPLETED", None):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    temp = f"/tmp/tcnn-ray-{job.job_id}"
    assert _ray_processes(temp) == []
    assert not Path(temp).exists()
    assert list((tmp_path / "submitit").glob("ray-*.json")) == []
    assert (tmp_path / "submitit" / "ray-logs" / f"{job.job_id}-0-head.log").exists()


def test_ray_sbatch_template(cluster: SlurmCluster, tmp_path: Path) -> None:
    ports = RayPorts.find_free(n_worker_ports=1000)
    driver = (
        "import os, ray; ray.init(); "
        "print('SQUARES', ray.get([ray.remote(lambda x: x * x).remote(i) for i in range(4)])); "
        "print('CPUS', ray.cluster_resources()['CPU']); print('ADDRESS', os.environ['RAY_ADDRESS'])"
    )
    out = tmp_path / "ray.out"
    env = {
        **os.environ,
        "TCNN_RAY_PORT": str(ports.gcs),
        "TCNN_RAY_OBJECT_STORE": str(OBJECT_STORE),
        "TCNN_RAY_BIN": str(Path(sys.executable).with_name("ray")),
    }
    t0 = time.monotonic()
    res = subprocess.run(
        ["sbatch", "--parsable", "--cpus-per-task=1", f"--output={out}",
         str(REPO / "infra" / "slurm" / "ray_cluster.sbatch"), sys.executable, "-c", driver],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 420
    while (state := cluster.job_field(job_id, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED", None):
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id, check=False)
            pytest.fail(f"sbatch Ray job {job_id} still {state} after 420 s")
        time.sleep(0.5)
    print(f"sbatch Ray job: {time.monotonic() - t0:.1f}s from submit to the end of the job")
    log = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", log[-3000:]
    assert "SQUARES [0, 1, 4, 9]" in log
    assert "CPUS 1.0" in log
    assert "ADDRESS " in log and f":{ports.gcs}" in log
    assert "driver exited with 0" in log
    assert _ray_processes(f"/tmp/tcnn-ray-{job_id}") == []
    assert not Path(f"/tmp/tcnn-ray-{job_id}").exists()


def _resumable_driver(progress: str, n: int) -> list[int]:
    """A driver that, like a sweep, keeps its progress on disk and resumes from it after a requeue."""
    import ray

    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    path = Path(progress)
    done = len(path.read_text().splitlines()) if path.exists() else 0
    for i in range(done, n):
        value = ray.get(square.remote(i))
        time.sleep(0.5)
        with open(path, "a") as f:
            f.write(f"{i} {value} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
    return [int(line.split()[1]) for line in path.read_text().splitlines()]


def test_ray_cluster_job_survives_time_limit_requeue(cluster: SlurmCluster, tmp_path: Path) -> None:
    """USR2 (time limit) mid-driver: submitit requeues the job, the head tears Ray down, and the requeued job brings up a
    fresh cluster (new rendezvous, same pinned ports) in which the driver resumes from its own state."""
    config = RayClusterConfig(
        ports=RayPorts.find_free(), object_store_memory=OBJECT_STORE, startup_timeout_s=240
    )
    executor = make_executor(
        tmp_path / "submitit", nodes=1, cpus_per_node=1, timeout_min=10, partition=cluster.partition
    )
    progress = tmp_path / "progress.txt"
    n = 12
    job = launch_ray_cluster(executor, _resumable_driver, str(progress), n, config=config)
    try:
        deadline = time.monotonic() + 300
        while not progress.exists() or len(progress.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline, "the driver made no progress"
            assert not job.done(), job.stderr()
            time.sleep(0.5)
        job._interrupt(timeout=True)  # USR2, as SLURM sends it before the time limit
        cluster.release_requeued(job.job_id, log_dir=tmp_path / "submitit")
        result = wait_result(job, timeout_s=420)
    except BaseException:
        cluster.run("scancel", job.job_id, check=False)
        raise
    assert result == [i * i for i in range(n)]
    rows = [line.split() for line in progress.read_text().splitlines()]
    assert [int(r[0]) for r in rows] == list(range(n))  # every step recorded exactly once
    assert rows[0][2] == "0" and rows[-1][2] == "1"
    logs = sorted(p.name for p in (tmp_path / "submitit" / "ray-logs").iterdir())
    assert logs == [f"{job.job_id}-0-head.log", f"{job.job_id}-1-head.log"]  # two clusters, one per run
    deadline = time.monotonic() + 60
    while cluster.job_field(job.job_id, "JobState") not in ("COMPLETED", None):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert _ray_processes(f"/tmp/tcnn-ray-{job.job_id}") == []
