"""The one catalogue of what a run reports, used by the DVC path (stages/runner.py) and the Ray path
(pipelines/sweep_trial.py) alike, so MLflow's compare view lines every run up: the artifacts and models each
stage logs, and the summary metrics with their stable names, read from the stages' output files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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
        ("results/public", "public"),
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
    # Validation accuracy of each final model (the split hyperparameters are chosen on: sweep.select)
    "cnn_val_accuracy": ("runs/pretrain/metrics.json", ("val_acc",)),
    "tcnn_val_accuracy": ("runs/finetune/metrics.json", ("val_acc",)),
    "control_val_accuracy": ("runs/control/metrics.json", ("val_acc",)),
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
    # The same on a published benchmark evaluated next to the generated sets (robustness.public, use: add).
    **{
        f"public_{model}_{name}": ("results/metrics.json", ("public", model, name))
        for model in ("cnn", "control", "tcnn")
        for name in ("mca", "mce", "relative_mce")
    },
    **{
        f"public_tcnn_minus_{a}_{name}{end}": (
            "results/metrics.json",
            ("public", "comparisons", f"tcnn-{a}", name, field),
        )
        for a in ("control", "cnn")
        for name in ("mca", "mce", "relative_mce")
        for end, field in (("", "diff"), ("_ci_low", "low"), ("_ci_high", "high"))
    },
}

#: Training histories each stage logs as per-epoch metrics: stage -> (history.json, the row's step key).
STAGE_HISTORIES: dict[str, tuple[str, str]] = {
    "pretrain": ("runs/pretrain/history.json", "epoch"),
    "finetune": ("runs/finetune/history.json", "finetune_epoch"),
    "control": ("runs/control/history.json", "finetune_epoch"),
}

#: Datasets each stage logs as MLflow inputs, by context ("test-corrupted": the corrupted sets).
STAGE_DATASETS: dict[str, tuple[str, ...]] = {
    "prepare": ("prepared",),
    "pretrain": ("train",),
    "finetune": ("train",),
    "control": ("train",),
    "evaluate": ("test", "test-corrupted"),
}

#: Names a stage's metrics echo from the config (equivalence.json's alpha_init...): they stay params only, so
#: the compare view does not show a metric and a param of the same name.
ECHOED_PARAMS = ("alpha_init", "lambda_init", "reparam_epoch", "sample_fraction", "stride_mode")

#: A stage metric also logged under the summary name (the same number in every view).
STAGE_METRIC_ALIASES: dict[str, dict[str, str]] = {"reparam": {"max_abs_logit_diff": "equivalence_error"}}

#: What the last stage puts on the parent run besides :data:`SUMMARY_METRICS`.
PARENT_ARTIFACTS = ("results/report.html", "results/metrics.json")

#: Models logged with ``mlflow.pytorch.log_model`` (stage -> (checkpoint, MLflow model name)).
STAGE_MODELS: dict[str, tuple[str, str]] = {
    "pretrain": ("runs/pretrain/cnn-final.pt", "cnn"),
    "finetune": ("runs/finetune/tcnn-final.pt", "tcnn"),
    "control": ("runs/control/model/control-final.pt", "control"),
}


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


def stage_metrics(stage: str, metrics: Any) -> dict[str, float]:
    """A stage's returned metrics as MLflow numbers: config echoes left out, summary aliases added."""
    final = {k: v for k, v in numeric_metrics(metrics).items() if k not in ECHOED_PARAMS}
    for name, alias in STAGE_METRIC_ALIASES.get(stage, {}).items():
        if name in final:
            final[alias] = final[name]
    return final


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary_metrics(root: Path) -> dict[str, float]:
    """:data:`SUMMARY_METRICS` read from the chain's outputs (missing ones are left out)."""
    out: dict[str, float] = {}
    cache: dict[str, Any] = {}
    for name, (rel, keys) in SUMMARY_METRICS.items():
        node = cache.setdefault(rel, read_json(root / rel))
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            out[name] = float(node)
    return out


def epoch_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one training-history row as ``epoch/<name>`` metrics (log them with step = the epoch);
    per-head GPSA lists become a per-layer mean plus one value per head (``epoch/gpsa/<layer>/<q>[/h<i>]``)."""
    out = {k: float(v) for k, v in numeric_metrics({k: v for k, v in row.items() if k != "gpsa"}).items()}
    gpsa = row.get("gpsa")
    if isinstance(gpsa, dict):
        for layer, stats in gpsa.items():
            for key, values in (stats or {}).items():
                if isinstance(values, list) and values and all(isinstance(v, (int, float)) for v in values):
                    out[f"gpsa/{layer}/{key}"] = sum(values) / len(values)
                    out.update({f"gpsa/{layer}/{key}/h{h}": float(v) for h, v in enumerate(values)})
    return {f"epoch/{k}": v for k, v in out.items() if math.isfinite(v)}
