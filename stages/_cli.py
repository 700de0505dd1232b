"""Shared command-line plumbing for the stage modules: parse --params, validate, track, one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.config import ConfigError, Params, load_params, plan_epochs
from core.importers import DataError

#: Files (or directories) each stage logs to MLflow as artifacts when they exist (relative to the repo
#: root), as ``path`` or ``(path, artifact_dir)``.
STAGE_ARTIFACTS: dict[str, tuple[str | tuple[str, str], ...]] = {
    "prepare": ("{data_dir}/manifest.json",),
    "pretrain": (
        "runs/pretrain/metrics.json", "runs/pretrain/history.json", "runs/pretrain/history.csv",
        ("runs/pretrain/cnn-final.pt", "checkpoints"), ("runs/pretrain/ckpt", "checkpoints/ckpt"),
    ),
    "reparam": ("runs/reparam/equivalence.json", ("runs/reparam/tcnn.pt", "checkpoints")),
    "finetune": (
        "runs/finetune/metrics.json", "runs/finetune/history.json", "runs/finetune/history.csv",
        "runs/finetune/gpsa.csv", ("runs/finetune/tcnn-final.pt", "checkpoints"),
    ),
    "control": (
        "runs/control/metrics.json", "runs/control/history.json", "runs/control/history.csv",
        ("runs/control/model/control-final.pt", "checkpoints"),
    ),
    "corrupt": ("{robustness_dir}/index.json", "{robustness_dir}/contact_sheet.png"),
    "evaluate": (
        "results/robustness.parquet", "results/per_image.parquet", "results/metrics.json",
        "results/summary.json", "results/baseline.json",
        "results/robustness_by_category.csv", "results/robustness_by_severity.csv",
        ("results/plots/robustness_gain.png", "plots"),
    ),
    "report": ("results/report.html", ("results/plots", "plots")),
}  # fmt: skip

#: Final metrics with stable names, logged on the parent run at the end of the chain so that the compare
#: view of pipeline executions lines them up: name -> (file relative to the root, key path in its JSON).
SUMMARY_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cnn_test_acc": ("runs/pretrain/metrics.json", ("test_acc",)),
    "tcnn_test_acc": ("runs/finetune/metrics.json", ("test_acc",)),
    "equivalence_error": ("runs/reparam/equivalence.json", ("max_abs_logit_diff",)),
    "equivalence_mean_abs_logit_diff": ("runs/reparam/equivalence.json", ("mean_abs_logit_diff",)),
    "equivalence_prediction_agreement": ("runs/reparam/equivalence.json", ("prediction_agreement",)),
    "control_test_acc": ("runs/control/metrics.json", ("test_acc",)),
    **{
        f"{model}_{name}": ("results/metrics.json", (model, name))
        for model in ("cnn", "control", "tcnn")
        for name in ("clean_accuracy", "mca", "mce", "relative_mce")
    },
    # What attention buys (T-CNN - control) and the T-CNN vs the pretrained CNN, with 95% interval ends
    # (control - pretrained CNN stays in results/metrics.json and the evaluate run: the parent keeps the two
    # differences a reader compares runs by).
    **{
        f"{b}_minus_{a}_{name}{end}": ("results/metrics.json", ("comparisons", f"{b}-{a}", name, field))
        for a, b in (("control", "tcnn"), ("cnn", "tcnn"))
        for name in ("clean_accuracy", "mca", "mce", "relative_mce")
        for end, field in (("", "diff"), ("_ci_low", "low"), ("_ci_high", "high"))
    },
}

#: Models logged with ``mlflow.pytorch.log_model`` (stage -> (checkpoint, MLflow model name)).
STAGE_MODELS: dict[str, tuple[str, str]] = {
    "pretrain": ("runs/pretrain/cnn-final.pt", "cnn"),
    "finetune": ("runs/finetune/tcnn-final.pt", "tcnn"),
    "control": ("runs/control/model/control-final.pt", "control"),
}


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


def tracking_on(params: Params) -> bool:
    """Tracking is on unless ``tracking.enabled: false`` or ``TCNN_TRACKING=0`` (the test-suite sets it)."""
    return params.tracking.enabled and os.environ.get("TCNN_TRACKING", "1") != "0"


@contextlib.contextmanager
def _tracked(params: Params, name: str) -> Iterator[Any]:
    """The stage's MLflow run (child of the pipeline's parent run), or nothing when tracking is off."""
    if not tracking_on(params):
        yield None
        return
    from pipelines.tracking import stage_run  # the one tracking adapter; stages work without it

    with stage_run(params, name, root=".", end_parent=name == "report", system_metrics=True) as tracker:
        yield tracker


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _epoch_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one history row; per-head GPSA lists become a per-layer mean plus one value per head."""
    out = {k: float(v) for k, v in numeric_metrics({k: v for k, v in row.items() if k != "gpsa"}).items()}
    gpsa = row.get("gpsa")
    if isinstance(gpsa, dict):
        for layer, stats in gpsa.items():
            for key, values in (stats or {}).items():
                if isinstance(values, list) and values and all(isinstance(v, (int, float)) for v in values):
                    out[f"gpsa/{layer}/{key}"] = sum(values) / len(values)
                    out.update({f"gpsa/{layer}/{key}/h{h}": float(v) for h, v in enumerate(values)})
    return {k: v for k, v in out.items() if math.isfinite(v)}


def log_history(tracker: Any, path: Path, step_key: str = "epoch") -> int:
    """Per-epoch metrics of a training history (``history.json``: a list of rows) with step = the epoch."""
    rows = _read_json(path)
    if not isinstance(rows, list):
        return 0
    n = 0
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get(step_key, row.get("epoch")), int):
            step = int(row.get(step_key, row.get("epoch")))
            tracker.log_metrics({f"epoch/{k}": v for k, v in _epoch_metrics(row).items()}, step=step)
            n += 1
    return n


def log_dataset_dir(tracker: Any, name: str, data_dir: Path, context: str) -> None:
    """A prepared dataset as an MLflow input: digest = sha256 of its manifest (which holds every file's sha256)."""
    from pipelines.tracking import file_digest

    manifest = data_dir / "manifest.json"
    digest = file_digest(manifest)
    if digest is None:
        return
    info = _read_json(manifest) or {}
    profile = {k: info.get(k) for k in ("num_classes", "image_shape", "class_counts") if k in info}
    profile["manifest_sha256"] = digest
    tracker.log_dataset(name, digest, str(data_dir), context=context, profile=profile)


def log_corrupted_sets(tracker: Any, params: Params, root: Path) -> None:
    """The corrupted test sets as an MLflow input: digest = sha256 of their index (one sha256 per set)."""
    from pipelines.tracking import file_digest

    index = root / params.robustness.dir / "index.json"
    digest = file_digest(index)
    if digest is not None:
        info = _read_json(index) or {}
        profile = {"n_images": info.get("n"), "sets": len(info.get("sets") or []), "index_sha256": digest}
        tracker.log_dataset(f"{params.data.name}-c", digest, str(root / params.robustness.dir),
                            context="test-corrupted", profile=profile)  # fmt: skip


def log_model(tracker: Any, checkpoint: Path, name: str) -> None:
    """The model of a checkpoint through ``mlflow.pytorch.log_model`` (loadable with
    ``mlflow.pytorch.load_model``; it gives the logits of ``core.checkpoint.load_model``)."""
    if not checkpoint.is_file():
        return
    from core.checkpoint import load_model

    model = load_model(checkpoint)
    tracker.log_torch_model(model, name=name)


def summary_metrics(root: Path) -> dict[str, float]:
    """:data:`SUMMARY_METRICS` read from the chain's outputs (missing ones are left out)."""
    out: dict[str, float] = {}
    cache: dict[str, Any] = {}
    for name, (rel, keys) in SUMMARY_METRICS.items():
        node = cache.setdefault(rel, _read_json(root / rel))
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            out[name] = float(node)
    return out


def _log_outputs(tracker: Any, params: Params, name: str, metrics: Any, root: Path = Path(".")) -> None:
    """Everything a finished stage leaves for MLflow: metrics, per-epoch metrics, artifacts, datasets, models;
    the last stage also logs the summary metrics on the parent run."""
    if tracker is None:
        return
    # config values echoed in a stage's metrics (equivalence.json's alpha_init...) stay params only, so the
    # compare view does not show a metric and a param of the same name
    echoed = {"alpha_init", "lambda_init", "reparam_epoch", "sample_fraction", "stride_mode"}
    final = {k: v for k, v in numeric_metrics(metrics).items() if k not in echoed}
    if name == "reparam" and "max_abs_logit_diff" in final:
        final["equivalence_error"] = final["max_abs_logit_diff"]
    tracker.log_metrics(final)
    if name in ("pretrain", "finetune", "control"):
        log_history(
            tracker,
            root / "runs" / name / "history.json",
            "epoch" if name == "pretrain" else "finetune_epoch",
        )
    data_dir = root / params.data.dir
    if name == "prepare":
        log_dataset_dir(tracker, params.data.name, data_dir, "prepared")
    elif name in ("pretrain", "finetune", "control"):
        log_dataset_dir(tracker, params.data.name, data_dir, "train")
    elif name == "evaluate":
        log_dataset_dir(tracker, params.data.name, data_dir, "test")
        log_corrupted_sets(tracker, params, root)
    fmt = {"data_dir": str(params.data.dir), "robustness_dir": str(params.robustness.dir)}
    for entry in STAGE_ARTIFACTS.get(name, ()):
        pattern, where = (entry, None) if isinstance(entry, str) else entry
        path = root / pattern.format(**fmt)
        if path.exists():
            tracker.log_artifact(path, where)
    if name in STAGE_MODELS:
        ckpt, model_name = STAGE_MODELS[name]
        log_model(tracker, root / ckpt, model_name)
    if name == "report":
        parent = tracker.parent_run_id
        tracker.log_metrics(summary_metrics(root), run_id=parent)
        for rel in ("results/report.html", "results/metrics.json"):
            if (root / rel).is_file():
                tracker.log_artifact(root / rel, run_id=parent)


def stage_main(name: str, run: Callable[[Params], object], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param"
    )
    args = parser.parse_args(argv)
    try:
        params = plan_epochs(load_params(args.params, args.set))  # epochs x 1/f, as the sweeps plan them
        with _tracked(params, name) as tracker:
            metrics = run(params)
            _log_outputs(tracker, params, name, metrics)
    except (ConfigError, StageError, DataError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        # pipelines.tracking.TrackingError (server down and the like), without importing MLflow here
        if type(err).__name__ != "TrackingError":
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    return 0
