"""`tcnn sweep`: a Ray Tune grid over ``sweep.grid`` with shared pretraining, exact resume and MLflow.

    tcnn sweep --params params.yaml [-S key=value ...] [--address local|auto|HOST:PORT] [--name NAME]
               [--resume | --auto-resume] [--num-cpus N]
    tcnn sweep --params params.yaml --slurm [--nodes N] [--cpus-per-node C] [--gpus-per-node [TYPE:]G]
               [--partition P] [--sbatch KEY=VALUE ...] [--time MIN] [--detach]
               [--worker-placement pack|spread|...]

What happens (pieces in pipelines/sweep_*.py):
1. The params are validated and the grid expanded into trials (sweep_plan): each trial is
   ``Params.with_overrides(grid values)`` (+ fraction scaling); nothing is written before this succeeds.
2. The driver opens the sweep's MLflow parent run, builds the shared corrupted test sets once
   (``<storage>/corrupt/<key>``), and runs a Ray Tune grid (``tune.grid_search`` over trial ids, per-trial
   CPUs/GPUs from ``sweep.cpus_per_trial/gpus_per_trial``, ``FailureConfig(max_failures)``) whose function
   trainable (sweep_trial) runs reparam -> finetune -> evaluate in ``<storage>/<name>/trials/<tid>/``,
   pretraining once per group of trials in ``<storage>/pretrain/<key>/`` (sweep_shared).
3. ``--resume`` continues an interrupted sweep through ``Tuner.restore`` (finished trials are not run again;
   each trial reopens its MLflow run); ``--auto-resume`` resumes when the sweep exists and starts it
   otherwise (what a requeued SLURM job runs). A stop signal to a driver run here (SIGTERM, Ctrl-C, ...) ends
   the trials' workers, closes the parent and the open trial runs KILLED and exits 75 (130 for Ctrl-C).
   With ``sweep.select.bracket`` the grid then grows past an edge an arm's choice sits at, one round (and
   one Tune experiment, ``tune-bracket<k>``) at a time, the new trials only (sweep_bracket).
4. At the end: ``summary.parquet``, plots, the model-kind table (``kinds.md``/``kinds.parquet`` when the
   grid varies ``model``) and ``report.html`` (sweep_report) in ``<storage>/<name>/`` and on the parent run
   (sweep_summary), parent metrics ``trials``, ``pretrain_runs`` (pretraining runs this sweep executed) and
   ``<kind>_clean_accuracy/_mca/_mce``.

``--slurm`` submits the same driver into a SLURM allocation through pipelines.slurm.launch_ray_cluster (Ray
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

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError, Params, load_params
from core.utils import mlflow_ui
from core.utils.atomic import atomic_write_json
from pipelines.ddp import PLACEMENTS
from pipelines.sweep_plan import (
    SweepError,
    check_name,
    default_name,
    make_plan,
    plan_device,
    plan_spec,
    spec_difference,
    trial_label,
)
from stages.harness.runner import EXIT_IOERR, Stopped, io_error_line, stop_on_signals

SWEEP_JSON = "sweep.json"
TUNE_DIR = "tune"
ADDRESS_RE = re.compile(r"^(local|auto|ray://[^\s:/]+:\d{1,5}|[^\s:/]+:\d{1,5})$")
LOCAL_OBJECT_STORE_MB = 256


def _final_is_tcnn(kind: str | None) -> bool:
    """A trial of a kind whose final model is a T-CNN (no kind in the row: a sweep of the default kind)."""
    from core.models import kinds

    return kind is None or kinds.get(kind).final_is_tcnn


def say(msg: str) -> None:
    print(f"sweep: {msg}", flush=True)


# ------------------------------------------------------------------------------------------- the spec


def tracking_enabled(params: Params) -> bool:
    """``tracking.enabled``, unless ``TCNN_TRACKING=0`` switches it off (as for the stages)."""
    return params.tracking.enabled and os.environ.get("TCNN_TRACKING") != "0"


def build_spec(
    params: Params,
    *,
    name: str | None,
    params_file: Path,
    cwd: Path | None = None,
    placement: str = "pack",
) -> dict:
    """Validate and plan the sweep; the returned spec is all a driver and its trials need (JSON-able).
    ``placement``: how Ray places a trial's data-parallel workers (pipelines.ddp.PLACEMENTS)."""
    from stages.harness.tracking_names import resolve_uri

    cwd = Path(cwd or Path.cwd()).resolve()
    sw = params.sweep
    uri = resolve_uri(params.tracking.uri, cwd)
    plan = make_plan(params, cwd=cwd, device=plan_device(params), tracking_uri=uri)
    name = check_name(name or default_name(params_file, params))
    spec = plan_spec(plan, name=name, share_pretraining=sw.share_pretraining)
    spec.update(
        {
            "tracking": {
                "enabled": tracking_enabled(params),
                "uri": uri,
                "experiment": params.tracking.experiment,
                "parent_run_id": None,
            },
            **trial_resources(params),
            "select": sw.select.model_dump(mode="json"),
            "bracket": _bracket_settings(params),
            "bracket_rounds": [],
            "cwd": str(cwd),  # where relative paths resolve when bracketing plans more trials
            "max_failures": sw.max_failures,
            "placement": placement,
            "uid": None,
        }
    )
    return spec


def _bracket_settings(params: Params) -> dict[str, Any] | None:
    """``sweep.select.bracket`` as the driver uses it (pipelines/sweep_bracket.py): key, ratio, bound."""
    from core.config import bracket_key, log_step

    sel = params.sweep.select
    key = bracket_key(sel)
    if key is None or sel.bracket is None:
        return None
    return {"key": key, "ratio": log_step(params.sweep.grid[key]), "max_rounds": sel.bracket.max_rounds}


def trial_resources(params: Params) -> dict[str, Any]:
    """Ray resources of a trial. With ``workers_per_trial`` W > 1 its stages run as Ray Train workers (W for
    training, one for reparam and evaluate: pipelines/ddp.py), each holding 1/W of ``sweep.cpus_per_trial`` /
    ``gpus_per_trial``; the trial process (the TorchTrainer driver, the corrupted sets) holds one more CPU
    share and no GPU: (W + 1) / W of the CPUs and exactly the GPUs asked for."""
    sw, w = params.sweep, params.workers_per_trial
    share = {"cpu": sw.cpus_per_trial / w, "gpu": sw.gpus_per_trial / w}
    return {
        "resources": share if w == 1 else {"cpu": share["cpu"], "gpu": 0.0},
        "workers": w,
        "worker_resources": share,
        "threads": max(1, int(share["cpu"])),
    }


def load_saved(spec: dict) -> dict | None:
    path = Path(spec["sweep_dir"]) / SWEEP_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise SweepError(
            f"{path}: unreadable sweep state; remove the sweep directory to start over"
        ) from None


def reconcile(spec: dict, resume: str) -> dict:
    """``resume``: "no" (the sweep must not exist), "yes" (it must), "auto". Returns the spec to run."""
    saved = load_saved(spec)
    where = spec["sweep_dir"]
    if saved is None:
        if resume == "yes":
            raise SweepError(f"--resume: no sweep {spec['name']!r} in {where} (drop --resume to start it)")
        return spec
    if resume == "no":
        raise SweepError(
            f"sweep {spec['name']!r} exists in {where}: pass --resume to continue it, or --name for a new one"
        )
    from pipelines.sweep_bracket import asked

    diff = spec_difference(asked(saved), asked(spec))  # the trials bracketing added are the sweep's own
    if diff is not None:
        raise SweepError(
            f"--resume: the params differ from those sweep {spec['name']!r} started with: {diff}"
        )
    merged = dict(saved)
    merged["tracking"] = {**spec["tracking"], "parent_run_id": saved.get("tracking", {}).get("parent_run_id")}
    merged["placement"] = spec.get("placement", "pack")  # where workers go does not change results
    # How the results are chosen and bracketed is the params' of this run (a larger max_rounds goes on).
    merged |= {
        "select": spec["select"],
        "bracket": spec.get("bracket"),
        "cwd": saved.get("cwd", spec.get("cwd")),
    }
    return merged


# ------------------------------------------------------------------------------------------------ Ray


def check_address(address: str) -> str:
    if not ADDRESS_RE.match(address or ""):
        raise SweepError(f"--address {address!r}: expected local, auto, HOST:PORT or ray://HOST:PORT")
    return address


def connect_ray(address: str, num_cpus: int | None, object_store_mb: int | None) -> bool:
    """Connect (or start a light local Ray); returns whether this process started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address != "local":
        from pipelines.slurm import align_ray_auth

        align_ray_auth()  # a cluster from `ray start` (sweep.sbatch) uses token auth when a token exists
    term = signal.getsignal(signal.SIGTERM)
    try:
        if address == "local":
            ray.init(
                num_cpus=num_cpus or os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=int((object_store_mb or LOCAL_OBJECT_STORE_MB) * 1024 * 1024),
                logging_level="WARNING",
            )
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except Exception as err:  # ConnectionError, ValueError, RuntimeError from Ray
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SweepError(f"--address {address}: cannot connect to Ray ({first})") from None
    if getattr(term, "tcnn_stage_handler", False):  # ray.init set SIGTERM -> sys.exit: keep the driver's
        signal.signal(signal.SIGTERM, term)
    return True


def check_multinode_tracking(spec: dict, nodes: int) -> None:
    t = spec["tracking"]
    if nodes > 1 and t["enabled"] and not t["uri"].startswith(("http://", "https://")):
        raise SweepError(
            f"tracking.uri {t['uri']}: a sweep on {nodes} nodes needs an MLflow server (http://HOST:PORT; "
            "infra/mlflow/server.sh), not a local store"
        )


def _trial_dirname(trial: Any) -> str:
    return str(trial.config["tid"])


def _tune_order(spec: dict) -> list[str]:
    """Trial ids, the groups interleaved: concurrent first trials start different pretraining groups."""
    if not spec["share_pretraining"]:
        return list(spec["trials"])
    queues = [list(g["trials"]) for g in spec["groups"].values()]
    order: list[str] = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


def _progress_callback(spec: dict, tids: list[str]) -> Any:
    from pipelines.sweep_progress import SweepProgress

    return SweepProgress({tid: trial_label(spec["trials"][tid]["overrides"]) for tid in tids})


def tune_dir(k: int) -> str:
    """The Tune experiment of round ``k``: 0 runs the asked grid, k >= 1 the trials bracketing added."""
    return TUNE_DIR if k == 0 else f"{TUNE_DIR}-bracket{k}"


def _tuner(spec: dict, restore: bool, tids: list[str], name: str = TUNE_DIR) -> Any:
    from ray import tune

    from pipelines.sweep_trial import tune_trainable

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    os.environ.setdefault("TUNE_RESULT_BUFFER_LENGTH", "1")
    trainable = tune.with_resources(tune.with_parameters(tune_trainable, spec=spec), spec["resources"])
    path = Path(spec["sweep_dir"]) / name
    if restore:
        return tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    return tune.Tuner(
        trainable,
        param_space={"tid": tune.grid_search([t for t in _tune_order(spec) if t in set(tids)])},
        tune_config=tune.TuneConfig(
            trial_dirname_creator=_trial_dirname,
            reuse_actors=True,  # one actor runs trial after trial: torch/timm are imported once per worker
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=spec["sweep_dir"],
            failure_config=tune.FailureConfig(max_failures=spec["max_failures"]),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),  # tiny: {run id, stage}
            verbose=0,
            callbacks=[_progress_callback(spec, tids)],
        ),
    )


# --------------------------------------------------------------------------------------------- driver


@contextlib.contextmanager
def driver_lock(sweep_dir: Path) -> Any:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / ".driver.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(
                f"sweep {sweep_dir.name!r}: another driver is running it ({sweep_dir})"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _open_parent(spec: dict) -> Any:
    from stages.harness.tracking import Tracker
    from stages.harness.tracking_names import UV_LOCK_FILE, UV_LOCK_TAG, digest_if_present

    t = spec["tracking"]
    tracker = Tracker(enabled=t["enabled"], uri=t["uri"], experiment=t["experiment"])
    if not tracker.enabled:
        return tracker
    tags = {"tcnn.kind": "parent", "tcnn.sweep": spec["name"], "tcnn.sweep_dir": spec["sweep_dir"],
            UV_LOCK_TAG: digest_if_present(UV_LOCK_FILE)}  # fmt: skip
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
    try:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        check_multinode_tracking(spec, nodes)
        sweep_dir = Path(spec["sweep_dir"])
        with driver_lock(sweep_dir):
            spec = reconcile(spec, "auto")  # a requeued or resumed driver: the saved uid and parent run
            spec["uid"] = spec.get("uid") or uuid.uuid4().hex
            tracker = _open_parent(spec)
            spec["tracking"]["parent_run_id"] = tracker.parent_run_id
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)
            _announce(spec, nodes, sweep_dir)
            _ensure_corrupted(spec, list(spec["corrupt"]))
            t0 = time.monotonic()
            spec, status = _run_rounds(spec)
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)  # with why bracketing stopped
            return _finish(spec, status, tracker, sweep_dir, t0)
    except (Stopped, SystemError) as err:
        stop = _stop_of(err)
        if stop is None:
            raise
        if owns:  # the trials' workers end first, so that no trial writes to its run after it is closed
            ray.shutdown()
            owns = False
        _close_stopped(tracker)
        raise stop from None
    except Exception as err:
        if io_error_line(err) is not None:  # a file or the store failed: the trials end first, then the runs
            if owns:
                ray.shutdown()
                owns = False
            _close_failed(tracker)
        raise
    finally:
        if owns:
            ray.shutdown()


def _announce(spec: dict, nodes: int, sweep_dir: Path) -> None:
    """The driver's first line: how many trials and pretraining groups, on how many nodes, with what."""
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
    srows: list[dict]  # over-seed rows (sweep_summary.seed_rows)
    krows: list[dict]  # model-kind rows (sweep_summary.kind_rows)
    summary: Path  # summary.parquet
    plots: list[Path]
    files: list[Path]  # the other artifacts of the parent run (kinds, seeds, bracket, selection, report)
    bracketed: bool
    notes: list[str]  # what bracketing added and why
    chosen: list[dict]  # the validation-chosen rows (sweep_select.selected_rows)
    chosen_seeds: list[dict]  # their over-seed rows


def _finish(spec: dict, status: dict[str, str], tracker: Any, sweep_dir: Path, t0: float) -> dict:
    """The end of a sweep whose trials ran: its outputs, the parent run's metrics, tags and artifacts (the
    parent ends FINISHED when every trial finished, FAILED otherwise), metrics.json, the printed tables and
    the last line. Returns run_sweep's result."""
    from pipelines import sweep_bracket, sweep_shared, sweep_summary

    n = len(spec["trials"])
    out = _write_outputs(spec, status, sweep_dir)
    finished = sum(r["status"] == "finished" for r in out.rows)
    runs = sweep_shared.pretrain_runs(sweep_dir)
    metrics = _parent_metrics(spec, out, n, finished, runs)
    if out.bracketed:
        tracker.set_tags(sweep_bracket.tags(spec))
    metrics["wall_s"] = time.monotonic() - t0
    _log_parent(tracker, spec, out, metrics, "FINISHED" if finished == n else "FAILED")
    atomic_write_json(sweep_dir / "metrics.json", metrics)
    _print_outputs(spec, out)
    for r in out.rows:  # a refusal is the trial's one line, not a traceback: the user fixes the params
        if r["status"] == "refused":
            say(f"trial {r['trial']} refused: {r['refused']}")
        if why := sweep_summary.cnn_evaluation_reason(r):  # said in the trial's log: the driver says it too
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
    from pipelines import sweep_bracket, sweep_report, sweep_select, sweep_summary

    rows = sweep_summary.summary_rows(spec, status)
    srows = sweep_summary.seed_rows(spec, rows)
    summary = sweep_summary.write_table(
        sweep_summary.with_seed_columns(rows, srows, spec), sweep_dir / "summary.parquet"
    )
    krows = sweep_summary.kind_rows(spec, rows)
    try:
        plots = sweep_summary.make_plots(spec, rows, sweep_dir / "plots", krows)
    except Exception as err:  # a plot must not cost the sweep its summary and parent run
        say(f"warning: plots failed ({type(err).__name__}: {err})")
        plots = []
    files = sweep_summary.write_kinds(krows, sweep_dir) if krows else []
    files += sweep_summary.write_seeds(srows, sweep_dir) if srows else []
    bracketed = spec.get("bracket") is not None or bool(sweep_bracket.rounds(spec))
    notes = sweep_bracket.notes(spec) if bracketed else []
    if bracketed:
        files.append(atomic_write_json(sweep_dir / "bracket.json", sweep_bracket.record(spec)))
    chosen = sweep_select.selected_rows(spec, rows)
    chosen_seeds = sweep_select.over_seeds(chosen)
    if chosen:
        files += _write_selection(spec, rows, chosen, chosen_seeds, sweep_dir, notes)
    picked = (
        sweep_report.selected_table(chosen, chosen_seeds, spec["select"]["over"], notes) if chosen else None
    )
    files.append(sweep_report.write_report(spec, rows, krows, plots, sweep_dir, srows, picked))
    return _Outputs(rows, srows, krows, summary, plots, files, bracketed, notes, chosen, chosen_seeds)


def _write_selection(
    spec: dict,
    rows: list[dict],
    chosen: list[dict],
    chosen_seeds: list[dict],
    sweep_dir: Path,
    notes: list[str],
) -> list[Path]:
    """The validation-chosen rows, their over-seed rows and the finished trials pooled per value
    (pipelines/sweep_select.py); returns the files written."""
    from pipelines import sweep_select

    over = spec["select"]["over"]
    sel = spec["select"]
    done = [r for r in rows if r["status"] == "finished"]
    pool = sweep_select.pooled(done, list(spec["grid"]), over, sel.get("by", "val_accuracy"))
    return sweep_select.write(chosen, chosen_seeds, over, sweep_dir, notes, pool)


def _parent_metrics(spec: dict, out: _Outputs, n: int, finished: int, runs: int) -> dict[str, Any]:
    """The parent run's metrics (all but ``wall_s``): trial counts, the best fine-tuned T-CNN's clean
    accuracy, the kind, seed and selection metrics and, bracketed, how many rounds ran."""
    from pipelines import sweep_bracket, sweep_select, sweep_summary

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
    metrics.update(sweep_summary.kind_metrics(out.krows))
    metrics.update(sweep_summary.seed_metrics(out.srows))
    metrics.update(sweep_select.selection_metrics(out.chosen, out.chosen_seeds))
    if out.bracketed:
        metrics["bracket_rounds"] = len(sweep_bracket.rounds(spec))
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
    """The summary table, then the kind, seed and selection tables (or the bracketing notes) there are."""
    from pipelines import sweep_select, sweep_summary

    print(sweep_summary.format_table(out.rows, list(spec["grid"])), flush=True)
    if out.krows:
        print(sweep_summary.kinds_markdown(out.krows), flush=True)
    if out.srows:
        print(sweep_summary.seeds_markdown(out.srows), flush=True)
    if out.chosen:
        over = spec["select"]["over"]
        print(sweep_select.markdown(out.chosen, out.chosen_seeds, over, out.notes), flush=True)
    elif out.notes:
        print("\n".join(["Bracketing:", *out.notes]), flush=True)


def _ensure_corrupted(spec: dict, keys: list[str]) -> None:
    """The shared corrupted test sets of ``keys`` (built once; later calls check them)."""
    from pipelines import sweep_shared

    for key in keys:
        sweep_shared.ensure_corrupted(spec, key)


def _fit(spec: dict, k: int) -> dict[str, str]:
    """Run (or resume) round ``k``'s trials in their Tune experiment; their Tune status by trial id."""
    from pipelines.sweep_bracket import round_trials

    tids = round_trials(spec, k)
    if not tids:
        return {}
    path = Path(spec["sweep_dir"]) / tune_dir(k)
    restore = _can_restore(path)
    if restore:
        say(f"resuming from {path}")
    status = {}
    for r in _tuner(spec, restore, tids, tune_dir(k)).fit():
        tid = (r.config or {}).get("tid")
        if tid:
            status[tid] = "error" if r.error else "terminated"
    return status


def _run_rounds(spec: dict) -> tuple[dict, dict[str, str]]:
    """The asked trials, then the bracketing rounds (pipelines/sweep_bracket.py): those an earlier driver
    of this sweep added (finished if they are not), then new ones while the rule adds values. Returns the
    spec (with every added trial; saved to sweep.json before its trials run) and the trials' Tune status."""
    from pipelines import sweep_bracket, sweep_summary

    status, k = _fit(spec, 0), 0
    spec["bracket_stop"] = None
    while True:
        if k < len(sweep_bracket.rounds(spec)):
            k += 1
            status |= _fit(spec, k)
            continue
        settings = sweep_bracket.settings(spec)
        if settings is None:
            return spec, status
        done = sum(r["key"] == settings["key"] for r in sweep_bracket.rounds(spec))
        rows = sweep_summary.summary_rows(spec, status)
        step = sweep_bracket.decide(rows, list(spec["grid"]), spec["select"], settings, done)
        before = set(spec["corrupt"])
        if step.stop is None:
            try:
                spec, added = sweep_bracket.extend(spec, step)
            except SweepError as err:
                values = ", ".join(str(v) for v in step.add)
                step = sweep_bracket.Step(stop=f"{settings['key']}={values} not added: {err}")
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
    reopens them: sweep_trial.open_run)."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    tracker.close_children(tracker.parent_run_id, "KILLED", reason="the sweep driver was stopped")
    tracker.end_parent("KILLED")


def _close_failed(tracker: Any) -> None:
    """A driver ended by an I/O or store fault ends its MLflow parent and every trial run still open under it
    as FAILED, as far as the store still takes writes."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    with contextlib.suppress(Exception):
        tracker.close_children(tracker.parent_run_id, "FAILED", reason="the sweep driver failed")
    with contextlib.suppress(Exception):
        tracker.end_parent("FAILED")


def _can_restore(path: Path) -> bool:
    from ray import tune

    return path.is_dir() and tune.Tuner.can_restore(str(path))


def slurm_driver(spec: dict, num_cpus: int | None = None) -> dict:
    """The driver inside the SLURM job (Ray already up on the allocation): start, or resume after a requeue."""
    return run_sweep(spec, address=None, resume="auto", num_cpus=num_cpus)


# ---------------------------------------------------------------------------------------------- SLURM


def submit_slurm(spec: dict, args: argparse.Namespace) -> int:
    from pipelines.slurm import (
        RayClusterConfig,
        RayPorts,
        gpu_count,
        launch_ray_cluster,
        make_executor,
        sbatch_options,
    )

    if args.nodes < 1:
        raise SweepError(f"--nodes {args.nodes}: must be at least 1")
    try:
        extra = sbatch_options(args.sbatch)
        count = gpu_count(args.gpus_per_node)
        gpus = args.gpus_per_node if ":" in args.gpus_per_node else count  # TYPE:N as given
    except ValueError as err:
        raise SweepError(str(err)) from None
    check_multinode_tracking(spec, args.nodes)
    w = spec.get("workers", 1)
    cpus = args.cpus_per_node or max(1, math.ceil(spec["resources"]["cpu"] * (w + 1 if w > 1 else 1)))
    sweep_dir = Path(spec["sweep_dir"])
    folder = sweep_dir / "slurm"
    if args.ray_port:
        ports = RayPorts.from_base(args.ray_port)
    else:
        ports = RayPorts.find_free() if args.nodes == 1 else RayPorts()
    executor = make_executor(
        folder,
        nodes=args.nodes,
        cpus_per_node=cpus,
        gpus_per_node=gpus,
        mem_gb=args.mem_gb,
        timeout_min=args.time,
        partition=args.partition,
        job_name=f"tcnn-sweep-{spec['name']}"[:60],
        additional=extra,
    )
    config = RayClusterConfig(
        ports=ports,
        object_store_memory=int(args.object_store_mb * 1024 * 1024) if args.object_store_mb else None,
    )
    job = launch_ray_cluster(executor, slurm_driver, spec, config=config, rendezvous_dir=folder)
    say(f"submitted SLURM job {job.job_id} ({args.nodes} node(s) x {cpus} CPUs, {args.gpus_per_node} GPUs)")
    say(f"logs: {folder}/{job.job_id}_0_log.out / .err; results: {sweep_dir}")
    if args.detach:
        return 0
    return follow(job, spec)


def follow(job: Any, spec: dict, poll_s: float = 5.0) -> int:
    """Print the job's state and trial progress until it ends; returns the CLI exit code."""
    import submitit

    trials = Path(spec["sweep_dir"]) / "trials"
    n = len(spec["trials"])
    last = None
    while True:
        done = job.done(force_check=True)
        finished = sum(1 for tid in spec["trials"] if (trials / tid / "done.json").is_file())
        line = f"SLURM job {job.job_id} {job.state}: {finished}/{n} trials finished"
        if line != last:
            say(line)
            last = line
        if done:
            break
        time.sleep(poll_s)
    from pipelines.slurm import head_result

    try:
        result = head_result(job)  # a worker node lost mid-job leaves no result of its own
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"tcnn sweep: error: SLURM job {job.job_id} failed ({first}); see {job.paths.stderr}",
            file=sys.stderr,
        )
        return 1
    say(f"results: {result['summary']} ({result['finished']}/{result['trials']} trials finished)")
    if result.get("parent_run_id"):
        say(f"MLflow parent run {result['parent_run_id']} ({spec['tracking']['uri']})")
    return 0 if result["failed"] == 0 else 1


# ------------------------------------------------------------------------------------------------ CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep", help="run a Ray Tune grid over sweep.grid (locally, on Ray, or on SLURM)")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param")
    p.add_argument(
        "--address", default="local", help="local (start Ray here), auto, HOST:PORT or ray://HOST:PORT"
    )
    p.add_argument("--name", default=None, help="sweep name (default: <params stem>-<config hash>)")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        dest="resume",
        action="store_const",
        const="yes",
        default="no",
        help="continue an interrupted sweep (Tuner.restore)",
    )
    group.add_argument("--auto-resume", dest="resume", action="store_const", const="auto",
                       help="resume when the sweep exists, start it otherwise")  # fmt: skip
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    p.add_argument("--object-store-mb", type=int, default=None, help="Ray object store size per node")
    s = p.add_argument_group("SLURM")
    s.add_argument("--slurm", action="store_true", help="submit the sweep as a SLURM job (Ray on its nodes)")
    s.add_argument("--nodes", type=int, default=1)
    s.add_argument("--cpus-per-node", type=int, default=None, help="default: ceil(sweep.cpus_per_trial)")
    s.add_argument("--gpus-per-node", default="0", metavar="[TYPE:]N", help="GPUs per node, e.g. 4 or a100:4")
    s.add_argument("--partition", default=None)
    s.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="another sbatch option, e.g. account=proj42, constraint=a100, qos=high (repeatable)",
    )
    s.add_argument("--time", type=int, default=60, help="time limit in minutes (requeued with resume)")
    s.add_argument("--mem-gb", type=float, default=None)
    s.add_argument(
        "--ray-port", type=int, default=None, help="base port (default: a free block on 1 node, 6379)"
    )
    s.add_argument("--detach", action="store_true", help="submit and return without following the job")
    p.add_argument(
        "--worker-placement",
        choices=PLACEMENTS,
        default="pack",
        help="where Ray puts a trial's data-parallel workers (workers_per_trial > 1): pack = as few nodes as "
        "possible (default), spread / strict_spread = one per node where possible / always",
    )
    p.set_defaults(func=main_sweep)
    return p


def _run_here(spec: dict, args: argparse.Namespace, address: str) -> dict:
    """The sweep driven from this process: a stop signal (stages.harness.runner.STAGE_SIGNALS) anywhere in it ends
    the trials, closes the MLflow runs KILLED and exits 75 (130 for Ctrl-C) -- Tune's own Ctrl-C handler,
    which would let the driver go on to a summary of a half-run grid, is turned off."""
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    with stop_on_signals():
        return run_sweep(
            spec,
            address=address,
            resume="auto" if args.resume != "no" else "no",
            num_cpus=args.num_cpus,
            object_store_mb=args.object_store_mb,
        )


def main_sweep(args: argparse.Namespace) -> int:
    try:
        params = load_params(args.params, args.set)
        if args.slurm and args.address != "local":
            raise SweepError("--address: not with --slurm (the job starts its own Ray cluster)")
        address = check_address(args.address)
        spec = build_spec(
            params, name=args.name, params_file=Path(args.params), placement=args.worker_placement
        )
        spec = reconcile(spec, args.resume)
        if args.slurm:
            return submit_slurm(spec, args)
        result = _run_here(spec, args, address)
    except Stopped as stop:
        print(f"tcnn sweep: stopped by {stop}; run it again with --auto-resume to continue", file=sys.stderr)
        return stop.exit_status
    except (SweepError, ConfigError) as err:
        print(f"tcnn sweep: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a file or the tracking store could not be read or written: one line, 74
        if (line := io_error_line(err)) is None:
            raise
        print(f"tcnn sweep: error: {line}", file=sys.stderr)
        return EXIT_IOERR
    return 0 if result["failed"] == 0 else 1
