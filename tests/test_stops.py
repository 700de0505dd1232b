"""A stage that is stopped, or refused, ends cleanly: a stop signal anywhere in a stage process (importing, outside
the training loop) closes its MLflow runs with the right status, ends its workers and exits 75 (130 for Ctrl-C)
with one line; a superseded parent closes its children; what can be checked before compute is checked before
any run opens."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _train_helpers import (
    stage_env,
    stderr_lines,
    tracked_runs,
    tracked_workspace,
)


def _cmdline(proc: psutil.Process) -> str | None:
    """The process's command line, or None once it has exited: a child listed a moment ago may be gone by the
    time its /proc entry is read (a short-lived helper process, or a pool worker that finished)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return None


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 75), (signal.SIGINT, 130), (signal.SIGHUP, 75)])
def test_a_stop_signal_outside_the_training_loop_ends_everything(
    tmp_path: Path, sig: int, status: int
) -> None:
    """stages.corrupt stopped while its process pool works: exit 75 / 130, one line and no traceback, its pool
    workers gone, its MLflow child and the parent KILLED."""
    ws = tracked_workspace(tmp_path)
    env = stage_env(TCNN_TRACKING="1")
    proc = subprocess.Popen([sys.executable, "-m", "stages.corrupt"], cwd=ws, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    me = psutil.Process(proc.pid)
    workers: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        running = {c: _cmdline(c) for c in me.children(recursive=True)}
        workers = [c for c, cmd in running.items() if cmd is not None and "resource_tracker" not in cmd]
        if len(workers) >= 2:
            break
        time.sleep(0.2)
    assert len(workers) >= 2, "the corrupt stage never started its pool"
    time.sleep(1.0)
    everyone = me.children(recursive=True)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    lines = stderr_lines(err)
    assert "Traceback" not in err and lines[-1].startswith(f"corrupt: stopped by {signal.Signals(sig).name}")
    gone, alive = psutil.wait_procs(everyone, timeout=15)
    assert not alive, f"left running: {[_cmdline(p) for p in alive]}"
    runs = {r.data.tags.get("tcnn.kind"): r.info.status for r in tracked_runs(ws)}
    assert runs == {"parent": "KILLED", "stage": "KILLED"}


def test_a_superseded_parent_closes_its_children(tmp_path: Path) -> None:
    from stages.tracking.tracker import Tracker

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    old = Tracker(uri=uri, experiment="t")
    old.start_parent("a", key="ws", params={"lr": 1})
    old.start_child("pretrain")  # left RUNNING, as by a SIGKILLed process
    child, parent = old.run_id, old.parent_run_id
    new = Tracker(uri=uri, experiment="t")
    new.start_parent("b", key="ws", params={"lr": 2})  # other params: the old chain is superseded
    assert new.parent_run_id != parent
    assert new.client.get_run(child).info.status == "FAILED"
    assert new.client.get_run(parent).info.status == "FAILED"


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_signal_while_a_stage_imports_is_one_line(tmp_path: Path, sig: int, status: int) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "stages.evaluate"], cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True, env=stage_env())  # fmt: skip
    time.sleep(0.3)  # importing torch, MLflow and the rest takes seconds
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status
    assert (
        err.strip() == f"evaluate: stopped by {signal.Signals(sig).name} while starting; nothing was written"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_value_that_fails_at_run_time_is_refused_before_any_run_opens(tmp_path: Path) -> None:
    ws = tracked_workspace(tmp_path, n_test=50)
    proc = subprocess.run([sys.executable, "-m", "stages.corrupt", "-S", "robustness.n_images=20000"], cwd=ws,
                          env=stage_env(TCNN_TRACKING="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert stderr_lines(proc.stderr) == [
        f"corrupt: error: robustness.n_images: 20000 exceeds the 50 test images of {ws / 'data'}"
    ]
    assert tracked_runs(ws) == [] and not (ws / "c").exists()


def test_missing_baseline_file_is_reported_before_evaluation(tmp_path: Path) -> None:
    ws = tracked_workspace(tmp_path, n_test=50)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stages.evaluate", "-S", "robustness.baseline=nowhere.json"],
                          cwd=ws, env=stage_env(TCNN_TRACKING="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and time.monotonic() - t0 < 60
    assert stderr_lines(proc.stderr) == [
        "evaluate: error: robustness.baseline: nowhere.json: baseline file not found"
    ]
    assert tracked_runs(ws) == []
