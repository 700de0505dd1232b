"""The headline of a run: the few numbers a reader wants first, read from the evaluate stage's metrics (one
source, so `dvc metrics show`, `dvc exp show` and the MLflow parent's description print the same numbers).

- per model (pretrained CNN, matched control, T-CNN): clean accuracy and mean corruption accuracy (mCA), in %;
- the main difference, T-CNN minus its matched control (what attention buys; T-CNN minus the pretrained CNN
  when the control is off): clean accuracy, mCA and mCE (Hendrycks & Dietterich 2019), each with its paired
  bootstrap 95% interval over test images, in percentage points: ``"+0.31 [-0.20, +0.83]"``, and the same as
  numbers beside it (``"tcnn-control clean pp"``, ``"... pp low"``, ``"... pp high"``), which `dvc metrics diff`
  can subtract and `dvc exp show` sort.

Accuracies are percentages (not fractions) so that a column of `dvc metrics show` reads as the report does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The models of a run, in the order a reader compares them.
MODELS = ("cnn", "control", "tcnn")
#: Differences tried for the headline, first present wins (b-a: T-CNN vs control, else vs the pretrained CNN).
MAIN_COMPARISONS = ("tcnn-control", "tcnn-cnn")
#: Headline column -> (key in the evaluate stage's metrics, shown per model too).
COLUMNS: dict[str, tuple[str, bool]] = {
    "clean": ("clean_accuracy", True),
    "mCA": ("mca", True),
    "mCE": ("mce", False),
}
#: What each model and difference is called where a reader sees it (the report uses the same names).
MODEL_LABELS = {"cnn": "pretrained CNN", "control": "control", "tcnn": "T-CNN"}
COMPARISON_LABELS = {
    "tcnn-control": "T-CNN − control",
    "tcnn-cnn": "T-CNN − pretrained CNN",
    "control-cnn": "control − pretrained CNN",
}
LABELS = {**MODEL_LABELS, **COMPARISON_LABELS}


def interval_text(d: Mapping[str, Any] | None, unit: str = "") -> str:
    """A difference of fractions with its interval in percentage points: ``"+0.31 [-0.20, +0.83]"`` (``unit``
    follows the difference: ``" pp"`` gives ``"+0.31 pp [-0.20, +0.83]"``)."""
    if not d or not all(_finite(d.get(k)) for k in ("diff", "low", "high")):
        return "n/a"
    return f"{100 * d['diff']:+.2f}{unit} [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"


def main_comparison(metrics: Mapping[str, Any]) -> str | None:
    """The difference the headline reports (:data:`MAIN_COMPARISONS`), None when the metrics hold none."""
    comps = metrics.get("comparisons") or {}
    return next((k for k in MAIN_COMPARISONS if k in comps), None)


def headline_rows(metrics: Mapping[str, Any]) -> dict[str, dict[str, float | str]]:
    """{row: {column: value}}: one row per model present (``clean``, ``mCA``: percentages, 2 decimals) and
    one for the main difference (:func:`diff_column`: interval strings); the rows `dvc metrics show` prints, one
    file each."""
    rows: dict[str, dict[str, float | str]] = {}
    for m in MODELS:
        if isinstance(metrics.get(m), Mapping):
            rows[m] = {
                col: _pct(metrics[m].get(key)) for col, (key, per_model) in COLUMNS.items() if per_model
            }
    main = main_comparison(metrics)
    if main is not None:
        diffs = metrics["comparisons"][main]
        rows[main] = {
            diff_column(main, col): interval_text(diffs.get(key)) for col, (key, _) in COLUMNS.items()
        }
        for col, (key, _) in COLUMNS.items():  # the same difference as numbers: diffable, sortable
            rows[main] |= number_columns(main, col, diffs.get(key))
    return rows


#: The difference's numbers beside its readable string, in percentage points (their column names say so).
NUMBER_ENDS = {"diff": "pp", "low": "pp low", "high": "pp high"}


def number_columns(comparison: str, col: str, d: Mapping[str, Any] | None) -> dict[str, float | str]:
    """``{"tcnn-control clean pp": -0.46, "... pp low": -0.74, "... pp high": -0.14}``: the difference, its 95%
    interval's ends, in pp rounded as the string shows them (``"n/a"`` where not finite), so that `dvc metrics
    diff` gives its change and `dvc exp show --sort-by` sorts by it."""
    d = d or {}
    return {f"{diff_column(comparison, col)} {end}": _pct(d.get(k)) for k, end in NUMBER_ENDS.items()}


def diff_column(comparison: str, col: str) -> str:
    """The difference's own column (``"tcnn-control clean"``): a key no model row has, so that `dvc exp show`
    heads it by its name, not by ``<file>:<key>`` as it does keys several files share."""
    return f"{comparison} {col}"


#: The unit each headline number's MLflow name ends with (core.robustness.headline.headline_metrics): a model's
#: accuracy in %, a difference in pp (MLflow names may not hold "%").
MLFLOW_PERCENT = "pct"


def headline_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The headline's numbers as MLflow metrics, in the units `dvc metrics show` prints them and named as its
    columns, the unit last: ``{"tcnn clean pct": 87.31, "tcnn-control clean pp": -0.46, "tcnn-control clean pp
    low": -0.74, ...}`` (models in %, the main difference and its 95% interval's ends in pp, rounded as shown;
    the interval strings and ``"n/a"`` left out), so that the MLflow runs table and DVC show one number the
    same way."""
    out: dict[str, float] = {}
    for row, cols in headline_rows(metrics).items():
        for col, value in cols.items():
            if isinstance(value, float):
                out[col if row in MAIN_COMPARISONS else f"{row} {col} {MLFLOW_PERCENT}"] = value
    return out


def headline_markdown(metrics: Mapping[str, Any]) -> str:
    """The headline as a Markdown table (MLflow renders a run's description, ``mlflow.note.content``, as
    Markdown): models as rows, the main difference with its 95% interval as the last row."""
    rows = headline_rows(metrics)
    if not rows:
        return ""
    cols = list(COLUMNS)
    main = main_comparison(metrics)
    if main is not None:
        rows[main] = {c: rows[main][diff_column(main, c)] for c in cols}
    lines = [
        "| | " + " | ".join(f"{c} (%)" for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, row in rows.items():
        cells = [_cell(row.get(c)) for c in cols]
        label = LABELS.get(name, name)
        if name in MAIN_COMPARISONS:
            label = f"**{label}** (pp, 95% interval)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(v: Any) -> float | str:
    return round(100 * float(v), 2) if _finite(v) else "n/a"


def _cell(v: float | str | None) -> str:
    if v is None:
        return ""
    return f"{v:.2f}" if isinstance(v, float) else v


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
