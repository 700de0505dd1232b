"""SLURM launch: submitit executors and a Ray cluster on a SLURM allocation.

Only ``pipelines/`` and ``infra/`` know SLURM (DESIGN section 2). The pieces:

- :func:`make_executor`: a submitit SLURM executor with one task per node (the Ray layout) whose status
  polling falls back to ``squeue`` when ``sacct`` has no accounting database (small or test clusters).
- :class:`RayPorts`: every port a Ray node opens, pinned (``from_base``) or chosen free (``find_free``).
- :class:`RayClusterJob`: the submitit callable. Task 0 (first node) runs
  ``ray start --head --block`` with explicit ``--num-cpus/--num-gpus``, pinned ports and a short per-job
  ``--temp-dir`` (unix socket paths must stay under 107 bytes), writes a rendezvous file with the head's
  address to a shared folder, waits for all nodes to join, then runs the driver function with
  ``ray.init(address=...)`` done and ``RAY_ADDRESS`` set. The other tasks poll the rendezvous file, join with
  ``ray start --address=... --block`` and leave when the head writes its ``done`` marker. Several nodes run
  with ``--no-kill``: a lost worker node ends only its own task (Ray and the driver carry on without it),
  and a lost head node is noticed by the worker tasks, which requeue the job (:func:`requeue_if_head_lost`).
  It is ``Checkpointable``: on the preemption/time-limit signal (USR2) submitit requeues the job and the
  driver runs again from the start, so drivers must resume from their own state (``Tuner.restore``).
- :func:`launch_ray_cluster` submits it; :func:`wait_result` follows the job to its result.

``infra/slurm/ray_cluster.sbatch`` is the plain-sbatch equivalent (srun instead of submitit).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from core.utils.atomic import atomic_write_json

RAY_SOCKET_LIMIT = 107  # bytes in a unix socket path (sun_path)
# <temp>/session_YYYY-MM-DD_HH-MM-SS_ffffff_<pid>/sockets/plasma_store: ~68 bytes after <temp>
_RAY_SOCKET_SUFFIX = 70


class SlurmLaunchError(RuntimeError):
    """The Ray cluster on the allocation could not be brought up (one line, with the log to read)."""


# ------------------------------------------------------------------------------------ submitit plumbing


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


# ------------------------------------------------------------------------------------------ Ray ports


def _port_free(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RayPorts:
    """Every port a Ray node listens on. Head-only: ``gcs``, ``dashboard``."""

    gcs: int = 6379
    node_manager: int = 6380
    object_manager: int = 6381
    runtime_env_agent: int = 6382
    metrics_export: int = 6383
    dashboard_agent_listen: int = 6384
    dashboard_agent_grpc: int = 6385
    dashboard: int = 6386
    min_worker: int = 6479
    max_worker: int = 7478

    @classmethod
    def from_base(cls, base: int, n_worker_ports: int = 1000) -> RayPorts:
        """``base`` .. ``base+7`` for the services, ``base+100`` .. for worker processes."""
        if base < 1024 or base + 100 + n_worker_ports > 65535:
            raise ValueError(f"RayPorts.from_base: base {base} out of range")
        return cls(*range(base, base + 8), base + 100, base + 99 + n_worker_ports)

    @classmethod
    def find_free(cls, n_worker_ports: int = 64, *, low: int = 20000, high: int = 32000) -> RayPorts:
        """A ``from_base`` layout whose ports are all free on this host now (for tests and one-node runs).

        The default range stays below Linux's ephemeral ports (32768+) so that no outgoing connection takes
        one of them between this check and ``ray start``."""
        rng = random.Random()
        for _ in range(200):
            base = rng.randrange(low, high - 100 - n_worker_ports)
            ports = cls.from_base(base, n_worker_ports)
            if all(_port_free(p) for p in ports.all()):
                return ports
        raise RuntimeError(f"RayPorts.find_free: no free port block in {low}..{high}")

    def all(self) -> list[int]:
        return [*asdict(self).values()][:-2] + list(range(self.min_worker, self.max_worker + 1))

    def node_args(self) -> list[str]:
        return [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]

    def head_args(self) -> list[str]:
        return [f"--port={self.gcs}", f"--dashboard-port={self.dashboard}", *self.node_args()]


# --------------------------------------------------------------------------------------- the cluster


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
        while not done.exists():
            gone = proc.poll() is not None
            if gone or time.monotonic() >= next_check:
                next_check = time.monotonic() + self.config.head_check_s
                if not done.exists() and not _answers(host, int(port)):
                    if requeue_if_head_lost(info.get("head_node"), done):
                        return
                elif gone and not done.exists():
                    raise SlurmLaunchError(failure)
            time.sleep(1.0)


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
