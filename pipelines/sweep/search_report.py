"""The end of a search (``sweep.search``): what was tried, what was stopped when, what each arm chose.

From Tune's results and the trials' own files: one row per trial (its point, arm, status, the epochs it
trained, its last validation accuracy, the validation images it was measured on), each arm's choice among its
trials that trained every epoch (:func:`pipelines.sweep.scheduling.candidates`; a stopped trial is never chosen)
with how many candidates it had, the runner-up and the margin in validation images (a tie is said: the lower
point index, the point sampled earlier, is kept), the compute used (fine-tuning
epochs trained, against the budget of every trial running to the end), the validation curves plot
(core.viz.search_plots), and the MLflow side: a stopped trial's run is closed FINISHED with the tags
``tcnn.status: stopped`` and ``tcnn.stopped_at_epoch`` (as Ray's own MLflow callback closes a trial its
scheduler stopped), never FAILED. Written to ``<sweep>/search.parquet``, ``search.md``, ``chosen.json``,
``plots/search_curves.png`` and ``report.html``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json, atomic_write_text
from pipelines.sweep.arm_trial import ARM_STAGES, arm_params, arm_tid, base_tid, control_key, point_values
from pipelines.sweep.replay import DONE, REFUSED, STATE
from pipelines.sweep.scheduling import ARM_KEY, ARMS, METRIC, TIME_ATTR, candidates
from pipelines.sweep.search import POINT_KEY, max_epochs
from pipelines.sweep.selection import val_images
from pipelines.sweep.settings import SearchConfig, scheduler_of, search_of
from pipelines.sweep.tables import write_table
from pipelines.sweep.trial_files import read_json, trial_dir

STATUS_TAG, STOPPED_AT_TAG = "tcnn.status", "tcnn.stopped_at_epoch"
#: What chosen.json says of each arm's choice beside its trial, values and val_acc (``tcnn sweep --from-search``
#: reads ``candidates`` and ``configs``).
CHOICE_KEYS = ("candidates", "finished_trials", "configs", "runner_up", "margin_images", "tie")


def _curve(result: Any) -> tuple[list[int], list[float]]:
    """A trial's (epoch, val_acc) reports in order, one per epoch (the last report of an epoch counts)."""
    df = result.metrics_dataframe
    by_epoch: dict[int, float] = {}
    if df is not None and TIME_ATTR in df and METRIC in df:
        for e, v in zip(df[TIME_ATTR], df[METRIC], strict=True):
            if (
                isinstance(e, int | float)
                and isinstance(v, int | float)
                and not math.isnan(e)
                and not math.isnan(v)
            ):
                by_epoch[int(e)] = float(v)
    epochs = sorted(by_epoch)
    return epochs, [by_epoch[e] for e in epochs]


def search_rows(spec: dict[str, Any], results: Any) -> list[dict[str, Any]]:
    """One row per trial of the search, in point then arm order, with its curve (``epochs``, ``curve``)."""
    rows = []
    for r in results:
        config = r.config or {}
        if POINT_KEY not in config:
            continue
        tid = arm_tid(config[POINT_KEY], config[ARM_KEY])
        root = trial_dir(spec, tid)
        done, refused, state = (
            read_json(root / DONE),
            read_json(root / REFUSED),
            read_json(root / STATE) or {},
        )
        epochs, curve = _curve(r)
        status = "refused" if refused else "finished" if done else "error" if r.error else "stopped"
        n_val = val_images(spec["trials"][base_tid(spec)]["params"], root, ARM_STAGES[config[ARM_KEY]][-1])
        rows.append({"trial": tid, "point": int(config[POINT_KEY]), "arm": config[ARM_KEY],
                     **point_values(config), "status": status, TIME_ATTR: epochs[-1] if epochs else 0,
                     METRIC: curve[-1] if curve else None, "test_acc": (done or {}).get("test_acc"),
                     "val_images": n_val, "mlflow_run_id": state.get("mlflow_run_id"), "epochs": epochs,
                     "curve": curve, "control_key": state.get("control_key"),
                     "control_before": state.get("control_epochs_before"),
                     "config": _config(spec, config)})  # fmt: skip
    return sorted(rows, key=lambda x: (x["point"], ARMS.index(x["arm"])))


def _config(spec: dict[str, Any], config: dict[str, Any]) -> str:
    """What an arm's trial trains, as a key: the T-CNN's point (its own reparam and fine-tuning), the control's
    identity (pipelines.sweep.arm_trial.control_key: points that differ only in ``reparam.*`` have one)."""
    if config[ARM_KEY] != "control":
        return f"point {int(config[POINT_KEY])}"
    return control_key(spec, arm_params(spec, point_values(config)))[0]


def distinct(ranked: list[Any]) -> list[Any]:
    """One candidate per distinct configuration (``config``; a row without it is its own), the best-ranked
    (of equal ones, the lower point index): the control trials of points that differ only in the T-CNN's
    ``reparam.*`` keys are one control fine-tuned once, one candidate, not several tied ones."""
    seen: set[str] = set()
    out = []
    for r in ranked:
        key = r.get("config") or r["trial"]
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def chosen(rows: list[dict[str, Any]], max_t: int) -> dict[str, dict[str, Any] | None]:
    """Each arm's choice: the first of its finished trials ranked by last validation accuracy
    (scheduling.candidates: a tie to the lower point index), with ``candidates`` (how many distinct
    configurations it was chosen among: :func:`distinct`), ``finished_trials`` (its trials that trained every
    epoch: more than ``candidates`` where points share a control), ``configs`` (the distinct configurations
    among all the arm's trials: the most candidates it could have), ``runner_up`` ({trial, val_acc} of the
    second candidate, or None), ``margin_images`` (the lead over the runner-up in validation images: the
    accuracy difference times the images the chosen trial was validated on, or None) and ``tie`` (the runner-up
    had the same accuracy). None for an arm with no finished trial."""
    done = [r for r in rows if r["status"] == "finished"]
    out: dict[str, dict[str, Any] | None] = {}
    for arm in ARMS:
        finished = candidates(done, arm, max_t)
        ranked = distinct(finished)
        if not ranked:
            out[arm] = None
            continue
        best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        n_val = best.get("val_images")
        lead = None if second is None else float(best[METRIC]) - float(second[METRIC])
        configs = len(distinct([r for r in rows if r["arm"] == arm]))
        out[arm] = {**best, "candidates": len(ranked), "finished_trials": len(finished), "configs": configs,
                    "runner_up": None if second is None else {"trial": second["trial"], METRIC: second[METRIC]},
                    "margin_images": None if lead is None or not n_val else round(lead * int(n_val)),
                    "tie": lead == 0}  # fmt: skip
    return out


def epochs_trained(rows: list[dict[str, Any]]) -> int:
    """The compute a search used: fine-tuning epochs trained, over all trials. The control arms that share one
    matched control (``control_key``: points that differ only in ``reparam.*``) trained it once: its epochs
    are the most any of them reported, less those the shared directory held before the first of them started
    (``control_before``: trained by an earlier search or grid in the same storage)."""
    own = sum(int(r[TIME_ATTR]) for r in rows if not r.get("control_key"))
    shared: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("control_key"):
            shared.setdefault(r["control_key"], []).append(r)
    return own + sum(max(0, max(int(r[TIME_ATTR]) for r in rs) - min(int(r.get("control_before") or 0) for r in rs))
                     for rs in shared.values())  # fmt: skip


def close_stopped(spec: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Close each stopped trial's MLflow run FINISHED, tagged stopped at its last epoch (its process was ended
    by Ray while the run was open)."""
    cfg = spec["tracking"]
    stopped = [r for r in rows if r["status"] == "stopped" and r.get("mlflow_run_id")]
    if not cfg["enabled"] or not stopped:
        return
    from stages.tracking.tracker import Tracker

    client = Tracker(enabled=True, uri=cfg["uri"], experiment=cfg["experiment"]).client
    for r in stopped:
        client.set_tag(r["mlflow_run_id"], STATUS_TAG, "stopped")
        client.set_tag(r["mlflow_run_id"], STOPPED_AT_TAG, str(r[TIME_ATTR]))
        client.set_terminated(r["mlflow_run_id"], status="FINISHED")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _space_text(search: SearchConfig) -> str:
    return ", ".join(f"{k} ~ {kind}{_fmt(vals) if kind == 'choice' else '[' + ', '.join(_fmt(v) for v in vals) + ']'}"
                     for k, spec in search.space.items() for kind, vals in spec.items())  # fmt: skip


def head(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What was searched, how, and the compute it used (two sentences)."""
    search, sched, max_t = search_of(spec), scheduler_of(spec), max_epochs(spec)
    if search is None:
        raise ValueError("search_report: the spec holds no sweep.search")
    how = (f"ASHA within each arm (grace period {sched.grace_period}, reduction factor "
           f"{_fmt(sched.reduction_factor)})" if sched else "none: every trial trains every epoch")  # fmt: skip
    trained, reported = epochs_trained(rows), sum(int(r[TIME_ATTR]) for r in rows)
    reused = (f"; {reported - trained} more epochs reported came from shared matched controls, trained once for "
              "the points with the same control identity or before this search" if reported > trained else "")  # fmt: skip
    return [
        f"Search {spec['name']}: {search.num_samples} points x {len(ARMS)} arms ({search.algorithm}, "
        f"seed {search.seed}) over {_space_text(search)}; scheduler: {how}.",
        f"Compute: {trained} fine-tuning epochs trained of {len(rows) * max_t} (every trial to the end){reused}.",
    ]


def table(spec: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The trials as text cells: headers and rows."""
    keys, max_t = list(spec["search"]["space"]), max_epochs(spec)
    headers = ["trial", "arm", *keys, "status", "epochs", "val acc (%)"]
    cells = [[r["trial"], r["arm"], *(_fmt(r.get(k)) for k in keys), r["status"], f"{r[TIME_ATTR]}/{max_t}",
              "" if r[METRIC] is None else f"{100 * r[METRIC]:.2f}"] for r in rows]  # fmt: skip
    return headers, cells


def _against(p: dict[str, Any]) -> str:
    """How a choice was made: among how many candidates, against which runner-up, by how many images."""
    n, second = p["candidates"], p["runner_up"]
    among = f"among {n} candidate{'s' if n != 1 else ''}"
    shared = int(p.get("finished_trials") or n) - n
    if shared > 0:
        among += (f" ({p['finished_trials']} finished trials: points that differ only in reparam.* share one "
                  "control, counted once)")  # fmt: skip
    if second is None:
        return f"{among}: no runner-up"
    other = f"{second['trial']} ({100 * second[METRIC]:.2f}%)"
    if p["tie"]:
        return f"{among}, tied with {other}: the lower point index (sampled earlier) is kept"
    images = (
        ""
        if p["margin_images"] is None
        else f" by {p['margin_images']} of {p['val_images']} validation images"
    )
    return f"{among}, ahead of the runner-up {other}{images}"


def choices(spec: dict[str, Any], picks: dict[str, Any]) -> list[str]:
    """One line per arm: its chosen trial, values and validation accuracy, its candidates and runner-up."""
    keys = list(spec["search"]["space"])
    out = []
    for arm in ARMS:
        p = picks.get(arm)
        out.append(f"{arm}: " + ("no trial of this arm trained every epoch (0 candidates)" if p is None else
                   f"{p['trial']} " + " ".join(f"{k}={_fmt(p[k])}" for k in keys)
                   + f" (validation accuracy {100 * p[METRIC]:.2f}%), {_against(p)}"))  # fmt: skip
    return out


def markdown(spec: dict[str, Any], rows: list[dict[str, Any]], picks: dict[str, Any]) -> str:
    """The search's table and each arm's choice, as printed and as search.md."""
    headers, cells = table(spec, rows)
    lines = [*head(spec, rows), "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    lines += ["", f"Chosen on validation accuracy, each arm among its trials that trained all {max_epochs(spec)} "
              f"epochs (at least {spec['search'].get('min_finished', 1)} kept able to; a stopped trial is never "
              "chosen; a tie goes to the lower point index; the test split does not choose):"]  # fmt: skip
    lines += [f"- {c}" for c in choices(spec, picks)]
    return "\n".join(lines) + "\n"


def report_html(spec: dict[str, Any], rows: list[dict[str, Any]], picks: dict[str, Any], plot: Path) -> Path:
    """``<sweep>/report.html``: the search's sentences, each arm's choice, the trials and the curves."""
    import time

    from core.viz.html import render as render_page

    headers, cells = table(spec, rows)
    text = render_page("search_report.html", name=spec["name"], head=head(spec, rows),
                       choices=choices(spec, picks), headers=headers, rows=cells,
                       plots=[{"title": "validation curves", "alt": plot.name, "data": plot.read_bytes()}],
                       written=time.strftime("%Y-%m-%d %H:%M:%S %Z"))  # fmt: skip
    return atomic_write_text(Path(spec["sweep_dir"]) / "report.html", text)


def parent_metrics(
    spec: dict[str, Any], rows: list[dict[str, Any]], picks: dict[str, Any]
) -> dict[str, float]:
    out: dict[str, float] = {"search_points": float(len({r["point"] for r in rows})),
                             "search_epochs_trained": float(epochs_trained(rows)),
                             "search_epochs_budget": float(len(rows) * max_epochs(spec))}  # fmt: skip
    for arm in ARMS:
        out[f"search_{arm}_stopped"] = float(sum(r["arm"] == arm and r["status"] == "stopped" for r in rows))
        p = picks.get(arm)
        out[f"chosen/{arm}/candidates"] = float(p["candidates"] if p is not None else 0)
        out[f"chosen/{arm}/finished_trials"] = float(p["finished_trials"] if p is not None else 0)
        if p is not None:
            out[f"chosen/{arm}/val_acc"] = float(p[METRIC])
            out[f"chosen/{arm}/tie"] = float(p["tie"])
            if p["runner_up"] is not None:
                out[f"chosen/{arm}/runner_up_val_acc"] = float(p["runner_up"][METRIC])
            if p["margin_images"] is not None:
                out[f"chosen/{arm}/margin_images"] = float(p["margin_images"])
            out.update({f"chosen/{arm}/{k}": float(p[k]) for k in spec["search"]["space"]
                        if isinstance(p.get(k), int | float)})  # fmt: skip
    return out


def write(spec: dict[str, Any], rows: list[dict[str, Any]], picks: dict[str, Any]) -> list[Path]:
    """search.parquet, search.md, chosen.json and the curves plot in the sweep directory."""
    from core.viz.search_plots import search_curves

    sweep_dir = Path(spec["sweep_dir"])
    records = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
    files = [write_table(records, sweep_dir / "search.parquet")]
    files.append(atomic_write_text(sweep_dir / "search.md", markdown(spec, rows, picks)))
    pick = {arm: (None if p is None else {"trial": p["trial"], METRIC: p[METRIC],
                                          **{k: p[k] for k in spec["search"]["space"]},
                                          **{k: p[k] for k in CHOICE_KEYS}, "val_images": p["val_images"]})
            for arm, p in picks.items()}  # fmt: skip
    files.append(atomic_write_json(sweep_dir / "chosen.json", pick))
    key = next(iter(spec["search"]["space"]))
    log = "loguniform" in spec["search"]["space"][key]
    ids = {p["trial"] for p in picks.values() if p is not None}
    curves = [{"arm": r["arm"], "value": r.get(key), "epochs": r["epochs"], "val_acc": r["curve"],
               "stopped": r["status"] == "stopped", "chosen": r["trial"] in ids} for r in rows]  # fmt: skip
    plot = search_curves(curves, key, log, ARMS, sweep_dir / "plots" / "search_curves.png", spec["name"])
    return [*files, plot, report_html(spec, rows, picks, plot)]
