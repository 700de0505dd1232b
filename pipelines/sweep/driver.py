"""The sweep driver (`tcnn sweep`, pipelines/sweep/cli.py): a Ray Tune grid over ``sweep.grid`` with shared
pretraining, exact resume and MLflow.

What happens (the modules of pipelines/sweep/):
1. The params are validated and the grid expanded into trials (plan.py; the spec: spec.py): each trial is
   ``Params.with_overrides(grid values)`` (+ fraction scaling); nothing is written before this succeeds.
2. The driver opens the sweep's MLflow parent run, builds the shared corrupted test sets once
   (``<storage>/corrupt/<key>``), and runs a Ray Tune grid (``tune.grid_search`` over trial ids, per-trial
   CPUs/GPUs from ``sweep.cpus_per_trial/gpus_per_trial``, ``FailureConfig(max_failures)``) whose function
   trainable (trial.py) runs reparam -> finetune -> evaluate in ``<storage>/<name>/trials/<tid>/``,
   pretraining once per group of trials in ``<storage>/pretrain/<key>/`` (shared.py). The Tuner, its
   param_space and run config are tuner.py's.
3. ``--resume`` continues an interrupted sweep through ``Tuner.restore`` (finished trials are not run again;
   each trial reopens its MLflow run); ``--auto-resume`` resumes when the sweep exists and starts it
   otherwise (what a requeued SLURM job runs). A stop signal to a driver run here (SIGTERM, Ctrl-C, ...) ends
   the trials' workers, closes the parent and the open trial runs KILLED and exits 75 (130 for Ctrl-C).
   With ``sweep.select.bracket`` the grid then grows past an edge an arm's choice sits at, one round (and
   one Tune experiment, ``tune-bracket<k>``) at a time, the new trials only (bracket.py).
4. At the end: ``summary.parquet``, plots, the model-kind table (``kinds.md``/``kinds.parquet`` when the
   grid varies ``model``) and ``report.html`` (report.py) in ``<storage>/<name>/`` and on the parent run
   (summary.py; the validation-chosen comparison: selection.py), parent metrics ``trials``,
   ``pretrain_runs`` (pretraining runs this sweep executed) and ``<kind>_clean_accuracy/_mca/_mce``.

``--slurm`` submits the same driver into a SLURM allocation through pipelines.slurm.ray_cluster.launch_ray_cluster (Ray
head on the first node, workers on the others); a requeue restarts the driver, which resumes. A lost worker
node costs only its running trials: SLURM keeps the job (``--no-kill``), Ray declares the node dead, Tune
retries those trials on the remaining nodes (``sweep.max_failures``) and they resume from their stages'
partial state. Each trial's node is in summary.parquet (``node``, ``attempt_nodes``) and on its MLflow run.
``max_failures`` covers faults only: a stage that refuses a trial's inputs (stages.harness.runner.REFUSALS:
a bad value, unreadable data) fails the trial once, with its one line (status ``refused`` and the ``refused``
column of summary.parquet, the MLflow run FAILED and tagged ``tcnn.refused``, a line from the driver), and a
resumed driver does not run it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.utils import mlflow_ui
from core.utils.atomic import append_json_line, atomic_write_json
from pipelines.sweep.plan import SweepError
from pipelines.sweep.settings import search_of, select_of
from pipelines.sweep.spec import SWEEP_JSON, check_resources, reconcile
from pipelines.sweep.tuner import can_restore, check_multinode_tracking, connect_ray, make_tuner, tune_dir
from stages.harness.runner import Stopped


def _final_is_tcnn(kind: str | None) -> bool:
    """A trial of a kind whose final model is a T-CNN (no kind in the row: a sweep of the default kind)."""
    from core.models import kinds

    return kind is None or kinds.get(kind).final_is_tcnn


def say(msg: str) -> None:
    print(f"sweep: {msg}", flush=True)


FROM_SEARCH_TAG = "tcnn.from_search"  # the parent run of a grid made by --from-search: the search's name
#: One line per leg of the driver that ended (stopped or finished): its seconds. ``wall_s`` sums them all.
LEGS = "legs.jsonl"


def earlier_legs_s(sweep_dir: Path) -> float:
    """The wall time of the driver's earlier legs of this sweep (stopped, then resumed), from ``legs.jsonl``."""
    try:
        lines = (sweep_dir / LEGS).read_text().splitlines()
    except FileNotFoundError:
        return 0.0
    return sum(float(json.loads(x)["wall_s"]) for x in lines if x.strip())


def end_leg(sweep_dir: Path, t0: float | None, how: str) -> float:
    """Record this leg (``how``: stopped, finished) in ``legs.jsonl``; returns its seconds."""
    if t0 is None or not sweep_dir.is_dir():
        return 0.0
    wall = time.monotonic() - t0
    append_json_line(sweep_dir / LEGS, {"ended": how, "wall_s": wall, "at": time.time()})
    return wall


def wall_metrics(sweep_dir: Path, t0: float) -> dict[str, float]:
    """``wall_s``: every leg of the driver (the earlier ones from legs.jsonl, this one ended now as finished);
    ``legs``: how many."""
    earlier = earlier_legs_s(sweep_dir)
    n = len((sweep_dir / LEGS).read_text().splitlines()) if (sweep_dir / LEGS).is_file() else 0
    return {"wall_s": earlier + end_leg(sweep_dir, t0, "finished"), "legs": float(n + 1)}


# --------------------------------------------------------------------------------------------- driver


LOCK = ".driver.lock"


@contextlib.contextmanager
def driver_lock(sweep_dir: Path) -> Any:
    """One driver per sweep: an flock on ``<sweep>/.driver.lock``, removed when the driver ends (while it still
    holds the lock; a driver that took the lock of a file removed meanwhile sees another inode and is refused)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / LOCK
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not path.exists() or path.stat().st_ino != os.fstat(fh.fileno()).st_ino:
                raise BlockingIOError
        except BlockingIOError:
            raise SweepError(
                f"sweep {sweep_dir.name!r}: another driver is running it ({sweep_dir})"
            ) from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _open_parent(spec: dict) -> Any:
    from stages.tracking.names import UV_LOCK_FILE, UV_LOCK_TAG, digest_if_present
    from stages.tracking.tracker import Tracker

    t = spec["tracking"]
    tracker = Tracker(enabled=t["enabled"], uri=t["uri"], experiment=t["experiment"])
    if not tracker.enabled:
        return tracker
    tags = {"tcnn.kind": "parent", "tcnn.sweep": spec["name"], "tcnn.sweep_dir": spec["sweep_dir"],
            UV_LOCK_TAG: digest_if_present(UV_LOCK_FILE)}  # fmt: skip
    if origin := spec.get("from_search"):  # a grid at a search's choices (tcnn sweep --from-search)
        tags |= {FROM_SEARCH_TAG: origin["name"], f"{FROM_SEARCH_TAG}_dir": origin["sweep_dir"]}
    tracker.start_parent(f"sweep:{spec['name']}", tags, run_id=t.get("parent_run_id") or None)
    if tracker.parent_created:
        tracker.log_environment()
    params = {f"grid.{k}": json.dumps(v) for k, v in spec["grid"].items()}
    params.update({"sweep.name": spec["name"], "sweep.share_pretraining": str(spec["share_pretraining"])})
    tracker.log_params(params)
    return tracker


def run_sweep(
    spec: dict,
    *,
    address: str | None = "local",
    resume: str = "no",
    num_cpus: int | None = None,
    object_store_mb: int | None = None,
) -> dict:
    """Run (or resume) the sweep described by ``spec``; ``address=None``: Ray is already initialized (SLURM).

    Returns {"trials", "finished", "failed", "pretrain_runs", "sweep_dir", "summary", "parent_run_id"}.
    """
    import ray

    spec = reconcile(spec, resume)
    owns = connect_ray(address, num_cpus, object_store_mb) if address is not None else False
    tracker: Any = None
    sweep_dir = Path(spec["sweep_dir"])
    new = not sweep_dir.exists()  # this driver creates it: a failure before any trial ran leaves nothing
    held = (
        False  # this driver holds the sweep's lock (a refused second driver touches nothing of the first's)
    )
    t0: float | None = None
    try:
        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        nodes = len(alive)
        check_multinode_tracking(spec, nodes)
        check_resources(spec, alive, "this Ray cluster" if address != "local" else "the local Ray")
        with driver_lock(sweep_dir):
            held = True
            spec = reconcile(spec, "auto")  # a requeued or resumed driver: the saved uid and parent run
            spec["uid"] = spec.get("uid") or uuid.uuid4().hex
            tracker = _open_parent(spec)
            spec["tracking"]["parent_run_id"] = tracker.parent_run_id
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)
            _announce(spec, nodes, sweep_dir)
            t0 = time.monotonic()
            if spec.get("search") is not None:
                return _search(spec, tracker, sweep_dir, t0)
            _ensure_corrupted(spec, list(spec["corrupt"]))
            spec, status = _run_rounds(spec)
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)  # with why bracketing stopped
            return _finish(spec, status, tracker, sweep_dir, t0)
    except (Stopped, SystemError) as err:
        stop = _stop_of(err)
        if stop is None:
            if owns:
                ray.shutdown()
                owns = False
            _end_failed(tracker, sweep_dir, held=held, new=new)
            raise
        if owns:  # the trials' workers end first, so that no trial writes to its run after it is closed
            ray.shutdown()
            owns = False
        _close_stopped(tracker)
        end_leg(Path(spec["sweep_dir"]), t0, "stopped")  # wall_s at the end counts this leg too
        raise stop from None
    except Exception:
        # A refusal (one line, 2), a file or the store that failed (one line, 74) or a bug (its traceback): the
        # trials end first, then the runs end FAILED, and a new sweep that failed before any trial ran leaves
        # no directory behind.
        if owns:
            ray.shutdown()
            owns = False
        _end_failed(tracker, sweep_dir, held=held, new=new)
        raise
    finally:
        if owns:
            ray.shutdown()


def _search(spec: dict, tracker: Any, sweep_dir: Path, t0: float) -> dict:
    """A search (``sweep.search``): its Tune experiment (run or restored), then its report
    (pipelines/sweep/search_report.py) on the parent run; the parent ends FINISHED when every arm chose."""
    from pipelines.sweep import search_report as sr
    from pipelines.sweep import shared
    from pipelines.sweep.tuner import make_search_tuner

    path = sweep_dir / tune_dir(0)
    restore = can_restore(path)
    if restore:
        say(f"resuming from {path}")
    rows = sr.search_rows(spec, make_search_tuner(spec, restore).fit())
    sr.close_stopped(spec, rows)
    picks = sr.chosen(rows, sr.max_epochs(spec))
    files = sr.write(spec, rows, picks)
    runs = shared.pretrain_runs(sweep_dir)
    metrics = {**sr.parent_metrics(spec, rows, picks), "pretrain_runs": runs, **wall_metrics(sweep_dir, t0)}
    failed = sum(r["status"] in ("error", "refused") for r in rows)  # a stopped trial did not fail
    tracker.log_metrics(metrics)
    if tracker.enabled:
        for p in files:
            tracker.log_artifact(p, "plots" if p.suffix == ".png" else None)
        tracker.log_dict(spec["search"], "search.json")
        tracker.end_parent("FINISHED" if all(picks.values()) and not failed else "FAILED")
    atomic_write_json(sweep_dir / "metrics.json", metrics)
    print(sr.markdown(spec, rows, picks), flush=True)
    for r in rows:
        if r["status"] in ("error", "refused"):
            say(f"trial {r['trial']}: {r['status']}")
    finished = sum(r["status"] == "finished" for r in rows)
    say(
        f"{finished}/{len(rows)} search trials trained every epoch, {failed} failed; report {sweep_dir / 'search.md'}"
    )
    return {"trials": len(rows), "finished": finished, "failed": failed,
            "pretrain_runs": runs, "sweep_dir": str(sweep_dir), "summary": str(files[0]),
            "plots": [str(p) for p in files if p.suffix == ".png"], "parent_run_id": spec["tracking"]["parent_run_id"],
            "chosen": {arm: (p or {}).get("trial") for arm, p in picks.items()}}  # fmt: skip


def _announce(spec: dict, nodes: int, sweep_dir: Path) -> None:
    """The driver's first line: how many trials and pretraining groups, on how many nodes, with what."""
    if (s := search_of(spec)) is not None:
        say(f"{spec['name']}: search of {s.num_samples} points x 2 arms ({s.algorithm}), "
            f"{nodes} Ray node(s), {spec['resources']['cpu']} CPU / {spec['resources']['gpu']} GPU per trial "
            f"-> {sweep_dir}")  # fmt: skip
        return
    n = len(spec["trials"])
    groups = len(spec["groups"]) if spec["share_pretraining"] else n
    say(
        f"{spec['name']}: {n} trials, {groups} pretraining group(s), {nodes} Ray node(s), "
        f"{spec['resources']['cpu']} CPU / {spec['resources']['gpu']} GPU per trial -> {sweep_dir}"
    )


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


def _finish(spec: dict, status: dict[str, str], tracker: Any, sweep_dir: Path, t0: float) -> dict:
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
    from pipelines.sweep import bracket, report, selection, summary, tables

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
    picked = report.selected_table(chosen, chosen_seeds, select_of(spec).over, notes) if chosen else None
    files.append(report.write_report(spec, rows, krows, plots, sweep_dir, srows, picked))
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


def _ensure_corrupted(spec: dict, keys: list[str]) -> None:
    """The shared corrupted test sets of ``keys`` (built once; later calls check them)."""
    from pipelines.sweep import shared

    for key in keys:
        shared.ensure_corrupted(spec, key)


def _fit(spec: dict, k: int) -> dict[str, str]:
    """Run (or resume) round ``k``'s trials in their Tune experiment; their Tune status by trial id."""
    from pipelines.sweep.bracket import round_trials

    tids = round_trials(spec, k)
    if not tids:
        return {}
    path = Path(spec["sweep_dir"]) / tune_dir(k)
    restore = can_restore(path)
    if restore:
        say(f"resuming from {path}")
    status = {}
    for r in make_tuner(spec, restore, tids, tune_dir(k)).fit():
        tid = (r.config or {}).get("tid")
        if tid:
            status[tid] = "error" if r.error else "terminated"
    return status


def _run_rounds(spec: dict) -> tuple[dict, dict[str, str]]:
    """The asked trials, then the bracketing rounds (pipelines/sweep/bracket.py): those an earlier driver
    of this sweep added (finished if they are not), then new ones while the rule adds values. Returns the
    spec (with every added trial; saved to sweep.json before its trials run) and the trials' Tune status."""
    from pipelines.sweep import bracket, summary

    status, k = _fit(spec, 0), 0
    spec["bracket_stop"] = None
    while True:
        if k < len(bracket.rounds(spec)):
            k += 1
            status |= _fit(spec, k)
            continue
        settings = bracket.settings(spec)
        if settings is None:
            return spec, status
        done = sum(r["key"] == settings.key for r in bracket.rounds(spec))
        rows = summary.summary_rows(spec, status)
        step = bracket.decide(rows, list(spec["grid"]), select_of(spec), settings, done)
        before = set(spec["corrupt"])
        if step.stop is None:
            try:
                spec, added = bracket.extend(spec, step)
            except SweepError as err:
                values = ", ".join(str(v) for v in step.add)
                step = bracket.Step(stop=f"{settings.key}={values} not added: {err}")
        if step.stop is not None:
            spec["bracket_stop"] = step.stop
            say(f"bracketing: {step.stop}")
            return spec, status
        for why in step.reasons:
            say(f"bracketing round {k + 1}: {why}")
        say(f"bracketing round {k + 1}: {len(added)} new trial(s)")
        _ensure_corrupted(spec, [c for c in spec["corrupt"] if c not in before])
        atomic_write_json(Path(spec["sweep_dir"]) / SWEEP_JSON, spec)


def _stop_of(err: BaseException) -> Stopped | None:
    """The stop signal behind ``err``: a Stopped raised by the signal handler while Ray's Cython core was
    waiting comes out as ``SystemError(... returned a result with an exception set)`` caused by it."""
    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, Stopped):
        seen = seen.__cause__ or seen.__context__
    return seen


def _close_stopped(tracker: Any) -> None:
    """A stopped driver ends its MLflow parent and every trial run still open under it as KILLED (a resume
    reopens them: trial_tracking.open_run)."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    tracker.close_children(tracker.parent_run_id, "KILLED", reason="the sweep driver was stopped")
    tracker.end_parent("KILLED")


def _end_failed(tracker: Any, sweep_dir: Path, *, held: bool, new: bool) -> None:
    """What a driver that failed leaves once its trials ended: its runs FAILED (:func:`_close_failed`) and, for
    a sweep it created, no directory if no trial ran. Nothing of a sweep whose lock it did not get."""
    if not held:
        return
    _close_failed(tracker)
    if new:
        _remove_if_unstarted(sweep_dir)


def _remove_if_unstarted(sweep_dir: Path) -> None:
    """Remove the directory of a new sweep that failed before any trial ran: it holds only sweep.json (and the
    lock), which would make the same command a "sweep exists" refusal instead of a fresh start."""
    left = {p.name for p in sweep_dir.iterdir()} if sweep_dir.is_dir() else set()
    if left <= {SWEEP_JSON, LOCK}:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def _close_failed(tracker: Any) -> None:
    """A driver ended by an I/O or store fault, or by a bug, ends its MLflow parent and every trial run still
    open under it as FAILED, as far as the store still takes writes."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    with contextlib.suppress(Exception):
        tracker.close_children(tracker.parent_run_id, "FAILED", reason="the sweep driver failed")
    with contextlib.suppress(Exception):
        tracker.end_parent("FAILED")


def slurm_driver(spec: dict, num_cpus: int | None = None) -> dict:
    """The driver inside the SLURM job (Ray already up on the allocation): start, or resume after a requeue."""
    return run_sweep(spec, address=None, resume="auto", num_cpus=num_cpus)
