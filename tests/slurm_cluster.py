"""Session fixture: a real single-node SLURM cluster (infra/slurm/local_cluster.sh) for `@pytest.mark.slurm` tests,
and :func:`start_cluster` ``(nodes=N)`` for a multi-node one (N slurmd, each in its own network namespace).

Import the fixture in tests/conftest.py (``from slurm_cluster import slurm_cluster  # noqa: F401``).

The cluster is started once (idempotent: an already running one is reused, also across pytest sessions and
by concurrent sessions). At the end of the pytest run (the xdist controller's session finish, after every
worker's tests: tests/conftest.py) :func:`stop_started_clusters` stops each cluster this run started (a marker
in its state folder names the run, :data:`SESSION_ENV`) and says so; a cluster it found running, one with jobs
still queued (another session's), or any with ``TCNN_KEEP_CLUSTER=1`` is left running, and the run says how to
stop it (``infra/slurm/local_cluster.sh stop``). ``SLURM_CONF`` of the one-node cluster is exported into
``os.environ`` for the session so sbatch/srun/squeue and submitit (in this process and in subprocesses) talk
to it; a multi-node cluster is only reached through its own ``SlurmCluster.env`` (``SLURM_CONF``), so the
one-node tests never land on it. Its state lives next to the one-node cluster's (``<TCNN_SLURM_DIR>-<N>n``),
with its own slurmctld port (``TCNN_SLURM_CTLD_PORT`` + 10 (N-1)), test network (``10.77.N``; the first two
octets from ``TCNN_SLURM_NET``) and namespace names (``<TCNN_SLURM_NETNS>Nn``).

Skips, with the reason, only where it cannot work: slurm-wlm/munge not installed, or not root and no cluster
running. ``TCNN_REQUIRE_SLURM=1`` turns those skips into failures (for CI, which runs as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.slurm.ray_node import _tail

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "infra" / "slurm" / "local_cluster.sh"
STATE_DIR = Path(os.environ.get("TCNN_SLURM_DIR", "/tmp/tcnn-slurm"))
#: The pytest run's id, set by its first process (the xdist controller, or pytest alone) and inherited by its
#: workers: a cluster started under it gets a marker (:data:`STARTED_BY`) naming it.
SESSION_ENV = "TCNN_TEST_SESSION"
#: ``TCNN_KEEP_CLUSTER=1``: leave the clusters this run started running at its end.
KEEP_ENV = "TCNN_KEEP_CLUSTER"
STARTED_BY = "started-by-pytest"  # in <state dir>/run/: the id of the pytest run that started the cluster


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path  # slurm.conf (exported as SLURM_CONF)
    partition: str
    node: str  # the first node
    cpus: int  # CPUs of the first node
    start_s: float  # seconds `local_cluster.sh start` took (0 when it was already up)
    nodes: tuple[str, ...] = ()  # every node, in order
    script_env: tuple[tuple[str, str], ...] = ()  # TCNN_SLURM_* settings of local_cluster.sh for this cluster
    gateway: str = "127.0.0.1"  # this host's address as the nodes see it (multi-node: the bridge)

    @property
    def settings(self) -> dict[str, str]:
        """What points a process at this cluster: SLURM_CONF and the local_cluster.sh settings."""
        return {**dict(self.script_env), "SLURM_CONF": str(self.conf)}

    @property
    def env(self) -> dict[str, str]:
        """os.environ with :attr:`settings` (for clients, submitit and `tcnn sweep` subprocesses)."""
        return {**os.environ, **self.settings}

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def script(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``infra/slurm/local_cluster.sh ARGS`` for this cluster."""
        return subprocess.run(
            [str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def job_field(self, job_id: str, name: str) -> str | None:
        """One field of `scontrol show job` (e.g. JobState, Restarts); None once the job is gone."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False).stdout
        for item in out.split():
            if item.startswith(f"{name}="):
                return item.split("=", 1)[1]
        return None

    def diagnose(self, job_id: str, log_dir: Path | None = None, lines: int = 30) -> str:
        """What a failed multi-node test needs to say about ``job_id``: node states, the job's state and nodes,
        its steps, slurmctld's log lines about it and the tails of its submitit logs."""
        fields = [self.job_field(job_id, k) for k in ("JobState", "NodeList", "Restarts")]
        steps = self.run(
            "squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %N %M", check=False
        ).stdout.strip()
        log = Path(self.settings.get("TCNN_SLURM_DIR", str(STATE_DIR))) / "log" / "slurmctld.log"
        ctld = [line for line in _tail(log, 4000).splitlines() if str(job_id) in line][-lines:]
        return (
            f"states {self.node_states()}; job [state, nodes, restarts] {fields}; steps: {steps or 'none'}"
            f"\n--- slurmctld.log on job {job_id}\n" + "\n".join(ctld) + _log_tails(log_dir, job_id, lines)
        )

    def release_requeued(self, job_id: str, timeout: float = 150, log_dir: Path | None = None) -> None:
        """SLURM holds a requeued job for ~2 minutes (Reason=BeginTime); make it eligible now (tests only).

        Call it right after triggering the requeue; returns once the job has left the queue again. A job that
        ends instead of being requeued fails at once; the tails of its submitit logs in ``log_dir`` (if given)
        go into the error.
        """
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        pending_seen = False
        pending_since = 0.0
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            restarts = int(self.job_field(job_id, "Restarts") or 0)
            if state is not None and (not seen or seen[-1] != f"{state}/{restarts}"):
                seen.append(f"{state}/{restarts}")
            if state == "PENDING" and restarts > 0:  # a requeued job waiting for its begin time
                if not pending_seen:
                    pending_seen, pending_since = True, time.monotonic()
                # slurmd rejects a restart in the same second as the kill revoked the old credential ("Job
                # credential revoked": its times have 1 s resolution), which ends the job: wait 2 s first
                if time.monotonic() - pending_since < 2.0:
                    time.sleep(0.25)
                    continue
                res = self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
                if res.returncode != 0 and f"update: {res.stderr.strip()}" not in seen:
                    seen.append(f"update: {res.stderr.strip()}")
            elif pending_seen and state not in (None, "PENDING"):
                return
            elif not pending_seen and restarts == 0 and state in _ENDED:
                break  # it ended without a requeue: nothing more will happen
            time.sleep(0.25)
        raise TimeoutError(
            f"job {job_id} was not requeued and restarted within {timeout}s (states {seen})"
            + _log_tails(log_dir, job_id)
        )


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _log_tails(log_dir: Path | None, job_id: str, lines: int = 40) -> str:
    """The last ``lines`` lines of each submitit log of ``job_id`` in ``log_dir`` ('' without a dir)."""
    if log_dir is None:
        return ""
    parts = [
        f"\n--- {log.name}\n{_tail(log, lines)}" for log in sorted(Path(log_dir).glob(f"{job_id}_*_log.*"))
    ]
    return "".join(parts) or f"\n(no submitit logs of job {job_id} in {log_dir})"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("TCNN_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM test cluster required (TCNN_REQUIRE_SLURM=1) but {reason}")
    pytest.skip(reason)


def cluster_settings(nodes: int) -> dict[str, str]:
    """The local_cluster.sh settings of the ``nodes``-node test cluster (module docstring)."""
    if nodes == 1:
        return {"TCNN_SLURM_DIR": str(STATE_DIR)}
    port = int(os.environ.get("TCNN_SLURM_CTLD_PORT", "6817")) + 10 * (nodes - 1)
    net = ".".join(os.environ.get("TCNN_SLURM_NET", "10.77.0").split(".")[:2])
    return {
        "TCNN_SLURM_DIR": f"{STATE_DIR}-{nodes}n",
        "TCNN_SLURM_NODES": str(nodes),
        "TCNN_SLURM_CTLD_PORT": str(port),
        "TCNN_SLURM_NET": f"{net}.{nodes}",
        "TCNN_SLURM_NETNS": f"{os.environ.get('TCNN_SLURM_NETNS', 'tcnn')[:6]}{nodes}n",
    }


def start_cluster(nodes: int = 1) -> SlurmCluster:
    """Start (or reuse) the local cluster of ``nodes`` nodes; skip the requesting tests where that cannot work."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None]
    if missing:
        _skip_or_fail(
            f"slurm-wlm/munge not installed (missing {', '.join(missing)}; scripts/setup.sh --test)"
        )
    settings = cluster_settings(nodes)
    conf = Path(settings["TCNN_SLURM_DIR"]) / "slurm.conf"
    env = {**os.environ, **settings}
    if os.geteuid() != 0:
        status = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True)
        if status.returncode != 0:
            _skip_or_fail("the local SLURM cluster is not running and starting it needs root")
        took = 0.0
    else:
        t0 = time.monotonic()
        res = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
        if res.returncode != 0:  # as root this is a real failure, not a skip
            pytest.fail(f"infra/slurm/local_cluster.sh start failed:\n{res.stderr[-3000:]}")
        if "already running" in res.stderr:
            took = 0.0
        elif session := os.environ.get(SESSION_ENV):  # this run started it: stopped at its end
            (Path(settings["TCNN_SLURM_DIR"]) / "run" / STARTED_BY).write_text(session)
    if nodes == 1:
        os.environ["SLURM_CONF"] = str(conf)
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%P|%N|%c|%T"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("|") for line in out.splitlines()]
    partition, node, cpus, _state = rows[0]
    return SlurmCluster(
        conf=conf,
        partition=partition.rstrip("*"),
        node=node,
        cpus=int(cpus),
        start_s=took,
        nodes=tuple(sorted({r[1] for r in rows})),
        script_env=tuple(settings.items()),
        gateway=f"{settings['TCNN_SLURM_NET']}.1" if nodes > 1 else "127.0.0.1",
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The running local SLURM cluster (session-scoped; left running at the end, see the module docstring)."""
    return start_cluster()


def _stop_one(nodes: int, keep: bool) -> str:
    """Stop the ``nodes``-node cluster (or say why it stays up); one line."""
    settings = cluster_settings(nodes)
    where = settings["TCNN_SLURM_DIR"]
    env = {**os.environ, **settings, "SLURM_CONF": f"{where}/slurm.conf"}
    stop = f"sudo -E env {' '.join(f'{k}={v}' for k, v in settings.items())} {SCRIPT.relative_to(REPO)} stop"
    if keep:
        return f"left running ({KEEP_ENV}=1): the {nodes}-node test cluster in {where}; stop it with `{stop}`"
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=60)
    if queued.stdout.strip():
        jobs = " ".join(queued.stdout.split())
        return f"left running: the {nodes}-node test cluster in {where} still holds jobs ({jobs}); stop it with `{stop}`"
    res = subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=300)
    (Path(where) / "run" / STARTED_BY).unlink(missing_ok=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["no message"])[-1]
        return f"could not stop the {nodes}-node test cluster in {where}: {why}"
    return f"stopped the {nodes}-node test cluster this run started ({where}: slurmctld, slurmd, munged if it started it)"


def stop_started_clusters(session: str) -> list[str]:
    """At the end of the pytest run ``session``: stop every test cluster it started (module docstring), the
    multi-node ones first (the one-node cluster's munged may serve them); one line per cluster it started."""
    found = []
    for state in [*sorted(STATE_DIR.parent.glob(f"{STATE_DIR.name}-*n")), STATE_DIR]:
        marker = state / "run" / STARTED_BY
        if marker.is_file() and marker.read_text().strip() == session:
            found.append(1 if state == STATE_DIR else int(state.name.rsplit("-", 1)[1].removesuffix("n")))
    keep = os.environ.get(KEEP_ENV) == "1"
    return [_stop_one(n, keep) for n in found]
