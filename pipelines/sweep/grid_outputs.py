"""The end of a grid sweep whose trials ran: summary.parquet, the plots, the kind, seed, bracketing and
selection tables and report.html in the sweep's directory, the parent run's metrics and artifacts, the printed
tables and the driver's last line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.utils import mlflow_ui
from core.utils.atomic import atomic_write_json
from pipelines.sweep.driver_legs import wall_metrics
from pipelines.sweep.driver_lines import say
from pipelines.sweep.settings import select_of


def _final_is_tcnn(kind: str | None) -> bool:
    """A trial of a kind whose final model is a T-CNN (no kind in the row: a sweep of the default kind)."""
    from core.models import kinds

    return kind is None or kinds.get(kind).final_is_tcnn


@dataclass
class _Outputs:
    """What the end of a sweep wrote in its directory: the parent run logs it and the driver prints it."""

    rows: list[dict]  # summary rows, one per trial
    srows: list[dict]  # over-seed rows (summary.seed_rows)
    krows: list[dict]  # model-kind rows (summary.kind_rows)
    summary: Path  # summary.parquet
    plots: list[Path]
    files: list[Path]  # the other artifacts of the parent run (kinds, seeds, bracket, selection, report)
    bracketed: bool
    notes: list[str]  # what bracketing added and why
    chosen: list[dict]  # the validation-chosen rows (selection.selected_rows)
    chosen_seeds: list[dict]  # their over-seed rows


def finish(spec: dict, status: dict[str, str], tracker: Any, sweep_dir: Path, t0: float) -> dict:
    """The end of a sweep whose trials ran: its outputs, the parent run's metrics, tags and artifacts (the
    parent ends FINISHED when every trial finished, FAILED otherwise), metrics.json, the printed tables and
    the last line. Returns run_sweep's result."""
    from pipelines.sweep import bracket, shared, summary

    n = len(spec["trials"])
    out = _write_outputs(spec, status, sweep_dir)
    finished = sum(r["status"] == "finished" for r in out.rows)
    runs = shared.pretrain_runs(sweep_dir)
    metrics = _parent_metrics(spec, out, n, finished, runs)
    if out.bracketed:
        tracker.set_tags(bracket.tags(spec))
    metrics |= wall_metrics(sweep_dir, t0)
    _log_parent(tracker, spec, out, metrics, "FINISHED" if finished == n else "FAILED")
    atomic_write_json(sweep_dir / "metrics.json", metrics)
    _print_outputs(spec, out)
    for r in out.rows:  # a refusal is the trial's one line, not a traceback: the user fixes the params
        if r["status"] == "refused":
            say(f"trial {r['trial']} refused: {r['refused']}")
        if why := summary.cnn_evaluation_reason(r):  # said in the trial's log: the driver says it too
            say(f"trial {r['trial']}: the pretrained CNN was evaluated again: {why}")
    say(
        f"{finished}/{n} trials finished, {runs} pretraining run(s) executed; summary {out.summary}"
        + (
            f"; MLflow parent run {spec['tracking']['parent_run_id']} in {spec['tracking']['uri']}: "
            + mlflow_ui.run_url(
                tracker.experiment_id,
                spec["tracking"]["parent_run_id"],
                mlflow_ui.ui_base(spec["tracking"]["uri"]),
            )
            if tracker.enabled
            else ""
        )
    )
    return {
        "trials": n,
        "finished": finished,
        "failed": n - finished,
        "pretrain_runs": runs,
        "sweep_dir": str(sweep_dir),
        "summary": str(out.summary),
        "plots": [str(p) for p in out.plots],
        "parent_run_id": spec["tracking"]["parent_run_id"],
    }


def _write_outputs(spec: dict, status: dict[str, str], sweep_dir: Path) -> _Outputs:
    """summary.parquet, the plots (a failed plot only warns: it must not cost the sweep its summary and
    parent run), the kind and seed tables, bracket.json, the selection and report.html in ``sweep_dir``."""
    from pipelines.sweep import bracket, selection, summary, sweep_report, tables

    rows = summary.summary_rows(spec, status)
    srows = summary.seed_rows(spec, rows)
    table = tables.write_table(summary.with_seed_columns(rows, srows, spec), sweep_dir / "summary.parquet")
    krows = summary.kind_rows(spec, rows)
    try:
        plots = summary.make_plots(spec, rows, sweep_dir / "plots", krows)
    except Exception as err:  # a plot must not cost the sweep its summary and parent run
        say(f"warning: plots failed ({type(err).__name__}: {err})")
        plots = []
    files = summary.write_kinds(krows, sweep_dir) if krows else []
    files += summary.write_seeds(srows, sweep_dir) if srows else []
    bracketed = spec.get("bracket") is not None or bool(bracket.rounds(spec))
    notes = bracket.notes(spec) if bracketed else []
    if bracketed:
        files.append(atomic_write_json(sweep_dir / "bracket.json", bracket.record(spec)))
    chosen = selection.selected_rows(spec, rows)
    chosen_seeds = selection.over_seeds(chosen)
    if chosen:
        files += _write_selection(spec, rows, chosen, chosen_seeds, sweep_dir, notes)
    picked = (
        sweep_report.selected_table(chosen, chosen_seeds, select_of(spec).over, notes) if chosen else None
    )
    files.append(sweep_report.write_report(spec, rows, krows, plots, sweep_dir, srows, picked))
    return _Outputs(rows, srows, krows, table, plots, files, bracketed, notes, chosen, chosen_seeds)


def _write_selection(
    spec: dict,
    rows: list[dict],
    chosen: list[dict],
    chosen_seeds: list[dict],
    sweep_dir: Path,
    notes: list[str],
) -> list[Path]:
    """The validation-chosen rows, their over-seed rows and the finished trials pooled per value
    (pipelines/sweep/selection.py); returns the files written."""
    from pipelines.sweep import selection

    sel = select_of(spec)
    over = sel.over
    done = [r for r in rows if r["status"] == "finished"]
    pool = selection.pooled(done, list(spec["grid"]), over, sel.by)
    return selection.write(chosen, chosen_seeds, over, sweep_dir, notes, pool)


def _parent_metrics(spec: dict, out: _Outputs, n: int, finished: int, runs: int) -> dict[str, Any]:
    """The parent run's metrics (all but ``wall_s``): trial counts, the best fine-tuned T-CNN's clean
    accuracy, the kind, seed and selection metrics and, bracketed, how many rounds ran."""
    from pipelines.sweep import bracket, selection, summary

    metrics: dict[str, Any] = {
        "trials": n,
        "pretrain_runs": runs,
        "trials_finished": finished,
        "trials_failed": n - finished,
    }
    accs = [  # the fine-tuned model's accuracy; in a kind grid only T-CNN-architecture trials count
        r["tcnn_clean_accuracy"]
        for r in out.rows
        if r["tcnn_clean_accuracy"] is not None and _final_is_tcnn(r.get("model_kind"))
    ]
    if accs:
        metrics["best_tcnn_clean_accuracy"] = max(accs)
    metrics.update(summary.kind_metrics(out.krows))
    metrics.update(summary.seed_metrics(out.srows))
    metrics.update(selection.selection_metrics(out.chosen, out.chosen_seeds))
    if out.bracketed:
        metrics["bracket_rounds"] = len(bracket.rounds(spec))
    return metrics


def _log_parent(tracker: Any, spec: dict, out: _Outputs, metrics: dict[str, Any], end: str) -> None:
    """Log ``metrics`` on the parent run and, tracking on, the outputs and the grid; then end it ``end``."""
    tracker.log_metrics(metrics)
    if tracker.enabled:
        tracker.log_artifact(out.summary)
        for p in out.plots:
            tracker.log_artifact(p, "plots")
        for p in out.files:
            tracker.log_artifact(p)
        tracker.log_dict(spec["grid"], "grid.json")
        tracker.end_parent(end)


def _print_outputs(spec: dict, out: _Outputs) -> None:
    """The search the grid came from (--from-search), the summary table, then the kind, seed and selection
    tables (or the bracketing notes) there are."""
    from pipelines.sweep import selection, summary
    from pipelines.sweep.from_search import line

    if spec.get("from_search"):
        print(line(spec["from_search"]), flush=True)
    print(summary.format_table(out.rows, list(spec["grid"])), flush=True)
    if out.krows:
        print(summary.kinds_markdown(out.krows), flush=True)
    if out.srows:
        print(summary.seeds_markdown(out.srows), flush=True)
    if out.chosen:
        over = select_of(spec).over
        print(selection.markdown(out.chosen, out.chosen_seeds, over, out.notes), flush=True)
    elif out.notes:
        print("\n".join(["Bracketing:", *out.notes]), flush=True)
