"""SIGKILL `dvc repro` in the middle of a stage, run it again: the chain completes and MLflow holds one
parent and exactly one run per stage (the killed one resumed), none left RUNNING."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _pipeline_repo import FMNIST_DIR, STAGES, children, dvc, env, make_repo, runs, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists(),
        reason=f"Fashion-MNIST not installed at {FMNIST_DIR} (Debian package dataset-fashion-mnist)",
    ),
]


def _stage_run_id(repo: Path, stage: str) -> str | None:
    try:
        return json.loads((repo / "runs" / "mlflow_runs.json").read_text())["stages"].get(stage)
    except (OSError, ValueError, KeyError):
        return None


def test_sigkill_mid_stage_then_rerun(tmp_path: Path) -> None:
    # two pretraining epochs: the stage runs long enough after its run opens to be killed inside it
    repo = make_repo(tmp_path / "kill", {"pretrain": {"epochs": 2}, "reparam": {"epoch": 2}})
    log = (tmp_path / "first.log").open("w")
    site = tmp_path / "kill-dvc-site"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro"], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
        env=env(DVC_SITE_CACHE_DIR=str(site)), start_new_session=True,
    )  # fmt: skip
    try:
        killed_id = wait_for(lambda: _stage_run_id(repo, "pretrain"), 600, "the pretrain stage's MLflow run")
        # inside the stage: its run is open and training has started (resume state or epoch output)
        wait_for(lambda: (repo / "runs" / ".partial").exists() or proc.poll() is not None, 120, "training")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        log.close()
    before = runs(repo)
    killed = next(r for r in before if r.info.run_id == killed_id)
    assert killed.info.status == "RUNNING", "the kill did not land inside the stage (the test proves nothing)"
    assert not (repo / "runs" / "pretrain" / "cnn-final.pt").exists()

    out = dvc(repo, "repro")
    assert "Running stage 'pretrain'" in out.stdout
    assert "Stage 'prepare' didn't change, skipping" in out.stdout  # recorded before the kill

    after = runs(repo)
    assert [r.info.run_name for r in after if r.info.status == "RUNNING"] == []
    parents = [r for r in after if r.data.tags.get("tcnn.kind") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    kids = children(after, parents[0].info.run_id)
    assert sorted(r.data.tags["tcnn.stage"] for r in kids) == sorted(STAGES)  # exactly one per stage
    assert {r.info.status for r in kids} == {"FINISHED"}
    pretrain = next(r for r in kids if r.data.tags["tcnn.stage"] == "pretrain")
    assert pretrain.info.run_id == killed_id  # the killed attempt was resumed, not duplicated
    assert pretrain.data.tags["tcnn.attempt"] == "2"
    assert len(after) == 1 + len(STAGES)
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout
