"""One writer per workspace (a second is refused, a dead holder's lock taken over), and a new MLflow store that
survives concurrent first use."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from _train_helpers import (
    REPO,
    stage_env,
    stderr_lines,
    tracked_runs,
    tracked_workspace,
)


def test_a_second_writer_on_a_workspace_is_refused_and_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    ws = tracked_workspace(tmp_path, n_test=20)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from core.utils.workspace import workspace_lock\n"
         "with workspace_lock(sys.argv[1], 'a test holder'):\n    print('held', flush=True); time.sleep(300)", str(ws)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "-m", "stages.prepare"], cwd=ws, env=stage_env(TCNN_TRACKING="1"),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 2
        lines = stderr_lines(proc.stderr)
        assert len(lines) == 1 and f"pid {holder.pid} on {socket.gethostname()}" in lines[0], proc.stderr
        assert "a test holder" in lines[0] and tracked_runs(ws) == []
    finally:
        holder.kill()  # SIGKILL: the kernel releases its lock
        holder.wait()
    proc = subprocess.run([sys.executable, "-m", "stages.corrupt"], cwd=ws, env=stage_env(TCNN_TRACKING="0"),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_a_new_mlflow_store_survives_four_processes_at_once(tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
        "from stages.tracking.tracker import Tracker\n"
        "t = Tracker(uri='sqlite:///' + sys.argv[1], experiment='e')\n"
        "t.start_parent('p'); t.end_parent()\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "new.db"), str(go)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]  # fmt: skip
    time.sleep(4)  # every process imported MLflow and waits
    go.touch()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errs
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'new.db'}")
    exp = client.get_experiment_by_name("e")
    assert len(client.search_runs([exp.experiment_id])) == 4
