"""Early stopping that is fair to both arms (issue 49): the T-CNN and its matched control searched alike.

A point of the search (an lr, a gate lr, an init...) is run as two Tune trials, one per arm (``config["arm"]``),
and every arm gets the same points. A scheduler over all trials at once would compare the arms with each
other: ASHA keeps the top 1/reduction_factor of what reached a rung, so the arm whose validation accuracy
runs higher (the T-CNN or the control, whichever) would crowd the other out of the rungs, and the other's best
point would be stopped before it showed it. :class:`ArmwiseScheduler` gives each arm its own copy of the same
scheduler (same grace period, reduction factor and budget), each acting on that arm's own validation accuracy
only: the same stopping rule, applied within each arm. Each arm then chooses among its trials that ran to the
end (:func:`choose`), on its own validation accuracy; a stopped trial is never chosen.

Asynchronous successive halving: Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning"
(ASHA, Alg. 2); Ray Tune's ``ASHAScheduler``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from core.utils.atomic import atomic_write

ARMS = ("tcnn", "control")
ARM_KEY = "arm"
#: What each trial reports every epoch, for its own arm: the scheduler's metric and its time attribute.
METRIC, TIME_ATTR = "val_acc", "epoch"


class ArmwiseScheduler(FIFOScheduler):
    """One scheduler per arm, made by ``make`` (the same factory for every arm), each seeing only the trials
    of its arm (``arm_of(trial.config)``: ``config[ARM_KEY]`` unless the trial's config only names it, e.g. a
    trial id the sweep's plan maps to its arm); Tune sees one scheduler.

    ``state``: a file the arms' schedulers are saved to after every decision and loaded from when this object
    is first used (Tune saves a searcher's state with the experiment, not a scheduler's): a restored sweep
    goes on with the rungs its trials reached. ASHA keeps one value per trial and rung, so a trial that
    reports a rung again after a restore is recorded once."""

    def __init__(
        self,
        make: Callable[[], TrialScheduler],
        arms: Iterable[str] = ARMS,
        arm_of: Callable[[Mapping[str, Any]], str] = lambda config: config.get(ARM_KEY),
        state: str | None = None,
    ) -> None:
        super().__init__()
        self.by_arm = {arm: make() for arm in arms}
        self.arm_of = arm_of
        self.state = state
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if self.state and Path(self.state).is_file():
            saved = pickle.loads(Path(self.state).read_bytes())
            for arm, values in saved.items():
                self.by_arm[arm].__dict__.update(values)

    def _save(self) -> None:
        if self.state:
            saved = {arm: s.__dict__ for arm, s in self.by_arm.items()}
            atomic_write(self.state, lambda fh: pickle.dump(saved, fh))

    def _of(self, trial: Any) -> TrialScheduler:
        self._load()
        arm = self.arm_of(trial.config)
        if arm not in self.by_arm:
            raise ValueError(
                f"trial {trial.trial_id}: config[{ARM_KEY!r}] = {arm!r}, expected one of {list(self.by_arm)}"
            )
        return self.by_arm[arm]

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return all(s.set_search_properties(metric, mode, **spec) for s in self.by_arm.values())

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)
        self._save()

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        decision = self._of(trial).on_trial_result(tune_controller, trial, result)
        self._save()
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)
        self._save()

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "; ".join(f"{arm}: {s.debug_string()}" for arm, s in self.by_arm.items())


def asha(max_t: int, grace_period: int, reduction_factor: float) -> Callable[[], TrialScheduler]:
    """A factory of Ray Tune's ASHA on :data:`METRIC` (higher is better) over :data:`TIME_ATTR`."""
    from ray.tune.schedulers import ASHAScheduler

    def make() -> TrialScheduler:
        return ASHAScheduler(time_attr=TIME_ATTR, metric=METRIC, mode="max", max_t=max_t,
                             grace_period=grace_period, reduction_factor=reduction_factor)  # fmt: skip

    return make


def choose(rows: Iterable[Mapping[str, Any]], arm: str, max_t: int) -> Mapping[str, Any] | None:
    """The arm's chosen trial: among its trials that trained all ``max_t`` epochs (one row per trial: its
    config and last result, ``epoch`` and ``val_acc``), the highest validation accuracy; ties go to the first
    row. A trial the scheduler stopped (fewer epochs) is never chosen; None when no trial of the arm finished."""
    done = [r for r in rows if r.get(ARM_KEY) == arm and int(r.get(TIME_ATTR) or 0) >= max_t]
    return max(done, key=lambda r: float(r[METRIC]), default=None)
