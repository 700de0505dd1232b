"""ASHA fair to both arms (pipelines/sweep/scheduling.py), run by Ray Tune itself.

The truth: learning curves whose best lr per arm is known by construction -- the T-CNN peaks at lr 1e-3, the
control at 1e-2, the control's accuracy runs 8 pp lower, and every curve rises with the epochs while keeping
the lrs in the same order. Each arm gets the same six points. A fair rule must let each arm's own best point
train to the end and choose it. The unfair variant -- one ASHA over both arms' trials -- ranks the control's
trials against the T-CNN's, stops them all at the first rung, and leaves the control nothing to choose: the
same check fails on it.

A choice needs candidates (``min_finished``): on curves that fall with the point index, ASHA alone leaves each arm
one finished trial; the rule counted within each arm leaves each exactly ``min_finished`` and still stops the rest;
the same rule counted over both arms together, or applied to one arm only, leaves an arm short.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from pipelines.sweep.scheduling import ARM_KEY, ARMS, METRIC, TIME_ATTR, ArmwiseScheduler, asha, choose

pytestmark = pytest.mark.slow

LRS = [10 ** (-4 + 3 * i / 5) for i in range(6)]  # 1e-4 .. 1e-1, log-spaced
BEST = {"tcnn": 1e-3, "control": 1e-2}
PEAK = {"tcnn": 0.90, "control": 0.82}
MAX_T, GRACE, RF = 8, 1, 2


def curve(arm: str, lr: float, epoch: int) -> float:
    """Validation accuracy of ``arm`` at ``lr`` after ``epoch`` epochs: the arm's peak, less a penalty in
    decades away from its best lr, less a term that shrinks with the epochs."""
    return PEAK[arm] - 0.03 * (math.log10(lr) - math.log10(BEST[arm])) ** 2 - 0.2 / epoch


def trainable(config: dict) -> None:
    from ray import tune

    for epoch in range(1, MAX_T + 1):
        tune.report({METRIC: curve(config[ARM_KEY], config["lr"], epoch), TIME_ATTR: epoch})


def arm_of(config: dict) -> str:
    return config["point"][ARM_KEY]


def _sweep(tmp_path: Path, scheduler) -> list[dict]:
    """Both arms at every point, the T-CNN's trials first, one at a time (so that every rung's decision is
    made against the same recorded results whatever the machine's speed); one row per trial."""
    from ray import tune

    points = [{ARM_KEY: arm, "lr": lr} for arm in ARMS for lr in LRS]
    tuner = tune.Tuner(
        _flat,
        param_space={"point": tune.grid_search(points)},
        tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="fair", verbose=0),
    )
    grid = tuner.fit()
    return [{**r.config["point"], TIME_ATTR: r.metrics[TIME_ATTR], METRIC: r.metrics[METRIC]} for r in grid]


def _flat(config: dict) -> None:
    """The grid's values are whole points (both arms of a point are separate trials, in a fixed order)."""
    trainable(config["point"])


@pytest.fixture(scope="module")
def ray_local():
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the trainable lives in this test module
    started = not ray.is_initialized()  # another test of this process may have left one up: use it
    # ray.init installs Ray's SIGTERM handler in pytest's process and shutdown leaves it (conftest's autouse
    # fixture restores per test, which is inside this module-scoped one): put back what was there
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()
    for s, handler in handlers.items():
        signal.signal(s, handler)


def _fair_choices(rows: list[dict]) -> dict[str, float | None]:
    """Each arm's chosen lr (None: nothing of the arm trained to the end), after checking that both arms got
    the same points."""
    for arm in ARMS:
        assert sorted(r["lr"] for r in rows if r[ARM_KEY] == arm) == LRS  # the same points, one trial each
    return {arm: (c["lr"] if (c := choose(rows, arm, MAX_T)) else None) for arm in ARMS}


def test_each_arm_stopped_by_its_own_asha_chooses_its_own_best_lr(ray_local, tmp_path: Path) -> None:
    rows = _sweep(tmp_path, ArmwiseScheduler(asha(MAX_T, GRACE, RF), arm_of=arm_of))
    truth = {arm: max(LRS, key=lambda lr: curve(arm, lr, MAX_T)) for arm in ARMS}  # the grid's best per arm
    assert truth["tcnn"] != truth["control"]
    assert _fair_choices(rows) == truth
    for arm in ARMS:  # ASHA did stop trials in each arm: fewer epochs than a grid would train
        epochs = [r[TIME_ATTR] for r in rows if r[ARM_KEY] == arm]
        assert sum(epochs) < len(LRS) * MAX_T and max(epochs) == MAX_T, (arm, epochs)
        stopped = [r for r in rows if r[ARM_KEY] == arm and r[TIME_ATTR] < MAX_T]
        assert stopped and all(r["lr"] != truth[arm] for r in stopped)  # never the chosen one


def test_one_asha_over_both_arms_fails_the_same_check(ray_local, tmp_path: Path) -> None:
    """The unfair variant: one ASHA over all trials. The control's trials meet the T-CNN's at every rung and
    are stopped; the check of the fair rule must reject this."""
    rows = _sweep(tmp_path, asha(MAX_T, GRACE, RF)())
    choices = {arm: (c["lr"] if (c := choose(rows, arm, MAX_T)) else None) for arm in ARMS}
    best = max(LRS, key=lambda lr: curve("control", lr, MAX_T))
    assert choices["control"] != best  # what the fair test asserts does not hold
    assert all(r[TIME_ATTR] < MAX_T for r in rows if r[ARM_KEY] == "control")


# ------------------------------------------------------------------ a choice among min_finished candidates
# Each arm's ASHA driven by Tune's own scheduler objects, with stand-in trials: the trials of a point come in
# as Tune runs them (the T-CNN's, then its control's), one at a time, and each arm's accuracy falls with the
# point index, so the first trial of an arm reaches every rung first and ASHA alone stops every later one.

POINTS, MIN_FINISHED = 8, 3


def falling(arm: str, point: int, epoch: int) -> float:
    """Validation accuracy of ``arm`` at ``point`` after ``epoch`` epochs: lower for each later point."""
    return PEAK[arm] - (0.02 if arm == "tcnn" else 0.03) * point - 0.2 / epoch


def _drive(
    scheduler: ArmwiseScheduler, fail: frozenset[tuple[str, int]] = frozenset()
) -> dict[str, list[int]]:
    """Every point's two trials to their end (the last epoch or a STOP); a (arm, point) in ``fail`` errors at
    its first report. Returns each arm's epochs trained per point."""
    from types import SimpleNamespace

    trained: dict[str, list[int]] = {arm: [] for arm in ARMS}
    for point in range(POINTS):
        for arm in ARMS:
            trial = SimpleNamespace(trial_id=f"p{point}-{arm}", config={ARM_KEY: arm})
            scheduler.on_trial_add(None, trial)
            if (arm, point) in fail:
                scheduler.on_trial_error(None, trial)
                trained[arm].append(0)
                continue
            for epoch in range(1, MAX_T + 1):
                result = {TIME_ATTR: epoch, METRIC: falling(arm, point, epoch)}
                if scheduler.on_trial_result(None, trial, result) == "STOP":
                    break
            scheduler.on_trial_complete(None, trial, result)
            trained[arm].append(epoch)
    return trained


def _finished(trained: dict[str, list[int]]) -> dict[str, int]:
    return {arm: sum(e == MAX_T for e in epochs) for arm, epochs in trained.items()}


def _with_minimum(cls: type = ArmwiseScheduler) -> ArmwiseScheduler:
    return cls(asha(MAX_T, GRACE, RF), points=POINTS, min_finished=MIN_FINISHED, max_t=MAX_T)


def test_asha_alone_leaves_each_arm_one_candidate() -> None:
    """The problem: the first trial of each arm to reach the rungs goes on, every later one is stopped."""
    assert _finished(_drive(ArmwiseScheduler(asha(MAX_T, GRACE, RF)))) == {"tcnn": 1, "control": 1}


def test_each_arm_keeps_min_finished_candidates_and_asha_stops_the_rest() -> None:
    trained = _drive(_with_minimum())
    for arm in ARMS:  # each arm: min_finished trials to the end, the other points stopped early
        assert _finished(trained)[arm] == MIN_FINISHED, (arm, trained[arm])
        assert sum(e < MAX_T for e in trained[arm]) == POINTS - MIN_FINISHED, (arm, trained[arm])
    assert trained["tcnn"] == trained["control"]  # the same rule, the same points: the same shape
    # the choice among them is the arm's best (point 0, the first sampled)
    rows = [{ARM_KEY: arm, "point": p, TIME_ATTR: e, METRIC: falling(arm, p, e)}
            for arm in ARMS for p, e in enumerate(trained[arm])]  # fmt: skip
    assert all(choose(rows, arm, MAX_T)["point"] == 0 for arm in ARMS)


def test_a_failed_trial_leaves_its_arm_fewer_to_stop() -> None:
    """A trial that errors will not finish: the arm's later trials are kept on sooner, the other arm's not."""
    trained = _drive(_with_minimum(), fail=frozenset({("control", 1)}))
    assert _finished(trained) == {"tcnn": MIN_FINISHED, "control": MIN_FINISHED}
    assert sum(0 < e < MAX_T for e in trained["control"]) == POINTS - MIN_FINISHED - 1


class _Pooled(ArmwiseScheduler):
    """Unfair: the minimum counted over both arms together."""

    def may_stop(self, arm: str) -> bool:
        lost = sum(len(ids) for ids in self.lost.values())
        return len(self.by_arm) * self.points - lost - 1 >= self.min_finished


class _TcnnOnly(ArmwiseScheduler):
    """Unfair: the minimum applied to the T-CNN's arm only."""

    def may_stop(self, arm: str) -> bool:
        return arm != "tcnn" or super().may_stop(arm)


@pytest.mark.parametrize("variant", [_Pooled, _TcnnOnly])
def test_the_unfair_minimums_fail_the_same_check(variant: type) -> None:
    finished = _finished(_drive(_with_minimum(variant)))
    assert min(finished.values()) < MIN_FINISHED, finished  # what the fair test asserts does not hold
