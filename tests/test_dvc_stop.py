"""A stage dies with the `dvc repro` that started it: SIGTERM to DVC alone (not its process group)
ends DVC at once; the stage finds its DVC ancestor gone, stops itself as a stop signal would, closes its MLflow
runs KILLED and exits 75, instead of running on for a `dvc.lock` nobody records. The real harness
(stages.harness.runner.stage_main) around a run that waits, under a real `dvc repro` in a tiny DVC project."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import yaml
from _train_helpers import repo_pythonpath, stage_env, tiny_params, write_params

from stages.harness.parent_watch import dvc_ancestor
from stages.tracking.store import store_client

STAGE = textwrap.dedent(
    """
    import pathlib, sys, time
    from stages.harness.runner import stage_main

    def run(params):
        pathlib.Path("started").write_text(str(__import__("os").getpid()))
        time.sleep(120)
        pathlib.Path("out.txt").write_text("finished")

    sys.exit(stage_main("prepare", run, sys.argv[1:]))
    """
)


def _statuses(ws: Path) -> list[str]:
    client = store_client(f"sqlite:///{ws / 'mlruns.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return sorted(r.info.status for r in client.search_runs(exps))


def test_outside_dvc_there_is_no_dvc_ancestor() -> None:
    assert dvc_ancestor() is None  # pytest's own process tree holds no DVC


def test_sigterm_to_dvc_repro_ends_its_stage_and_closes_its_runs_killed(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    raw = tiny_params(
        ws / "data", tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "t"}
    )
    write_params(ws / "params.yaml", raw)
    (ws / "stage.py").write_text(STAGE)
    stage = {"cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "outs": ["out.txt"]}
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"wait": stage}}))
    env = stage_env(TCNN_TRACKING="1", PYTHONPATH=repo_pythonpath())
    subprocess.run(
        [sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=ws, env=env, check=True, timeout=120
    )
    log = (tmp_path / "dvc.log").open("w")
    dvc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=ws, env=env, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (ws / "started").exists():
            assert dvc.poll() is None and time.monotonic() < deadline, (tmp_path / "dvc.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        stage_proc = psutil.Process(int((ws / "started").read_text()))
        os.kill(dvc.pid, signal.SIGTERM)  # DVC alone, as `kill <pid>` does
        dvc.wait(60)
        t0 = time.monotonic()
        code = stage_proc.wait(60)  # ends within a poll or two, not after its 120 s
        assert time.monotonic() - t0 < 30
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dvc.pid, signal.SIGKILL)
        log.close()
    assert code is None or code == 75  # psutil returns None for a process that is not its child
    assert "prepare: stopped by SIGTERM" in (tmp_path / "dvc.log").read_text()  # the stage's own line
    assert not (ws / "out.txt").exists()
    assert _statuses(ws) == ["KILLED", "KILLED"]  # the parent and the stage's run
