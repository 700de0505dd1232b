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
4. At the end (grid_outputs.py; a search's end: search_run.py): ``summary.parquet``, plots, the model-kind
   table (``kinds.md``/``kinds.parquet`` when the grid varies ``model``) and ``report.html`` (report.py) in
   ``<storage>/<name>/`` and on the parent run (summary.py; the validation-chosen comparison: selection.py),
   parent metrics ``trials``, ``pretrain_runs`` (pretraining runs this sweep executed) and
   ``<kind>_clean_accuracy/_mca/_mce``.

``--slurm`` submits the same driver into a SLURM allocation through
pipelines.slurm.ray_cluster.launch_ray_cluster (Ray head on the first node, workers on the others); a requeue
restarts the driver, which resumes. A lost worker node costs only its running trials: SLURM keeps the job
(``--no-kill``), Ray declares the node dead, Tune retries those trials on the remaining nodes
(``sweep.max_failures``) and they resume from their stages' partial state. Each trial's node is in
summary.parquet (``node``, ``attempt_nodes``) and on its MLflow run. ``max_failures`` covers faults only: a
stage that refuses a trial's inputs (stages.harness.runner.REFUSALS: a bad value, unreadable data) fails the
trial once, with its one line (status ``refused`` and the ``refused`` column of summary.parquet, the MLflow
run FAILED and tagged ``tcnn.refused``, a line from the driver), and a resumed driver does not run it again.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from pipelines.sweep import replay
from pipelines.sweep.driver_legs import end_leg
from pipelines.sweep.driver_lines import say
from pipelines.sweep.driver_lock import LOCK, driver_lock
from pipelines.sweep.grid_outputs import finish
from pipelines.sweep.parent_run import close_failed, close_stopped, open_parent
from pipelines.sweep.plan import SweepError
from pipelines.sweep.search_run import run_search
from pipelines.sweep.settings import search_of, select_of
from pipelines.sweep.sweep_spec import SWEEP_JSON, check_resources, reconcile
from pipelines.sweep.tuner import can_restore, check_multinode_tracking, connect_ray, make_tuner, tune_dir
from stages.harness.runner import Stopped


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
            tracker = open_parent(spec)
            spec["tracking"]["parent_run_id"] = tracker.parent_run_id
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)
            _announce(spec, nodes, sweep_dir)
            t0 = time.monotonic()
            if spec.get("search") is not None:
                return run_search(spec, tracker, sweep_dir, t0)
            if replay.all_recorded(spec):  # replayed on another machine: no trial reads the sets
                say("every trial is recorded (--records): replayed, the corrupted sets not built")
            else:
                _ensure_corrupted(spec, list(spec["corrupt"]))
            spec, status = _run_rounds(spec)
            atomic_write_json(sweep_dir / SWEEP_JSON, spec)  # with why bracketing stopped
            return finish(spec, status, tracker, sweep_dir, t0)
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
        close_stopped(tracker)
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


def _end_failed(tracker: Any, sweep_dir: Path, *, held: bool, new: bool) -> None:
    """What a driver that failed leaves once its trials ended: its runs FAILED (:func:`close_failed`) and, for
    a sweep it created, no directory if no trial ran. Nothing of a sweep whose lock it did not get."""
    if not held:
        return
    close_failed(tracker)
    if new:
        _remove_if_unstarted(sweep_dir)


def _remove_if_unstarted(sweep_dir: Path) -> None:
    """Remove the directory of a new sweep that failed before any trial ran: it holds only sweep.json (and the
    lock), which would make the same command a "sweep exists" refusal instead of a fresh start."""
    left = {p.name for p in sweep_dir.iterdir()} if sweep_dir.is_dir() else set()
    if left <= {SWEEP_JSON, LOCK}:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def slurm_driver(spec: dict, num_cpus: int | None = None) -> dict:
    """The driver inside the SLURM job (Ray already up on the allocation): start, or resume after a requeue."""
    return run_sweep(spec, address=None, resume="auto", num_cpus=num_cpus)
