"""Shared command-line plumbing for the stage modules: parse --params, validate, track, one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.config import ConfigError, Params, load_params
from core.importers import DataError

#: Files each stage logs to MLflow as artifacts when they exist (relative to the repo root).
STAGE_ARTIFACTS: dict[str, tuple[str, ...]] = {
    "prepare": ("{data_dir}/manifest.json",),
    "pretrain": ("runs/pretrain/metrics.json", "runs/pretrain/history.csv", "runs/pretrain/cnn-final.pt"),
    "reparam": ("runs/reparam/equivalence.json",),
    "finetune": (
        "runs/finetune/metrics.json", "runs/finetune/history.csv", "runs/finetune/gpsa.csv",
        "runs/finetune/tcnn-final.pt",
    ),
    "corrupt": ("{robustness_dir}/index.json", "{robustness_dir}/contact_sheet.png"),
    "evaluate": (
        "results/robustness.parquet", "results/metrics.json", "results/baseline.json",
        "results/plots/robustness_gain.png",
    ),
    "report": ("results/report.html", "results/plots", "dvc.lock", "params.yaml"),
}  # fmt: skip


class StageError(RuntimeError):
    """A stage cannot run on its inputs (missing or corrupt checkpoint, bad data): one line, exit 2."""


def numeric_metrics(obj: Any, prefix: str = "") -> dict[str, float]:
    """Flatten a stage's returned metrics to MLflow-loggable numbers (names joined with '_')."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(
                numeric_metrics(v, f"{prefix}{k}_" if not isinstance(v, (int, float)) else f"{prefix}{k}")
            )
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out[prefix.rstrip("_")] = float(obj)
    return out


@contextlib.contextmanager
def _tracked(params: Params, name: str) -> Iterator[Any]:
    """The stage's MLflow run (child of the pipeline's parent run), or nothing when tracking is off.

    `TCNN_TRACKING=0` switches tracking off for one invocation (the test-suite sets it)."""
    if not params.tracking.enabled or os.environ.get("TCNN_TRACKING") == "0":
        yield None
        return
    from pipelines.tracking import stage_run  # the one tracking adapter; stages work without it

    with stage_run(params, name, root=".", end_parent=name == "report") as tracker:
        yield tracker


def _log_outputs(tracker: Any, params: Params, name: str, metrics: Any) -> None:
    if tracker is None:
        return
    tracker.log_metrics(numeric_metrics(metrics))
    fmt = {"data_dir": str(params.data.dir), "robustness_dir": str(params.robustness.dir)}
    for pattern in STAGE_ARTIFACTS.get(name, ()):
        path = Path(pattern.format(**fmt))
        if path.exists():
            tracker.log_artifact(path)


def stage_main(name: str, run: Callable[[Params], object], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param"
    )
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.set)
        with _tracked(params, name) as tracker:
            metrics = run(params)
            _log_outputs(tracker, params, name, metrics)
    except (ConfigError, StageError, DataError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    return 0
