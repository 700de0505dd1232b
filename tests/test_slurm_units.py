"""pipelines/slurm/ pieces that need no cluster: port layout, Ray command lines, squeue parsing."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.slurm.executor import SqueueFallbackWatcher, gpu_count, make_executor, sbatch_options
from pipelines.slurm.ray_cluster import RayClusterConfig, RayClusterJob
from pipelines.slurm.ray_node import RAY_SOCKET_LIMIT, SlurmLaunchError, _clear_previous_run
from pipelines.slurm.ray_ports import RayPorts


def test_port_layout_from_base() -> None:
    ports = RayPorts.from_base(7000, n_worker_ports=50)
    assert (ports.gcs, ports.node_manager, ports.dashboard) == (7000, 7001, 7007)
    assert (ports.min_worker, ports.max_worker) == (7100, 7149)
    listed = ports.all()
    assert len(listed) == len(set(listed)) == 8 + 50
    assert RayPorts() == RayPorts.from_base(6379)  # the documented default layout
    with pytest.raises(ValueError, match="out of range"):
        RayPorts.from_base(65000)


def test_find_free_ports_are_bindable() -> None:
    ports = RayPorts.find_free(n_worker_ports=16)
    assert ports.gcs >= 20000 and ports.max_worker < 32768  # below the ephemeral range
    for port in ports.all():
        with socket.socket() as s:
            s.bind(("", port))


def test_every_pinned_port_is_on_the_command_line() -> None:
    ports = RayPorts.from_base(9000, n_worker_ports=10)
    head = " ".join(ports.head_args())
    node = " ".join(ports.node_args())
    for name, value in vars(ports).items():
        if name in ("gcs", "dashboard"):
            assert f"={value}" in head and f"={value}" not in node  # head-only services
        else:
            assert f"={value}" in head and f"={value}" in node


def test_ray_cli_knows_every_flag_we_pass() -> None:
    """Guards against a Ray upgrade renaming a `ray start` flag the launcher and the sbatch template use."""
    help_text = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "start", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]+", help_text))
    job = RayClusterJob(print, rendezvous_dir="/tmp", config=RayClusterConfig(object_store_memory=10**8))
    used = {a.split("=")[0] for a in RayPorts().head_args() + job._common_args(Path("/tmp/x"))}
    used |= {"--head", "--address", "--node-ip-address", "--include-dashboard"}
    template = (Path(__file__).resolve().parents[1] / "infra" / "slurm" / "ray_cluster.sbatch").read_text()
    code = "\n".join(ln for ln in template.splitlines() if not ln.lstrip().startswith("#"))
    in_template = set(re.findall(r"(--[a-z][a-z0-9-]+)=", code))
    in_template -= {"--nodes", "--ntasks", "--ntasks-per-node", "--exclude"}  # srun's, not ray's
    assert {"--node-manager-port", "--min-worker-port", "--num-cpus", "--temp-dir"} <= in_template
    assert (used | in_template) - known == set()


def test_long_temp_root_is_refused() -> None:
    job = RayClusterJob(print, rendezvous_dir="/tmp", config=RayClusterConfig(temp_root="/tmp/" + "x" * 60))
    with pytest.raises(SlurmLaunchError, match="too long for unix sockets"):
        job._temp_dir(0)
    ok = RayClusterJob(print, rendezvous_dir="/tmp", config=RayClusterConfig())
    assert len(str(ok._temp_dir(12))) + 70 <= RAY_SOCKET_LIMIT


def test_each_node_has_its_own_temp_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes that share /tmp (the namespace nodes of the local cluster, or a shared scratch) must not share a
    Ray temp dir: `_clear_previous_run` on one would kill the other's Ray."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    job = RayClusterJob(print, rendezvous_dir="/tmp")
    dirs = [job._temp_dir(rank) for rank in range(3)]
    assert [d.name for d in dirs] == ["tcnn-ray-4242", "tcnn-ray-4242-1", "tcnn-ray-4242-2"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_multi_node_job_survives_the_loss_of_a_node(tmp_path: Path, nodes: int) -> None:
    """Several nodes: sbatch and srun get --no-kill, so SLURM ends only the lost node's task, not the job."""
    executor = make_executor(tmp_path, nodes=nodes, cpus_per_node=1)
    text = executor._make_submission_file_text("python -m x", "uid")
    srun = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1
    assert ("#SBATCH --no-kill" in text.splitlines()) == (nodes > 1)
    assert (" --no-kill " in srun[0]) == (nodes > 1)


def test_spawned_ray_processes_ignore_usr2_and_keep_their_pid(tmp_path: Path) -> None:
    """SLURM's time-limit USR2 reaches every process of the step; what ``_spawn`` starts (and its children)
    must ignore it, while ``proc.pid`` stays the command's own pid (``_stop`` signals it)."""
    job = RayClusterJob(print, rendezvous_dir=tmp_path)
    script = (
        "import os, signal, subprocess, sys; "
        "child = subprocess.run([sys.executable, '-c', 'import signal; "
        "print(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)'], capture_output=True, text=True); "
        "print(os.getpid(), signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN, child.stdout.strip())"
    )
    log = tmp_path / "logs" / "spawn.log"
    proc = job._spawn([sys.executable, "-c", script], log)
    assert proc.wait(timeout=60) == 0
    pid, ignored, child_ignored = log.read_text().split()
    assert int(pid) == proc.pid
    assert ignored == child_ignored == "True"
    assert signal.getsignal(signal.SIGUSR2) != signal.SIG_IGN  # the caller's own handling is untouched


def test_previous_run_is_cleared_and_only_it(tmp_path: Path) -> None:
    """A requeued run first kills the processes that still use its temp dir (by path, as `--temp-dir=T` or
    under T/) and removes the dir; a process of another job whose dir merely starts with the same name lives."""
    temp, other = tmp_path / "tcnn-ray-9", tmp_path / "tcnn-ray-90"
    (temp / "session").mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    mine = [subprocess.Popen([*sleep, f"--temp-dir={temp}"]), subprocess.Popen([*sleep, f"{temp}/session/x"])]
    theirs = subprocess.Popen([*sleep, f"--temp-dir={other}"])
    try:
        _clear_previous_run(temp)
        assert [p.wait(timeout=10) for p in mine] == [-signal.SIGKILL] * 2
        assert theirs.poll() is None and not temp.exists()
    finally:
        for p in (*mine, theirs):
            p.kill()
            p.wait()


def test_squeue_output_parsed_like_sacct() -> None:
    watcher = SqueueFallbackWatcher()
    info = watcher._read_squeue(b"12|RUNNING|vm\n13_[1-2]|PENDING|\n14_0|CANCELLED|vm\n")
    assert info["12"]["State"] == "RUNNING" and info["12"]["NodeList"] == "vm"
    assert info["13_1"]["State"] == info["13_2"]["State"] == "PENDING"
    assert info["14_0"]["State"] == "CANCELLED"


def test_site_options_reach_the_sbatch_script(tmp_path: Path) -> None:
    """What a site changes (infra/slurm/README.md): account, constraint, QoS, a GPU type, any sbatch flag."""
    extra = sbatch_options(["account=proj42", "constraint=a100", "qos=high", "exclusive"])
    executor = make_executor(tmp_path, nodes=2, gpus_per_node="a100:4", partition="gpu", additional=extra)
    lines = executor._make_submission_file_text("python -m x", "uid").splitlines()
    for flag in ("--account=proj42", "--constraint=a100", "--qos=high", "--exclusive", "--gpus-per-node=a100:4",
                 "--partition=gpu", "--nodes=2"):  # fmt: skip
        assert f"#SBATCH {flag}" in lines
    assert gpu_count("a100:4") == gpu_count("4") == 4 and gpu_count(0) == 0
    with pytest.raises(ValueError, match="TYPE:COUNT"):
        gpu_count("a100")
    with pytest.raises(ValueError, match="set by tcnn"):
        sbatch_options(["time=5"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        sbatch_options(["account="])


def test_a_job_submitted_before_the_package_still_unpickles() -> None:
    """submitit's job file names the job's callable and its config by their old module path (before
    pipelines/slurm/ was a package): pickle finds each under its old name, and it is the current object."""
    import pickle

    from pipelines.slurm import ray_cluster, ray_ports

    old = {
        b"pipelines.slurm\nRayClusterJob": ray_cluster.RayClusterJob,
        b"pipelines.slurm\nRayClusterConfig": ray_cluster.RayClusterConfig,
        b"pipelines.slurm\nRayPorts": ray_ports.RayPorts,
    }
    for ref, current in old.items():
        assert pickle.loads(b"c" + ref + b"\n.") is current, ref
