"""The one catalogue of what a run reports, used by the DVC path (stages/harness/runner.py) and the Ray path
(pipelines/sweep/trial.py) alike, so MLflow's compare view lines every run up: the artifacts and models each
stage logs, and the summary metrics with their stable names, read from the stages' output files. Which files
a stage writes is dvc.yaml's to say (`stages.harness.chain.outputs`); this module only says how each is logged."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stages.harness import chain

#: Where an output file of a stage (dvc.yaml outs and metrics) goes among its run's artifacts, by suffix
#: (others: the run's top level); a file in an output directory goes under ``<folder>/<directory name>``.
FOLDER_BY_SUFFIX = {".pt": "checkpoints", ".png": "plots"}
#: The files of an output *directory* that are logged: a directory out holds data too (the prepared shards,
#: the corrupted sets), which stays with DVC.
DIR_FILE_SUFFIXES = (".json", ".png", ".pt")
#: Files a stage writes only in some configurations (a dvc.yaml out must always exist): stage -> (path, folder).
OPTIONAL_ARTIFACTS: dict[str, tuple[tuple[str, str], ...]] = {"evaluate": (("results/public", "public"),)}


def stage_artifacts(stage: str, params: dict[str, Any], root: Path) -> list[tuple[Path, str | None]]:
    """The files a finished stage logs to MLflow as (path, artifact folder): its dvc.yaml outs and metrics
    (`stages.harness.chain.outputs`, ``${...}`` filled from ``params``, a params.yaml mapping) that exist under
    ``root``, output directories by their :data:`DIR_FILE_SUFFIXES` files, and its optional extras."""
    out: list[tuple[Path, str | None]] = []
    for rel in chain.outputs(stage):
        path = root / chain.resolve(rel, params)
        if path.is_file():
            out.append((path, FOLDER_BY_SUFFIX.get(path.suffix)))
        elif path.is_dir():
            headline = rel == chain.headline_dir()  # its files keep their folder: headline/<row>.json
            for f in sorted(path.iterdir()):
                if f.is_file() and f.suffix in DIR_FILE_SUFFIXES:
                    folder = FOLDER_BY_SUFFIX.get(f.suffix)
                    out.append((f, f"{folder}/{path.name}" if folder else path.name if headline else None))
    out += [
        (root / rel, folder) for rel, folder in OPTIONAL_ARTIFACTS.get(stage, ()) if (root / rel).exists()
    ]
    return out


FINAL_SUFFIX = "-final.pt"


def final_model(stage: str, params: dict[str, Any], root: Path) -> Path | None:
    """The stage's final model checkpoint (its ``*-final.pt`` output, or one inside an output directory)."""
    for rel in chain.outputs(stage):
        path = root / chain.resolve(rel, params)
        found = sorted(path.glob(f"*{FINAL_SUFFIX}")) if path.is_dir() else [path]
        found = [f for f in found if f.name.endswith(FINAL_SUFFIX) and f.is_file()]
        if found:
            return found[0]
    return None


#: Final metrics with stable names, logged on the parent run at the end of the chain so that the compare
#: view of pipeline executions lines them up: name -> (the stage whose metrics file holds it, key path in that
#: JSON; the file is the stage's dvc.yaml ``metrics:`` entry, `stages.harness.chain.metrics_file`).
SUMMARY_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cnn_test_acc": ("pretrain", ("test_acc",)),
    "tcnn_test_acc": ("finetune", ("test_acc",)),
    "equivalence_error": ("reparam", ("max_abs_logit_diff",)),
    "equivalence_mean_abs_logit_diff": ("reparam", ("mean_abs_logit_diff",)),
    "equivalence_prediction_agreement": ("reparam", ("prediction_agreement",)),
    "control_test_acc": ("control", ("test_acc",)),
    # Validation accuracy of each final model (the split hyperparameters are chosen on: sweep.select)
    "cnn_val_accuracy": ("pretrain", ("val_acc",)),
    "tcnn_val_accuracy": ("finetune", ("val_acc",)),
    "control_val_accuracy": ("control", ("val_acc",)),
    **{
        f"{model}_{name}": ("evaluate", (model, name))
        for model in ("cnn", "control", "tcnn")
        for name in ("clean_accuracy", "mca", "mce", "relative_mce")
    },
    # What attention buys (T-CNN - control) and the T-CNN vs the pretrained CNN, with 95% interval ends
    # (control - pretrained CNN stays in results/metrics.json and the evaluate run: the parent keeps the two
    # differences a reader compares runs by).
    **{
        f"{b}_minus_{a}_{name}{end}": ("evaluate", ("comparisons", f"{b}-{a}", name, field))
        for a, b in (("control", "tcnn"), ("cnn", "tcnn"))
        for name in ("clean_accuracy", "mca", "mce", "relative_mce")
        for end, field in (("", "diff"), ("_ci_low", "low"), ("_ci_high", "high"))
    },
    # The same on a published benchmark evaluated next to the generated sets (robustness.public, use: add).
    **{
        f"public_{model}_{name}": ("evaluate", ("public", model, name))
        for model in ("cnn", "control", "tcnn")
        for name in ("mca", "mce", "relative_mce")
    },
    **{
        f"public_tcnn_minus_{a}_{name}{end}": (
            "evaluate",
            ("public", "comparisons", f"tcnn-{a}", name, field),
        )
        for a in ("control", "cnn")
        for name in ("mca", "mce", "relative_mce")
        for end, field in (("", "diff"), ("_ci_low", "low"), ("_ci_high", "high"))
    },
}

#: Training histories each stage logs as per-epoch metrics (its ``history.json`` output): stage -> the rows'
#: step key.
STAGE_HISTORIES: dict[str, str] = {
    "pretrain": "epoch",
    "finetune": "finetune_epoch",
    "control": "finetune_epoch",
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

#: What the last stage puts on the parent run besides :data:`SUMMARY_METRICS`: (stage, output file name).
PARENT_ARTIFACTS = (("report", "report.html"), ("evaluate", "metrics.json"))

#: Models logged with ``mlflow.pytorch.log_model`` (stage -> MLflow model name; the checkpoint is the
#: stage's :func:`final_model`).
STAGE_MODELS: dict[str, str] = {"pretrain": "cnn", "finetune": "tcnn", "control": "control"}


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
    for name, (stage, keys) in SUMMARY_METRICS.items():
        node = cache.setdefault(stage, read_json(root / chain.metrics_file(stage)))
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            out[name] = float(node)
    return out


def headline_summary(root: Path) -> dict[str, float]:
    """The headline's numbers (core.robustness.headline.headline_metrics: models in %, the main difference in
    pp, named as `dvc metrics show` heads them, the unit last), read from the evaluate stage's metrics; logged
    on the parent next to :data:`SUMMARY_METRICS`' fractions. Empty before evaluate has run."""
    from core.robustness.headline import headline_metrics

    metrics = read_json(root / chain.metrics_file("evaluate"))
    return headline_metrics(metrics) if isinstance(metrics, dict) else {}


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


def stage_summary(stage: str) -> str:
    """What a stage does: the first paragraph of its module's docstring (``stages/<stage>.py``), one line."""
    import ast

    try:
        doc = ast.get_docstring(ast.parse((chain.REPO / "stages" / f"{stage}.py").read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


#: The arm of the comparison a stage's run trains (the T-CNN and its matched control; T-CNN, d'Ascoli et al.
#: 2021, Sec. 3), for the runs' descriptions.
STAGE_ARMS = {"pretrain": "the pretrained CNN", "finetune": "the T-CNN arm", "control": "the control arm"}


def stage_description(params: Any, stage: str) -> str:
    """A stage run's MLflow description (Markdown): dataset, model kind and arch, seed, the arm it trains, and
    what the stage does."""
    arm = STAGE_ARMS.get(stage)
    head = " · ".join(
        [f"**{stage}**", f"dataset {params.data.name}", f"{params.model.kind} ({params.model.arch})",
         f"seed {params.seed}", *([arm] if arm else [])]
    )  # fmt: skip
    return f"{head}\n\n{stage_summary(stage)}"


def parent_description(label: str, root: Path) -> str:
    """The parent run's MLflow description (Markdown): its name, T-CNN - control with its intervals on one line,
    one sentence per interval (the report's own words), then the headline table (core.robustness.headline)."""
    from core.robustness.headline import (
        COLUMNS,
        COMPARISON_LABELS,
        diff_column,
        headline_markdown,
        headline_rows,
        main_comparison,
    )
    from core.viz.report_html import verdict

    metrics = read_json(root / chain.metrics_file("evaluate"))
    if not isinstance(metrics, dict) or main_comparison(metrics) is None:
        return f"**{label}**"
    main = main_comparison(metrics)
    other = "the control" if main == "tcnn-control" else "the pretrained CNN"
    diffs = metrics["comparisons"][main]
    row = headline_rows(metrics)[main]
    cells = [f"{col} {row[diff_column(main, col)]}" for col in COLUMNS]  # the readable strings
    # the answer first: the UI shows a description's first lines and folds the rest under "Show more"
    lines = [f"**{label}**", "",
             f"**{COMPARISON_LABELS[main]}** (pp, paired bootstrap 95% interval over test images): " + " · ".join(cells), ""]  # fmt: skip
    for name, key, better in (
        ("Clean accuracy", "clean_accuracy", True),
        ("mCA", "mca", True),
        ("mCE", "mce", False),
    ):
        if sentence := verdict(name, diffs.get(key), better, other):
            lines.append(f"- {sentence}")
    return "\n".join([*lines, "", headline_markdown(metrics)])
