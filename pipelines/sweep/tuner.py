"""Ray and Ray Tune for the sweep driver: the connection to Ray (a light local Ray, or a cluster's) and the Tune
experiment of each round (``tune.Tuner`` over the round's trial ids: its param_space, resources, run config,
failure config and progress callback; ``Tuner.restore`` for a resumed round). The trial side of Tune (the
function trainable) is pipelines/sweep/trial.py, its reports and checkpoints pipelines/sweep/tune_report.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from core.utils.errors import first_line
from pipelines.sweep.plan import SweepError, trial_label

TUNE_DIR = "tune"
ADDRESS_RE = re.compile(r"^(local|auto|ray://[^\s:/]+:\d{1,5}|[^\s:/]+:\d{1,5})$")
LOCAL_OBJECT_STORE_MB = 256


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
        from pipelines.slurm.ray_node import align_ray_auth

        align_ray_auth()  # a cluster from `ray start` (sweep.sbatch) uses token auth when a token exists
    term = signal.getsignal(signal.SIGTERM)
    try:
        if address == "local":
            # The Ray this process starts for itself enables token auth by default and says so on stderr: not
            # the user's cluster nor a setting of theirs, so not a line of theirs (a refusal stays one line).
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
                logging.ERROR
            )
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
        first = first_line(err)
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
    from pipelines.sweep.progress import SweepProgress

    return SweepProgress({tid: trial_label(spec["trials"][tid]["overrides"]) for tid in tids})


def tune_dir(k: int) -> str:
    """The Tune experiment of round ``k``: 0 runs the asked grid, k >= 1 the trials bracketing added."""
    return TUNE_DIR if k == 0 else f"{TUNE_DIR}-bracket{k}"


def _trainable(fn: Any, spec: dict) -> Any:
    """``fn`` as Tune runs it: the spec bound, the trial's resources; the experiment checkpointed every few
    seconds and each result passed on at once."""
    from ray import tune

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    os.environ.setdefault("TUNE_RESULT_BUFFER_LENGTH", "1")
    return tune.with_resources(tune.with_parameters(fn, spec=spec), spec["resources"])


def _run_config(spec: dict, name: str, callbacks: list[Any] | None = None, verbose: int = 0) -> Any:
    from ray import tune

    return tune.RunConfig(
        name=name,
        storage_path=spec["sweep_dir"],
        failure_config=tune.FailureConfig(max_failures=spec["max_failures"]),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=None),  # tiny: {run id, stage}
        verbose=verbose,
        callbacks=callbacks,
    )


class _NoResultsYet(logging.Filter):
    """Drops Tune's "Failed to fetch metrics for N trial(s)" when every failure is a FileNotFoundError: at a
    restore Tune reads the results of every trial of the saved experiment (ExperimentAnalysis in
    ``Tuner.restore``, its ``last_result`` never None), and a trial that was pending or had not reported yet when
    the driver stopped has no result file -- nothing is lost, the restored run starts it. Any other failure
    still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith("Failed to fetch metrics for"):
            return True
        failures = [x for x in text.splitlines()[1:] if x.strip()]
        return not failures or not all("FileNotFoundError(" in x for x in failures)


def _restored(spec: dict, name: str, trainable: Any) -> Any:
    from ray import tune

    path = Path(spec["sweep_dir"]) / name
    log = logging.getLogger("ray.tune.analysis.experiment_analysis")
    quiet = _NoResultsYet()
    log.addFilter(quiet)
    try:
        return tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    finally:
        log.removeFilter(quiet)


def make_tuner(spec: dict, restore: bool, tids: list[str], name: str = TUNE_DIR) -> Any:
    from ray import tune

    from pipelines.sweep.trial import tune_trainable

    trainable = _trainable(tune_trainable, spec)
    if restore:
        return _restored(spec, name, trainable)
    return tune.Tuner(
        trainable,
        param_space={"tid": tune.grid_search([t for t in _tune_order(spec) if t in set(tids)])},
        tune_config=tune.TuneConfig(
            trial_dirname_creator=_trial_dirname,
            reuse_actors=True,  # one actor runs trial after trial: torch/timm are imported once per worker
        ),
        run_config=_run_config(spec, name, [_progress_callback(spec, tids)]),
    )


def _arm_dirname(trial: Any) -> str:
    from pipelines.sweep.arm_trial import arm_tid
    from pipelines.sweep.scheduling import ARM_KEY
    from pipelines.sweep.search import POINT_KEY

    return arm_tid(trial.config[POINT_KEY], trial.config[ARM_KEY])


def scheduler(spec: dict) -> Any:
    """``sweep.scheduler`` as Tune's scheduler: one ASHA per arm (pipelines/sweep/scheduling.py), over the
    fine-tuning epochs; FIFO (every trial runs to the end) when none is set."""
    from ray.tune.schedulers import FIFOScheduler

    from pipelines.sweep.scheduling import ArmwiseScheduler, asha
    from pipelines.sweep.search import max_epochs, state_file
    from pipelines.sweep.settings import scheduler_of, search_of

    sched, search = scheduler_of(spec), search_of(spec)
    if sched is None or search is None:
        return FIFOScheduler()
    make = asha(max_epochs(spec), sched.grace_period, sched.reduction_factor)
    return ArmwiseScheduler(make, state=str(state_file(spec)), points=search.num_samples,
                            min_finished=search.min_finished, max_t=max_epochs(spec))  # fmt: skip


def make_search_tuner(spec: dict, restore: bool) -> Any:
    """The Tune experiment of a search (``sweep.search``): the paired searcher's points, one trial per point and
    arm, ``sweep.scheduler`` acting within each arm. A restore brings back the searcher's state (Tune's) and the
    scheduler's (its own state file)."""
    from ray import tune

    from pipelines.sweep.arm_trial import search_trainable
    from pipelines.sweep.progress import SearchProgress
    from pipelines.sweep.search import make_searcher, num_trials
    from pipelines.sweep.settings import search_of

    # A trial's first reports (start, stages) carry no epoch yet: the scheduler and the searcher skip them.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    trainable = _trainable(search_trainable, spec)
    if restore:
        return _restored(spec, TUNE_DIR, trainable)
    search = search_of(spec)
    if search is None:
        raise ValueError("make_search_tuner: the spec holds no sweep.search")
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=make_searcher(search),
            scheduler=scheduler(spec),
            num_samples=num_trials(search),
            trial_dirname_creator=_arm_dirname,
            reuse_actors=False,  # a stopped trial's process ends with it
        ),
        # Our line per trial event always; Tune's own status table too on a terminal (not in a log file).
        run_config=_run_config(
            spec,
            TUNE_DIR,
            [SearchProgress(num_trials(search))],
            verbose=1 if sys.stdout.isatty() else 0,
        ),  # fmt: skip
    )


def can_restore(path: Path) -> bool:
    from ray import tune

    return path.is_dir() and tune.Tuner.can_restore(str(path))
