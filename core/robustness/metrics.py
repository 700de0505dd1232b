"""The corruption-error metrics of a robustness evaluation table.

Metrics (Hendrycks & Dietterich 2019, "Benchmarking neural network robustness to common corruptions";
used by [TCNN21] Table 2 and Fig. 3). With E(f, s, c) the top-1 error of model f on corruption c at severity s:

- corruption error        CE(f, c)  = sum_s E(f, s, c) / sum_s E(base, s, c)
- mean corruption error   mCE(f)    = mean over the 15 benchmark corruptions of CE(f, c)  (mean of ratios)
- relative CE             rCE(f, c) = sum_s (E(f, s, c) - E(f, clean)) / sum_s (E(base, s, c) - E(base, clean))
- relative mCE                      = mean over the 15 of rCE(f, c)
- mean corruption accuracy mCA(f)   = mean over the 15 x 5 cells of 1 - E(f, s, c)  (unnormalised; [TCNN21] Table 2
  reports this as "ImageNet-C top-1")

Also reported: per category (mean of the category's CEs; mean accuracy over its cells), per severity
(mCE_s = mean over the 15 of E(f, s, c) / E(base, s, c); mean accuracy over the 15 at that severity), and
the 4 extra corruptions separately (never inside mCE). Sums run over the severities evaluated (all 5 by
default). A cell flagged not meaningful (saturate on grayscale data, see core.robustness.corruptions) is left out of
every number and listed under ``excluded``.

The baseline is AlexNet on ImageNet-C or, on any other data set, a frozen baseline of the project
(core.robustness.baseline). The table comes from :func:`core.robustness.evaluation.evaluate_model`
(core.robustness.eval_table); the paired-bootstrap intervals are in core.robustness.paired_bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from core.robustness.baseline import Baseline, as_baseline
from core.robustness.corruptions import (
    BENCHMARK_CORRUPTIONS,
    CATEGORIES,
    CATEGORY_OF,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
)
from core.robustness.eval_table import model_rows


def corruption_error(errors: Sequence[float], base_errors: Sequence[float]) -> float | None:
    """CE = sum_s E(f, s, c) / sum_s E(base, s, c) ([Hendrycks19] Sec. 4); None when the baseline makes no
    error on the corruption (the ratio is then undefined, as a per-severity mCE is)."""
    den = sum(base_errors)
    return float(sum(errors) / den) if den > 0 else None


def relative_corruption_error(
    errors: Sequence[float], clean_error: float, base_errors: Sequence[float], base_clean_error: float
) -> float | None:
    """rCE = sum_s (E(f, s, c) - E(f, clean)) / sum_s (E(base, s, c) - E(base, clean)); None when the
    baseline's degradation is not positive (the ratio is then meaningless)."""
    den = sum(e - base_clean_error for e in base_errors)
    if den <= 0:
        return None
    return float(sum(e - clean_error for e in errors) / den)


def _clean_error(rows: list[dict[str, Any]], name: str) -> float:
    """The error of the model's one clean row."""
    clean = [r for r in rows if r["corruption"] == "clean"]
    if len(clean) != 1:
        raise ValueError(f"model {name!r}: expected one clean row, found {len(clean)}")
    return float(clean[0]["error"])


def _error_cells(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[int, float]], set[str]]:
    """(``cells[corruption][severity]`` = error of every meaningful corrupted row, the corruptions none of whose
    rows is meaningful). A cell flagged not meaningful (saturate on grayscale data) is left out of every number."""
    cells: dict[str, dict[int, float]] = {}
    excluded: set[str] = set()
    for r in rows:
        c = r["corruption"]
        if c == "clean":
            continue
        if not r.get("meaningful", True):
            excluded.add(c)
            continue
        cells.setdefault(c, {})[int(r["severity"])] = float(r["error"])
    excluded -= set(cells)  # only fully excluded corruptions
    return cells, excluded


def _corruption_entry(
    c: str, cells: Mapping[int, float], clean_err: float, base: Baseline | None
) -> dict[str, Any]:
    """One ``per_corruption`` entry: mean accuracy and error over the evaluated severities, CE and relative CE
    (Hendrycks & Dietterich 2019; None unless the baseline has every one of those severities), and the
    accuracy per severity."""
    sev = sorted(cells)
    errs = [cells[s] for s in sev]
    ce = rce = None
    if base is not None and c in base.errors and all(s in base.errors[c] for s in sev):
        b = [base.errors[c][s] for s in sev]
        ce = corruption_error(errs, b)
        rce = relative_corruption_error(errs, clean_err, b, base.clean_error)
    return {
        "category": CATEGORY_OF[c],
        "accuracy": 1.0 - float(np.mean(errs)),
        "error": float(np.mean(errs)),
        "ce": ce,
        "relative_ce": rce,
        "per_severity": {str(s): 1.0 - cells[s] for s in sev},
    }


def _group_mce(per_corruption: Mapping[str, Mapping[str, Any]], cs: list[str], key: str) -> float | None:
    """Mean of the corruptions' `key` ("ce": mCE, "relative_ce": relative mCE): a mean of ratios, None
    unless every one of them has it."""
    vals = [per_corruption[c][key] for c in cs]
    return float(np.mean(vals)) if cs and all(v is not None for v in vals) else None


def _group_accuracy(cells: Mapping[str, Mapping[int, float]], cs: list[str]) -> float | None:
    """Mean accuracy over every (corruption, severity) cell of the corruptions (mCA when they are the 15)."""
    vals = [1.0 - e for c in cs for e in cells[c].values()]
    return float(np.mean(vals)) if vals else None


def _group(
    cells: Mapping[str, Mapping[int, float]], per_corruption: Mapping[str, Mapping[str, Any]], cs: list[str]
) -> dict[str, Any]:
    """Accuracy, mCE and relative mCE of a group of corruptions (a category, or the extras)."""
    return {
        "accuracy": _group_accuracy(cells, cs),
        "mce": _group_mce(per_corruption, cs, "ce"),
        "relative_mce": _group_mce(per_corruption, cs, "relative_ce"),
        "corruptions": cs,
    }


def _per_severity(
    cells: Mapping[str, Mapping[int, float]], bench: list[str], base: Baseline | None
) -> dict[str, dict[str, float | None]]:
    """Per severity s, over the benchmark corruptions evaluated at s: mean accuracy, mean error and
    mCE_s = mean of E(f, s, c) / E(base, s, c) (None unless the baseline has every one, non-zero)."""
    per_severity = {}
    for s in sorted({s for c in bench for s in cells[c]}):
        cs = [c for c in bench if s in cells[c]]
        ratios = []
        for c in cs:
            b = base.errors.get(c, {}).get(s) if base is not None else None
            ratios.append(cells[c][s] / b if b else None)
        per_severity[str(s)] = {
            "accuracy": float(np.mean([1.0 - cells[c][s] for c in cs])),
            "error": float(np.mean([cells[c][s] for c in cs])),
            "mce": float(np.mean(ratios)) if ratios and all(v is not None for v in ratios) else None,
        }
    return per_severity


def summarize(
    table: pa.Table | Iterable[Mapping[str, Any]],
    baseline: Baseline | str | Mapping[str, Any] | pa.Table | None = None,
    *,
    model: str | None = None,
) -> dict[str, Any]:
    """Robustness summary of one model of an :func:`core.robustness.evaluation.evaluate_model` table: the metrics of Hendrycks &
    Dietterich 2019 (see the module docstring).

    `baseline`: a :class:`Baseline`, "alexnet", a baseline JSON path, a baseline model's table, a dict in
    the reference layout, or None (accuracies only; CE entries are None). CE of a corruption is None when
    the baseline lacks one of its evaluated severities; mCE / relative mCE are None unless every evaluated
    benchmark corruption has one. Keys: model, baseline, clean_accuracy, clean_error, mca, mce,
    relative_mce, per_corruption, per_category, per_severity, extra, excluded, corruptions, complete.
    """
    rows = model_rows(table, model)
    name = rows[0]["model"]
    base = as_baseline(baseline)
    clean_err = _clean_error(rows, name)
    cells, excluded = _error_cells(rows)
    present = [c for c in CORRUPTIONS if c in cells]
    per_corruption = {c: _corruption_entry(c, cells[c], clean_err, base) for c in present}
    bench = [c for c in present if c in BENCHMARK_CORRUPTIONS]
    extra = [c for c in present if c in EXTRA_CORRUPTIONS]
    per_category = {}
    for cat, members in CATEGORIES.items():
        cs = [c for c in present if c in members]
        if cs:
            per_category[cat] = _group(cells, per_corruption, cs)
    complete = set(bench) == set(BENCHMARK_CORRUPTIONS) and all(
        sorted(cells[c]) == [1, 2, 3, 4, 5] for c in bench
    )
    return {
        "model": name,
        "baseline": base.name if base is not None else None,
        "clean_accuracy": 1.0 - clean_err,
        "clean_error": clean_err,
        "mca": _group_accuracy(cells, bench),
        "mce": _group_mce(per_corruption, bench, "ce"),
        "relative_mce": _group_mce(per_corruption, bench, "relative_ce"),
        "per_corruption": per_corruption,
        "per_category": per_category,
        "per_severity": _per_severity(cells, bench, base),
        "extra": _group(cells, per_corruption, extra),
        "excluded": sorted(excluded, key=CORRUPTIONS.index),
        "corruptions": bench,
        "complete": complete,
    }


def flat_metrics(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The summary as flat ``name -> number`` pairs for metrics.json / MLflow (None values left out):
    clean_accuracy, mca, mce, relative_mce, extra_accuracy, extra_mce, mca_<category>, mce_<category>,
    mca_sev<s>, mce_sev<s>, ce_<corruption>, acc_<corruption>."""
    out: dict[str, Any] = {
        "clean_accuracy": summary["clean_accuracy"],
        "mca": summary["mca"],
        "mce": summary["mce"],
        "relative_mce": summary["relative_mce"],
        "extra_accuracy": summary["extra"]["accuracy"],
        "extra_mce": summary["extra"]["mce"],
    }
    for cat, v in summary["per_category"].items():
        out[f"mca_{cat}"] = v["accuracy"]
        out[f"mce_{cat}"] = v["mce"]
    for s, v in summary["per_severity"].items():
        out[f"mca_sev{s}"] = v["accuracy"]
        out[f"mce_sev{s}"] = v["mce"]
    for c, v in summary["per_corruption"].items():
        out[f"acc_{c}"] = v["accuracy"]
        out[f"ce_{c}"] = v["ce"]
    return {
        f"{prefix}{k}": float(v) for k, v in out.items() if v is not None and not math.isnan(float(v))
    }  # fmt: skip
