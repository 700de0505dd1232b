"""The sweep's report: one self-contained ``<sweep>/report.html`` (tables + embedded PNG plots).

What a reader of a sweep wants on one page, also logged on the sweep's parent MLflow run: the model-kind
comparison against one common baseline (when the grid varies ``model``; :func:`sweep_summary.kind_rows`),
every configuration's mean over seeds with its t-interval (when the grid varies ``seed``), every trial's
headline numbers (:data:`TRIAL_COLUMNS` of :data:`sweep_summary.METRIC_COLUMNS`), and the sweep's plots. Tables are
rendered by pandas (``DataFrame.to_html``, escaped); images are base64 PNGs so the file travels alone.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Any

from core.atomic import atomic_write
from pipelines.sweep_summary import METRIC_COLUMNS, SEED_METRICS

REPORT = "report.html"
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}img{max-width:100%}"
)
PERCENT = ("clean_accuracy", "mca", "mce", "relative_mce")
#: The per-trial numbers shown in the report (summary.parquet holds every :data:`METRIC_COLUMNS` name).
TRIAL_COLUMNS = tuple(
    c
    for c in (
        *(f"{m}_{k}" for k in ("clean_accuracy", "mca", "mce") for m in ("cnn", "control", "tcnn")),
        *(
            f"tcnn_minus_control_{k}{e}"
            for k in ("clean_accuracy", "mca")
            for e in ("", "_ci_low", "_ci_high")
        ),
        "equivalence_error",
    )
    if c in METRIC_COLUMNS
)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.2f}"


def _num(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _frame_html(records: list[dict[str, Any]]) -> str:
    import pandas as pd

    return pd.DataFrame.from_records(records).to_html(index=False, escape=True, border=0)


def kinds_table(krows: list[dict[str, Any]]) -> str:
    """The model-kind comparison (percent; mCE as in Hendrycks & Dietterich, x100)."""
    recs = [
        {
            "kind": k["kind"],
            "arch": k["arch"],
            "trial": k["trial"],
            **{f"{c} (%)": _pct(k[c]) for c in PERCENT},
            "MLflow run": k.get("mlflow_run_id") or "-",
        }
        for k in krows
    ]
    return _frame_html(recs)


def trials_table(rows: list[dict[str, Any]], grid_keys: list[str]) -> str:
    """Every trial: grid values, status, effective epochs and the headline metrics."""
    recs = []
    for r in rows:
        rec = {"trial": r["trial"], **{k: _num(r.get(k)) for k in grid_keys}, "status": r["status"]}
        rec.update({k: _num(r.get(k)) for k in ("pretrain_epochs", "t1", "finetune_epochs")})
        rec.update({k: _num(r.get(k)) for k in TRIAL_COLUMNS})
        recs.append(rec)
    return _frame_html(recs)


def seeds_table(srows: list[dict[str, Any]]) -> str:
    """Per configuration: mean over seeds [95% t-interval] of each model's accuracies and of the differences."""
    recs = []
    for s in srows:
        rec: dict[str, Any] = {"config": s["config"], "seeds": s["n_seeds"]}
        for m in SEED_METRICS:
            mean, lo, hi = s.get(f"{m}_mean"), s.get(f"{m}_ci_low"), s.get(f"{m}_ci_high")
            rec[f"{m} (%)"] = (
                "-" if mean is None else _pct(mean) + ("" if lo is None else f" [{_pct(lo)}, {_pct(hi)}]")
            )
        recs.append(rec)
    return _frame_html(recs)


def render(
    spec: dict[str, Any],
    rows: list[dict[str, Any]],
    krows: list[dict[str, Any]],
    plots: list[Path],
    srows: list[dict[str, Any]] | None = None,
) -> str:
    """The HTML text of the report."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>sweep {html.escape(spec['name'])}</title>",
        f"<style>{STYLE}</style></head><body><h1>Sweep {html.escape(spec['name'])}</h1>",
        f"<p>{len(rows)} trials, {sum(r['status'] == 'finished' for r in rows)} finished; written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}.</p>",
    ]
    if krows:
        parts += [
            "<h2>Model kinds</h2>",
            f"<p>Corruption errors of every kind normalised by one baseline: {html.escape(krows[0]['baseline'])}."
            "</p>",
            kinds_table(krows),
        ]
    if srows:
        parts += [
            "<h2>Over seeds</h2>",
            "<p>Per configuration: mean over seeds [95% Student t-interval over seeds]; <code>tcnn_minus_control</code> "
            "is what attention buys (T-CNN minus the matched control), in percentage points.</p>",
            seeds_table(srows),
        ]
    parts += ["<h2>Trials</h2>", trials_table(rows, list(spec["grid"]))]
    for p in plots:
        b64 = base64.b64encode(Path(p).read_bytes()).decode("ascii")
        parts.append(f"<h3>{html.escape(Path(p).stem)}</h3><img alt='{html.escape(Path(p).name)}' "
                     f"src='data:image/png;base64,{b64}'>")  # fmt: skip
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    spec: dict[str, Any],
    rows: list[dict[str, Any]],
    krows: list[dict[str, Any]],
    plots: list[Path],
    sweep_dir: Path,
    srows: list[dict[str, Any]] | None = None,
) -> Path:
    """``<sweep_dir>/report.html`` (atomic)."""
    text = render(spec, rows, krows, plots, srows)
    return atomic_write(sweep_dir / REPORT, lambda fh: fh.write(text.encode()), shared=True)
