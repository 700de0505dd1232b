"""The Ray cluster on a SLURM allocation: its config, the submitit callable that runs it (Ray head and
driver on task 0, Ray workers on the others), and :func:`launch_ray_cluster`, which submits it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from core.utils.atomic import atomic_write_json
from pipelines.slurm.head_loss import _answers, requeue_if_head_lost
from pipelines.slurm.ray_node import (
    _IGNORE_USR2_EXEC,
    _RAY_SOCKET_SUFFIX,
    RAY_SOCKET_LIMIT,
    SlurmLaunchError,
    _clear_previous_run,
    _job_tag,
    _local_cpus,
    _local_gpus,
    _slurm_env,
    _tail,
    align_ray_auth,
)
from pipelines.slurm.ray_ports import RayPorts


@dataclass(frozen=True)
class RayClusterConfig:
    """How the Ray cluster on the allocation is started.

    ``num_cpus``/``num_gpus``: per node; None = what SLURM gave the task (``SLURM_CPUS_PER_TASK``,
    ``CUDA_VISIBLE_DEVICES``). ``object_store_memory`` in bytes (None = Ray's default, 30% of RAM).
    ``temp_root``: a short local directory; each node uses ``<temp_root>/tcnn-ray-<jobid>``.
    ``node_ip``: None = Ray's own choice of this node's address.
    ``drain_s``: how long ``ray start`` drains its node on SIGTERM before it stops its processes (Ray's
    ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, 30 s by default there). SIGTERM here means the job is being
    stopped (requeue, cancel, time limit), and draining only keeps the trials training into SLURM's SIGKILL,
    past the checkpoint they will resume from; 0 stops them at once.
    """

    ports: RayPorts = field(default_factory=RayPorts)
    num_cpus: int | None = None
    num_gpus: int | None = None
    object_store_memory: int | None = None
    temp_root: str = "/tmp"
    node_ip: str | None = None
    include_dashboard: bool = False
    startup_timeout_s: float = 300.0
    keep_temp: bool = False
    ray_bin: str | None = None  # default: the `ray` next to this interpreter
    head_check_s: float = 10.0  # how often a worker node checks that the head's GCS answers
    drain_s: float = 0.0


class RayClusterJob(submitit.helpers.Checkpointable):
    """The submitit callable that runs a Ray cluster over the job's nodes and ``driver`` on the head."""

    def __init__(
        self,
        driver: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        config: RayClusterConfig | None = None,
        rendezvous_dir: str | os.PathLike,
    ) -> None:
        self.driver = driver
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.config = config or RayClusterConfig()
        self.rendezvous_dir = str(Path(rendezvous_dir).absolute())

    # -- paths shared by all tasks of one (re)start of the job
    def _paths(self) -> tuple[Path, Path, Path]:
        tag = _job_tag()
        base = Path(self.rendezvous_dir)
        return base / f"ray-{tag}.json", base / f"ray-{tag}.done", base / "ray-logs"

    def _temp_dir(self, rank: int) -> Path:
        """``<temp_root>/tcnn-ray-<jobid>`` on the head, ``...-<rank>`` on worker ``rank``: distinct even where
        nodes share ``/tmp`` (one Ray per directory; `_clear_previous_run` kills by it)."""
        name = f"tcnn-ray-{_job_tag().split('-')[0]}" + (f"-{rank}" if rank else "")
        temp = Path(self.config.temp_root) / name
        if len(str(temp)) + _RAY_SOCKET_SUFFIX > RAY_SOCKET_LIMIT:
            raise SlurmLaunchError(
                f"Ray temp dir {temp} is too long for unix sockets ({RAY_SOCKET_LIMIT} bytes); "
                "use a shorter RayClusterConfig.temp_root"
            )
        return temp

    def _ray(self) -> str:
        if self.config.ray_bin:
            return self.config.ray_bin
        candidate = Path(sys.executable).with_name("ray")
        return str(candidate) if candidate.exists() else "ray"

    def _node_ip(self) -> str:
        if self.config.node_ip:
            return self.config.node_ip
        import ray.util

        return ray.util.get_node_ip_address()

    def _common_args(self, temp: Path) -> list[str]:
        cfg = self.config
        args = [
            f"--num-cpus={cfg.num_cpus if cfg.num_cpus is not None else _local_cpus()}",
            f"--num-gpus={cfg.num_gpus if cfg.num_gpus is not None else _local_gpus()}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            "--block",
        ]
        if cfg.object_store_memory:
            args.append(f"--object-store-memory={int(cfg.object_store_memory)}")
        return args

    def _spawn(self, cmd: list[str], log: Path) -> subprocess.Popen:
        """Start ``cmd`` (a ``ray start``) with SIGUSR2 ignored, in its own process group.

        SLURM's ``--signal=USR2@120`` (submitit's time-limit warning) reaches every process of the job step,
        and Ray's gcs_server, raylet and workers do not handle USR2, so by default they die of it while
        submitit's handler in the driver is still checkpointing and running ``scontrol requeue``: a driver
        whose Ray runtime vanished can fail the job before the requeue. An ignored signal stays ignored
        across fork/exec, so the whole Ray tree inherits it; Ray stops at the requeue's SIGTERM as before.
        The shell's ``exec`` keeps the pid (``_stop`` signals it). ``preexec_fn`` would do the same but is
        unsafe in a process with threads.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["/bin/sh", "-c", _IGNORE_USR2_EXEC, cmd[0], *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as a whole, never `ray stop`
                env={
                    **os.environ,
                    "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(self.config.drain_s),
                },
            )

    @staticmethod
    def _stop(proc: subprocess.Popen | None, grace_s: float = 15.0) -> None:
        """SIGTERM to `ray start --block` (it stops its services), then SIGKILL the whole process group."""
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def __call__(self) -> Any:
        align_ray_auth()
        rank = int(_slurm_env("SLURM_PROCID", "0"))
        with contextlib.suppress(RuntimeError):  # RuntimeError: not inside submitit (called directly)
            rank = submitit.JobEnvironment().global_rank
        return self._head() if rank == 0 else self._worker(rank)

    def _head(self) -> Any:
        cfg = self.config
        rendezvous, done, logs = self._paths()
        temp = self._temp_dir(0)
        _clear_previous_run(temp)
        done.unlink(missing_ok=True)
        ip = self._node_ip()
        address = f"{ip}:{cfg.ports.gcs}"
        cmd = [self._ray(), "start", "--head", f"--node-ip-address={ip}", *cfg.ports.head_args()]
        cmd += [f"--include-dashboard={str(cfg.include_dashboard).lower()}", *self._common_args(temp)]
        log = logs / f"{_job_tag()}-head.log"
        num_nodes = int(_slurm_env("SLURM_JOB_NUM_NODES", _slurm_env("SLURM_NNODES", "1")))
        proc = None
        previous_address = os.environ.get("RAY_ADDRESS")
        try:
            proc = self._spawn(cmd, log)
            self._wait_head(proc, temp, ip, cfg.ports.gcs, log)
            info = {
                "address": address,
                "head_host": socket.gethostname(),
                "head_node": _slurm_env("SLURMD_NODENAME"),
                "job": _job_tag(),
                "num_nodes": num_nodes,
                "temp_dir": str(temp),
            }
            atomic_write_json(rendezvous, info)
            import ray

            os.environ["RAY_ADDRESS"] = address
            ray.init(address=address, log_to_driver=True)
            try:
                self._wait_nodes(ray, num_nodes, proc, log)
                return self.driver(*self.args, **self.kwargs)
            finally:
                ray.shutdown()
        finally:
            with contextlib.suppress(OSError):
                done.write_text("done\n")
            self._stop(proc)
            if previous_address is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = previous_address
            rendezvous.unlink(missing_ok=True)
            if not cfg.keep_temp:
                shutil.rmtree(temp, ignore_errors=True)

    def _wait_head(self, proc: subprocess.Popen, temp: Path, ip: str, port: int, log: Path) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        ready_file = temp / "ray_current_cluster"  # written by `ray start` once its services are up
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SlurmLaunchError(f"ray head exited with {proc.returncode}; log {log}:\n{_tail(log)}")
            if ready_file.exists():
                with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=2):
                    return
            time.sleep(0.5)
        raise SlurmLaunchError(f"ray head not up after {self.config.startup_timeout_s:.0f}s; log {log}")

    def _wait_nodes(self, ray: Any, num_nodes: int, proc: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            if alive >= num_nodes:
                return
            if proc.poll() is not None:
                raise SlurmLaunchError(f"ray head exited with {proc.returncode}; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise SlurmLaunchError(f"only {alive}/{num_nodes} Ray nodes joined; logs in {log.parent}")
            time.sleep(1.0)

    def _worker(self, rank: int) -> None:
        rendezvous, done, logs = self._paths()
        temp = self._temp_dir(rank)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not rendezvous.exists():
            if done.exists():
                return None  # the head already gave up
            if time.monotonic() > deadline:
                raise SlurmLaunchError(
                    f"no rendezvous file {rendezvous} after {self.config.startup_timeout_s}s"
                )
            time.sleep(1.0)
        info = json.loads(rendezvous.read_text())
        _clear_previous_run(temp)
        ip = self._node_ip()
        cmd = [self._ray(), "start", f"--address={info['address']}", f"--node-ip-address={ip}"]
        cmd += [*self.config.ports.node_args(), *self._common_args(temp)]
        log = logs / f"{_job_tag()}-worker{rank}.log"
        proc = self._spawn(cmd, log)
        try:
            self._serve(proc, info, done, f"ray worker {rank} exited; log {log}")
        finally:
            self._stop(proc)
            if not self.config.keep_temp:
                shutil.rmtree(temp, ignore_errors=True)
        return None

    def _serve(self, proc: subprocess.Popen, info: dict[str, Any], done: Path, failure: str) -> None:
        """Keep this worker node in the cluster until the head's done mark; watch the head meanwhile.

        A head that finishes (or fails) writes ``done``. A head whose node died writes nothing: with
        ``--no-kill`` SLURM keeps such a job running on the other nodes until its time limit, so when the
        head's GCS stops answering this task waits for SLURM to drop the head's node from the job and then
        requeues the job (:func:`requeue_if_head_lost`); the requeued job starts over and the driver resumes.
        """
        host, port = info["address"].rsplit(":", 1)
        next_check = time.monotonic() + self.config.head_check_s
        said: set[str] = set()  # what the head-loss watch said already (each line once in the log)
        while not done.exists():
            gone = proc.poll() is not None
            if gone or time.monotonic() >= next_check:
                next_check = time.monotonic() + self.config.head_check_s
                if not done.exists() and not _answers(host, int(port)):
                    if requeue_if_head_lost(info.get("head_node"), done, said=said):
                        return
                elif gone and not done.exists():
                    raise SlurmLaunchError(failure)
            time.sleep(1.0)


def launch_ray_cluster(
    executor: submitit.Executor,
    driver: Callable[..., Any],
    *args: Any,
    config: RayClusterConfig | None = None,
    rendezvous_dir: str | os.PathLike | None = None,
    **kwargs: Any,
) -> submitit.Job:
    """Submit a job that brings up Ray on all its nodes and runs ``driver(*args, **kwargs)`` on the head.

    ``rendezvous_dir`` (shared by all nodes) defaults to the executor's folder. Follow the job with
    :func:`wait_result`; the driver's return value is the job's result.
    """
    folder = Path(rendezvous_dir) if rendezvous_dir is not None else Path(executor.folder)
    folder.mkdir(parents=True, exist_ok=True)
    job = RayClusterJob(driver, args, kwargs, config=config, rendezvous_dir=folder)
    return executor.submit(job)
