"""Exact resume of the stage processes: SIGKILL at random moments, SIGTERM, then rerun to the end.

A run killed (possibly several times, possibly while writing a checkpoint) and rerun must end bitwise equal
on CPU to a run never interrupted: every tensor of every output checkpoint (weights, optimizer state, RNG
states) and every metric except timings.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from _train_helpers import (
    assert_same_outputs,
    run_stage,
    stage_cmd,
    stage_env,
    tiny_params,
    write_dataset,
    write_params,
)

from core.training.checkpoint import load
from core.training.resume_file import RESUME_FILE
from core.training.stop_signals import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

ENV = {"TCNN_CHECKPOINT_EVERY_STEPS": "2"}


def _params(tmp: Path, data: Path, mode: str) -> Path:
    raw = tiny_params(
        data,
        pretrain={"epochs": 2, "augment": {"label_smoothing": 0.1}},
        reparam={"epoch": 1},
        finetune={"mode": mode, "epochs": 2, "drop_path": 0.2, "augment": {"mixup": 0.2, "crop_padding": 2}},
    )
    return write_params(tmp / f"params-{mode}.yaml", raw)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A reference pretraining + reparam run (never interrupted) and the params files."""
    tmp = tmp_path_factory.mktemp("resume")
    data = write_dataset(tmp / "data")
    files = {mode: _params(tmp, data, mode) for mode in ("fresh", "continue")}
    ref = tmp / "ref"
    ref.mkdir()
    for stage in ("pretrain", "reparam"):
        done = run_stage(stage, files["fresh"], ref, **ENV)
        assert done.returncode == 0, done.stderr
    return {"tmp": tmp, "ref": ref, **files}


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _kill_at_random_moments(stage: str, params: Path, root: Path, rng: random.Random, kills: int) -> int:
    """Start the stage `kills` times and SIGKILL it at a random moment after it made progress (a fresh
    resume checkpoint); returns how many kills landed (ended the attempt with -9, not a finish first). An
    early kill may come too late (the run finishes, or it lands while outputs are being published). The last
    kill comes right after a fresh resume checkpoint of a run still training, so the rerun that follows always
    has in-progress state to resume from: if that attempt finishes first, the outputs go and it starts over."""
    resume = root / "runs" / ".partial" / stage / RESUME_FILE
    landed = 0
    for i in range(kills):
        last = i == kills - 1
        for _ in range(3 if last else 1):
            before = _mtime(resume)
            proc = subprocess.Popen(stage_cmd(stage, params), cwd=root, env=stage_env(**ENV),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            deadline = time.monotonic() + 300
            while _mtime(resume) in (before, None) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.0 if last else rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            killed = proc.wait() == -signal.SIGKILL
            landed += killed
            if not last or (killed and resume.exists()):
                break
            # finished first: drop its outputs so the next attempt trains from scratch
            shutil.rmtree(root / "runs" / stage, ignore_errors=True)
            shutil.rmtree(resume.parent, ignore_errors=True)
    assert resume.exists(), "the last kill did not land; the rerun would not resume"
    return landed


def test_pretrain_killed_at_random_moments_resumes_bitwise(base, tmp_path) -> None:
    landed = _kill_at_random_moments("pretrain", base["fresh"], tmp_path, random.Random(1), kills=3)
    assert landed >= 1, "no kill landed before the run ended; the test would prove nothing"
    done = run_stage("pretrain", base["fresh"], tmp_path, **ENV)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stderr
    assert not (tmp_path / "runs" / ".partial").exists()
    assert_same_outputs(tmp_path / "runs" / "pretrain", base["ref"] / "runs" / "pretrain")


@pytest.mark.parametrize("mode", ["fresh", "continue"])
def test_finetune_killed_at_random_moments_resumes_bitwise(base, tmp_path, mode) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    for root in (ref, run):
        for stage in ("pretrain", "reparam"):
            shutil.copytree(base["ref"] / "runs" / stage, root / "runs" / stage)
    done = run_stage("finetune", base[mode], ref, **ENV)
    assert done.returncode == 0, done.stderr
    landed = _kill_at_random_moments("finetune", base[mode], run, random.Random(2), kills=3)
    assert landed >= 1, "no kill landed before the run ended; the test would prove nothing"
    done = run_stage("finetune", base[mode], run, **ENV)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stderr
    assert_same_outputs(run / "runs" / "finetune", ref / "runs" / "finetune")


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(base, tmp_path) -> None:
    resume = tmp_path / "runs" / ".partial" / "pretrain" / RESUME_FILE
    proc = subprocess.Popen(stage_cmd("pretrain", base["fresh"]), cwd=tmp_path, env=stage_env(**ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not resume.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "pretrain: stopped by SIGTERM" in err and "run the same command again to resume" in err
    state = load(resume)
    assert 0 < state["global_step"] < 20
    assert not (tmp_path / "runs" / "pretrain").exists()  # nothing published from an unfinished run
    done = run_stage("pretrain", base["fresh"], tmp_path, **ENV)
    assert done.returncode == 0 and "resuming from" in done.stderr, done.stderr
    assert_same_outputs(tmp_path / "runs" / "pretrain", base["ref"] / "runs" / "pretrain")


def test_changed_params_start_fresh_and_say_so(base, tmp_path) -> None:
    resume = tmp_path / "runs" / ".partial" / "pretrain" / RESUME_FILE
    proc = subprocess.Popen(stage_cmd("pretrain", base["fresh"]), cwd=tmp_path, env=stage_env(**ENV),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while not resume.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    other = tmp_path / "other.yaml"
    raw = yaml.safe_load(base["fresh"].read_text())
    raw["pretrain"]["lr"] = 0.04
    write_params(other, raw)
    done = run_stage("pretrain", other, tmp_path, **ENV)
    assert done.returncode == 0, done.stderr
    assert "belongs to other params or inputs; starting fresh" in done.stderr
