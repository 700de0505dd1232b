"""The sweep's report: one self-contained ``<sweep>/report.html`` (tables + embedded PNG plots).

What a reader of a sweep wants on one page, also logged on the sweep's parent MLflow run: the model-kind
comparison against one common baseline (when the grid varies ``model``; :func:`summary.kind_rows`),
every configuration's mean over seeds with its t-interval (when the grid varies ``seed``), every trial's
headline numbers (:data:`TRIAL_COLUMNS` of :data:`summary.METRIC_COLUMNS`), and the sweep's plots.

The tables are built here as records (one dict per row, column name -> text); the page is rendered by
:func:`core.viz.html.render` from ``sweep_report.html``, with the run report's stylesheet and table macro.
Images are base64 PNGs so the file travels alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write
from core.viz.html import fmt_pct_plain, fmt_plain
from core.viz.html import render as render_page
from pipelines.sweep.selection import DIFF, mean_label, verdict
from pipelines.sweep.summary import METRIC_COLUMNS, SEED_METRICS, SEED_SUFFIXES

REPORT = "report.html"
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


def kinds_table(krows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model-kind comparison, one record per kind (percent; mCE as in Hendrycks & Dietterich, x100)."""
    return [
        {
            "kind": k["kind"],
            "arch": k["arch"],
            "trial": k["trial"],
            **{f"{c} (%)": fmt_pct_plain(k[c]) for c in PERCENT},
            "MLflow run": k.get("mlflow_run_id") or "-",
        }
        for k in krows
    ]


def trials_table(rows: list[dict[str, Any]], grid_keys: list[str]) -> list[dict[str, Any]]:
    """Every trial, one record each: grid values, status, effective epochs and the headline metrics."""
    recs = []
    for r in rows:
        rec = {"trial": r["trial"], **{k: fmt_plain(r.get(k)) for k in grid_keys}, "status": r["status"]}
        rec["node"] = ", ".join(r.get("attempt_nodes") or []) or "-"  # every attempt's node, in order
        rec.update({k: fmt_plain(r.get(k)) for k in ("pretrain_epochs", "t1", "finetune_epochs")})
        rec.update({k: fmt_plain(r.get(k)) for k in TRIAL_COLUMNS})
        recs.append(rec)
    return recs


def seeds_table(srows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, one record: mean over seeds [95% t-interval] of each model's accuracies and of the
    differences."""
    recs = []
    for s in srows:
        rec: dict[str, Any] = {"config": s["config"], "seeds": s["n_seeds"]}
        for m in SEED_METRICS:
            mean, lo, hi = (s.get(m + end) for end in SEED_SUFFIXES)
            rec[f"{m} (%)"] = (
                "-"
                if mean is None
                else fmt_pct_plain(mean)
                + ("" if lo is None else f" [{fmt_pct_plain(lo)}, {fmt_pct_plain(hi)}]")
            )
        recs.append(rec)
    return recs


def selected_table(
    chosen: list[dict[str, Any]], agg: list[dict[str, Any]], over: list[str], notes: list[str] | None = None
) -> dict[str, Any]:
    """The validation-chosen comparison (pipelines/sweep/selection.py): one record per seed and one per
    configuration over seeds, the sentence that goes with each interval, and ``notes``: what bracketing
    added and why (pipelines/sweep/bracket.py)."""

    def cell(r: dict[str, Any], name: str, ends: tuple[str, str, str]) -> str:
        mean, lo, hi = (r.get(name + e) for e in ends)
        if mean is None:
            return "-"
        return f"{100 * mean:+.2f}" + ("" if lo is None else f" [{100 * lo:+.2f}, {100 * hi:+.2f}]")

    recs = []
    for r in chosen:
        rec: dict[str, Any] = {"config": r["config"], "seed": r["seed"]}
        rec |= {f"{arm} {k}": fmt_plain(r.get(f"{arm}_{k}")) for arm in ("tcnn", "control") for k in over}
        rec |= {f"{arm} val / test (%)": f"{fmt_pct_plain(r.get(f'{arm}_val_accuracy'))} / "
                f"{fmt_pct_plain(r.get(f'{arm}_clean_accuracy'))}" for arm in ("tcnn", "control")}  # fmt: skip
        rec |= {f"T-CNN - control {m} (pp)": cell(r, f"{DIFF}_{m}", ("", "_ci_low", "_ci_high"))
                for m in ("clean_accuracy", "mca", "mce")}  # fmt: skip
        recs.append(rec)
    verdicts = []
    for a in agg:
        rec = {"config": a["config"], "seed": mean_label(a)}
        rec |= {f"{arm} val / test (%)": f"{fmt_pct_plain(a.get(f'{arm}_val_accuracy_seeds_mean'))} / "
                f"{fmt_pct_plain(a.get(f'{arm}_clean_accuracy_seeds_mean'))}" for arm in ("tcnn", "control")}  # fmt: skip
        ends = ("_seeds_mean", "_seeds_ci_low", "_seeds_ci_high")
        for m, lower in (("clean_accuracy", False), ("mca", False), ("mce", True)):
            rec[f"T-CNN - control {m} (pp)"] = cell(a, f"{DIFF}_{m}", ends)
            mean, lo, hi = (a.get(f"{DIFF}_{m}{e}") for e in ends)
            verdicts.append(f"{a['config']}, {m}: {cell(a, f'{DIFF}_{m}', ends)} pp: "
                            f"{verdict(mean, lo, hi, lower_is_better=lower)}")  # fmt: skip
        recs.append(rec)
    return {**_columns(recs), "over": ", ".join(over), "verdicts": verdicts, "bracket": list(notes or [])}


def _columns(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Records as the table macro's headers (every column, in first-seen order) and rows."""
    headers = list(dict.fromkeys(k for r in records for k in r))
    return {"headers": headers, "rows": [[r.get(h, "-") for h in headers] for r in records]}


def render(
    spec: dict[str, Any],
    rows: list[dict[str, Any]],
    krows: list[dict[str, Any]],
    plots: list[Path],
    srows: list[dict[str, Any]] | None = None,
    selected: dict[str, Any] | None = None,
) -> str:
    """The HTML text of the report (``selected``: :func:`selected_table`)."""
    from pipelines.sweep.from_search import line

    return render_page(
        "sweep_report.html",
        name=spec["name"],
        origin=line(spec["from_search"]) if spec.get("from_search") else None,
        n_trials=len(rows),
        n_finished=sum(r["status"] == "finished" for r in rows),
        written=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        baseline=krows[0]["baseline"] if krows else None,
        kinds=_columns(kinds_table(krows)) if krows else None,
        seeds=_columns(seeds_table(srows)) if srows else None,
        selected=selected,
        trials=_columns(trials_table(rows, list(spec["grid"]))),
        plots=[{"title": Path(p).stem, "alt": Path(p).name, "data": Path(p).read_bytes()} for p in plots],
    )


def write_report(
    spec: dict[str, Any],
    rows: list[dict[str, Any]],
    krows: list[dict[str, Any]],
    plots: list[Path],
    sweep_dir: Path,
    srows: list[dict[str, Any]] | None = None,
    selected: dict[str, Any] | None = None,
) -> Path:
    """``<sweep_dir>/report.html`` (atomic)."""
    text = render(spec, rows, krows, plots, srows, selected)
    return atomic_write(sweep_dir / REPORT, lambda fh: fh.write(text.encode()))
