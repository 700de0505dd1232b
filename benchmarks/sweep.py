"""Shared pretraining vs a naive grid: wall time and pretraining runs of `tcnn sweep` (issue 7).

    .venv/bin/python benchmarks/sweep.py [--workdir DIR] [--naive-trials 9|27] [--n-train 2500] [--keep]

The grid reparam.epoch {2, 4, 6} x alpha_init {0.5, 1, 2} x lambda_init {0, 1, 3} (27 trials) on a tiny
Fashion-MNIST config (resnet10_cifar, 6 pretraining epochs, 1 fine-tuning epoch, 50 corrupted test images
x 2 corruptions x 1 severity), run twice with the real `tcnn sweep` (local Ray, 1 CPU per trial, tracking
off so that only the pipeline is timed):

- shared: the default; trials with the same pretraining inputs share one pretraining run;
- naive: ``sweep.share_pretraining=false``; every trial pretrains for itself in its own directory.

By default the naive side runs only the alpha_init = 1 slice (9 trials; every naive trial does the same
work whatever its grid values: a full pretraining + its reparam/finetune/evaluate) and its wall time is
extrapolated x 27/9, which the output says; ``--naive-trials 27`` runs the full naive grid (about twice as
long). Timings are noisy on a shared 2-core machine: the two sweeps run back to back on the same data.
Goal: shared wall time <= 0.4 x naive, 1 pretraining run instead of 27.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

GRID = {
    "reparam.epoch": [2, 4, 6],
    "reparam.alpha_init": [0.5, 1.0, 2.0],
    "reparam.lambda_init": [0.0, 1.0, 3.0],
}


def project(root: Path, n_train: int) -> Path:
    from _train_helpers import tiny_params, write_dataset  # the tests' Fashion-MNIST slice writer

    write_dataset(root / "data", n_train + 100, 200)
    raw = tiny_params(
        Path("data"),
        pretrain={
            "epochs": 6,
            "batch_size": 64,
            "lr": 0.05,
            "warmup_epochs": 0.5,
            "checkpoint_every_steps": 0,
        },
        reparam={"epoch": 6},
        finetune={
            "epochs": 1,
            "batch_size": 64,
            "lr": 0.004,
            "warmup_epochs": 0.3,
            "checkpoint_every_steps": 0,
        },
        robustness={
            "n_images": 50,
            "corruptions": ["gaussian_noise", "contrast"],
            "severities": [1],
            "dir": "data-c",
            "workers": 1,
        },
        sweep={"grid": GRID, "cpus_per_trial": 1, "max_failures": 0, "storage": "sweeps"},
        tracking={"enabled": False},
    )
    raw["data"]["val_size"] = 100
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def sweep(root: Path, name: str, *overrides: str) -> tuple[float, dict]:
    env = {
        **os.environ,
        "TCNN_QUIET": "1",
        "OMP_NUM_THREADS": "1",
        "TCNN_DEVICE": "cpu",
        "TCNN_TRACKING": "0",
    }
    cmd = [str(Path(sys.executable).with_name("tcnn")), "sweep", "--params", "params.yaml", "--name", name]
    cmd += ["--num-cpus", "2"]
    for o in overrides:
        cmd += ["-S", o]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(
            f"benchmark: sweep {name} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        )
    return wall, json.loads((root / "sweeps" / name / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--naive-trials", type=int, choices=(9, 27), default=9)
    ap.add_argument("--n-train", type=int, default=2500, help="training images (plus 100 for validation)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="tcnn-bench-sweep-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        project(root, args.n_train)
        n = 27
        print(
            f"benchmark: grid {GRID} = {n} trials, {args.n_train} training images, workdir {root}", flush=True
        )
        shared_wall, shared = sweep(root, "shared")
        print(
            f"shared : {shared_wall:7.1f} s wall, {shared['pretrain_runs']} pretraining run(s), "
            f"{shared['trials_finished']}/{shared['trials']} trials",
            flush=True,
        )
        shutil.rmtree(root / "sweeps" / "pretrain")  # the naive side must not find it either
        naive_over = ["sweep.share_pretraining=false"]
        if args.naive_trials == 9:
            naive_over.append("sweep.grid.reparam.alpha_init=[1.0]")
        naive_wall, naive = sweep(root, "naive", *naive_over)
        scale = n / naive["trials"]
        # Extrapolate only the trials' part (Tune's fit); Ray start-up and the corrupted sets are paid once.
        fixed = naive_wall - naive["wall_s"]
        naive_est = fixed + naive["wall_s"] * scale
        note = (
            f" (ran {naive['trials']} of {n} trials: the alpha_init=1 slice; EXTRAPOLATED: "
            f"{fixed:.1f} s start-up + {naive['wall_s']:.1f} s of trials x{scale:.0f})"
            if scale != 1
            else ""
        )
        print(
            f"naive  : {naive_wall:7.1f} s wall for {naive['trials']} trials, {naive['pretrain_runs']} pretraining "
            f"runs{note}; {n}-trial estimate {naive_est:.1f} s, {round(naive['pretrain_runs'] * scale)} pretraining runs",
            flush=True,
        )
        ratio = shared_wall / naive_est
        print(
            f"ratio  : shared / naive = {ratio:.2f}x (goal <= 0.40x: {'met' if ratio <= 0.4 else 'NOT met'}); "
            f"pretraining runs {shared['pretrain_runs']} vs {round(naive['pretrain_runs'] * scale)}",
            flush=True,
        )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
