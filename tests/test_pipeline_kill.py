"""SIGKILL `dvc repro` in the middle of pretraining, after a resume point exists, and run it again: the stage
resumes (and says so), its outputs equal those of an unbroken run bitwise, and MLflow holds one parent and
exactly one run per stage that ran (the killed one resumed), none left RUNNING. The rerun stops after
pretraining: the chain's later stages are the same whether or not pretraining was resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _pipeline_repo import FMNIST_DIR, children, dvc, env, make_repo, runs, wait_for
from _train_helpers import assert_same_outputs

from core.training.resume_file import RESUME_FILE

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


#: Three pretraining epochs of 11 steps with a resume point every 4 steps: the first comes early, and the stage
#: trains on for more than two epochs after it, so the kill lands inside the stage.
KILL = {"pretrain": {"epochs": 3, "checkpoint_every_steps": 4}, "reparam": {"epoch": 2}}


def test_sigkill_mid_stage_then_rerun(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "kill", KILL)
    resume = repo / "runs" / ".partial" / "pretrain" / RESUME_FILE
    log = (tmp_path / "first.log").open("w")
    site = tmp_path / "kill-dvc-site"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro"], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
        env=env(DVC_SITE_CACHE_DIR=str(site)), start_new_session=True,
    )  # fmt: skip
    try:
        killed_id = wait_for(lambda: _stage_run_id(repo, "pretrain"), 600, "the pretrain stage's MLflow run")
        # inside the stage, after its first resume point (a step-level checkpoint of the running epoch)
        wait_for(lambda: resume.exists() or proc.poll() is not None, 300, "a resume point")
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
    assert resume.exists(), "no resume point when the kill landed (the rerun would train from scratch)"

    out = dvc(repo, "repro", "pretrain")
    assert "Running stage 'pretrain'" in out.stdout
    assert "Stage 'prepare' didn't change, skipping" in out.stdout  # recorded before the kill
    said = out.stdout + out.stderr
    assert f"pretrain: resuming from {resume.relative_to(repo)}" in said  # not trained from scratch

    # bitwise the run that was never interrupted: the same params and code in a fresh copy
    unbroken = make_repo(tmp_path / "unbroken", KILL)
    dvc(unbroken, "repro", "pretrain")
    assert_same_outputs(repo / "runs" / "pretrain", unbroken / "runs" / "pretrain")

    after = runs(repo)
    assert [r.info.run_name for r in after if r.info.status == "RUNNING"] == []
    parents = [r for r in after if r.data.tags.get("tcnn.kind") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    kids = children(after, parents[0].info.run_id)
    assert sorted(r.data.tags["tcnn.stage"] for r in kids) == ["prepare", "pretrain"]  # exactly one per stage
    assert {r.info.status for r in kids} == {"FINISHED"}
    pretrain = next(r for r in kids if r.data.tags["tcnn.stage"] == "pretrain")
    assert pretrain.info.run_id == killed_id  # the killed attempt was resumed, not duplicated
    assert pretrain.data.tags["tcnn.attempt"] == "2"
    assert len(after) == 1 + 2
    # prepare and pretrain recorded; the rest still to run
    status = json.loads(dvc(repo, "status", "--json").stdout)
    assert "prepare" not in status and "pretrain" not in status and "reparam" in status
