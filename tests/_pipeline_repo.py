"""A throw-away copy of the repository with a tiny params.yaml, for the end-to-end `dvc repro` tests.

The copy holds the files git knows here (tracked + untracked-not-ignored, as they are in the working tree),
is a git repository with one commit (the parent run's git tag, `dvc exp run`) and a DVC project; the stages
run with this interpreter's environment, MLflow tracking on (sqlite store inside the copy) and system
metrics sampled every second. Nothing is written outside the copy (DVC's site cache is redirected too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from filelock import FileLock

from stages.tracking.store import store_client

REPO = Path(__file__).resolve().parents[1]
STAGES = ("prepare", "pretrain", "reparam", "finetune", "control", "corrupt", "evaluate", "report")
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

#: A chain of about a minute on 2 cores: 1% of Fashion-MNIST's training images (550), one pretraining and
#: one fine-tuning epoch, the smoke size's cap of 300 test images (data.limit: what the chain tests check --
#: which stages run and rerun, the runs, the files, the refusals -- does not depend on the size), 2
#: corruptions x 2 severities of 50 of them.
TINY: dict[str, Any] = {
    "data": {"sample_fraction": 0.01, "val_size": 100, "fraction_scales_epochs": False, "limit": {"test": 300}},
    "pretrain": {"epochs": 1, "batch_size": 50, "lr": 0.05, "warmup_epochs": 0.2, "checkpoint_every_steps": 0},
    "reparam": {"epoch": 1},
    "finetune": {"epochs": 1, "batch_size": 50, "lr": 0.004, "warmup_epochs": 0.2, "checkpoint_every_steps": 0},
    "robustness": {"n_images": 50, "corruptions": ["gaussian_noise", "contrast"], "severities": [1, 2],
                   "batch_size": 50, "workers": 1, "bootstrap": 200},
    "tracking": {"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "tcnn"},
}  # fmt: skip


#: Not copied: the suites, and a previous run's outputs in this checkout (its lock and the git-tracked metrics):
#: the copy starts from code and params only.
NOT_COPIED = ("tests/", "benchmarks/", "runs/", "results/", "dvc.lock")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def env(**extra: str) -> dict[str, str]:
    """The environment of `dvc` in the copy: this venv first on PATH, tracking on, no inherited parent run."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TCNN_", "DVC_", "MLFLOW_"))}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["VIRTUAL_ENV"] = sys.prefix  # as an activated venv: scripts/stage (dvc.yaml's commands) runs this one
    e.update(
        TCNN_TRACKING="1",
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1",
        DVC_NO_ANALYTICS="1",
        PYTHONUNBUFFERED="1",
    )
    e.update(extra)
    return e


def run(cmd: list[str], cwd: Path, *, check: bool = True, timeout: float = 900, **kw: Any):
    """Run a command in the copy; on failure the assertion message carries its output."""
    out = subprocess.run(cmd, cwd=cwd, env=kw.pop("env", None) or env(), capture_output=True, text=True,
                         timeout=timeout, **kw)  # fmt: skip
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def make_repo(dest: Path, overrides: dict[str, Any] | None = None) -> Path:
    """Copy the repository into `dest` (git + DVC initialised, one commit) with the tiny params."""
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not rel.startswith(NOT_COPIED):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    (dest / "params.yaml").write_text(
        yaml.safe_dump(_merge(_merge(raw, TINY), overrides or {}), sort_keys=False)
    )
    site = dest.parent / f"{dest.name}-dvc-site"
    e = env(DVC_SITE_CACHE_DIR=str(site))
    git = [
        "git",
        "-c",
        "user.name=tcnn-test",
        "-c",
        "user.email=test@tcnn.invalid",
        "-c",
        "commit.gpgsign=false",
    ]
    run(["git", "init", "-q", "-b", "main"], dest, env=e)
    if not (dest / ".dvc").is_dir():  # the repository's own .dvc/ is tracked: the copy is a DVC project
        run([sys.executable, "-m", "dvc", "init", "-q"], dest, env=e)
    run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], dest, env=e)
    run(["git", "add", "-A"], dest, env=e)
    run([*git, "commit", "-q", "-m", "tiny pipeline"], dest, env=e)
    return dest


def dvc(repo: Path, *args: str, check: bool = True, timeout: float = 900, **extra_env: str):
    site = repo.parent / f"{repo.name}-dvc-site"
    return run([sys.executable, "-m", "dvc", *args], repo, check=check, timeout=timeout,
               env=env(DVC_SITE_CACHE_DIR=str(site), **extra_env))  # fmt: skip


def client(repo: Path):
    return store_client(f"sqlite:///{repo / 'mlruns.db'}")


def runs(repo: Path, experiment: str = "tcnn") -> list[Any]:
    """Every run of the experiment, oldest first."""
    c = client(repo)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {repo / 'mlruns.db'}"
    return list(c.search_runs([exp.experiment_id], max_results=1000, order_by=["attributes.start_time ASC"]))


def children(all_runs: list[Any], parent_id: str) -> list[Any]:
    return [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent_id]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The temp dir every process of this pytest run sees: the run's own under pytest-xdist (its workers'
    temp dirs sit inside it), else this process's."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_repo(factory: pytest.TempPathFactory, name: str = "e2e") -> Path:
    """One tiny repository with a finished `dvc repro`, built once per pytest run and shared by the
    end-to-end, DVC and UI tests: the first process that needs it builds it (under a file lock, in the run's
    shared temp dir); under pytest-xdist every other worker waits for it and works on its own copy."""
    root = shared_root(factory)
    repo, done = root / "pipeline" / name, root / "pipeline" / f"{name}.built"
    repo.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "pipeline" / f"{name}.lock")):
        if not done.exists():
            make_repo(repo)
            out = dvc(repo, "repro")
            (root / "pipeline" / f"{name}-repro.log").write_text(out.stdout + out.stderr)
            done.touch()
    if root == factory.getbasetemp():
        return repo
    mine = factory.getbasetemp() / "pipeline" / name
    if not mine.exists():
        shutil.copytree(repo, mine, symlinks=True)
    return mine
