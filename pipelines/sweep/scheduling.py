"""Early stopping that is fair to both arms (issue 49): the T-CNN and its matched control searched alike.

A point of the search (an lr, a gate lr, an init...) is run as two Tune trials, one per arm (``config["arm"]``),
and every arm gets the same points. A scheduler over all trials at once would compare the arms with each
other: ASHA keeps the top 1/reduction_factor of what reached a rung, so the arm whose validation accuracy
runs higher (the T-CNN or the control, whichever) would crowd the other out of the rungs, and the other's best
point would be stopped before it showed it. :class:`ArmwiseScheduler` gives each arm its own copy of the same
scheduler (same grace period, reduction factor and budget), each acting on that arm's own validation accuracy
only: the same stopping rule, applied within each arm. Each arm then chooses among its trials that ran to the
end (:func:`choose`), on its own validation accuracy; a stopped trial is never chosen.

A choice needs candidates. Asynchronous ASHA lets the first trial to reach a rung go on and may stop every later
one, which leaves an arm one finished trial to "choose". ``min_finished`` (``sweep.search.min_finished``) bounds
the stopping per arm: a trial its arm's ASHA would stop is promoted to the end instead (it goes on; ASHA still
judges it at the later rungs) while stopping it would leave fewer than ``min_finished`` of the arm's
``points`` trials able to finish (its trials not stopped or failed, counting the points not yet started). So each
arm stops at most ``points - min_finished`` trials and chooses among at least ``min_finished`` (fewer only if
trials fail). The rule is counted within each arm, with the same numbers for both: fair as the stopping is.

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
POINT_KEY = "point"  # a search trial's point index, in the order the sampler proposed the points
#: What each trial reports every epoch, for its own arm: the scheduler's metric and its time attribute.
METRIC, TIME_ATTR = "val_acc", "epoch"


class ArmwiseScheduler(FIFOScheduler):
    """One scheduler per arm, made by ``make`` (the same factory for every arm), each seeing only the trials
    of its arm (``arm_of(trial.config)``: ``config[ARM_KEY]`` unless the trial's config only names it, e.g. a
    trial id the sweep's plan maps to its arm); Tune sees one scheduler.

    ``points``, ``min_finished``, ``max_t``: each arm has ``points`` trials and must keep ``min_finished`` of
    them able to train all ``max_t`` epochs (a STOP at ``max_t`` is the trial's end, not a stop): a STOP that
    would break this is turned into CONTINUE (:meth:`may_stop`). ``points=None``: no minimum (ASHA alone).

    ``state``: a file the arms' schedulers (and the trials each arm lost) are saved to after every decision and
    loaded from when this object is first used (Tune saves a searcher's state with the experiment, not a
    scheduler's): a restored sweep goes on with the rungs its trials reached. ASHA keeps one value per trial
    and rung, so a trial that reports a rung again after a restore is recorded once."""

    def __init__(
        self,
        make: Callable[[], TrialScheduler],
        arms: Iterable[str] = ARMS,
        arm_of: Callable[[Mapping[str, Any]], str] = lambda config: config.get(ARM_KEY),
        state: str | None = None,
        *,
        points: int | None = None,
        min_finished: int = 1,
        max_t: int | None = None,
    ) -> None:
        super().__init__()
        self.by_arm = {arm: make() for arm in arms}
        self.arm_of = arm_of
        self.state = state
        self.points, self.min_finished, self.max_t = points, min_finished, max_t
        self.lost: dict[str, set[str]] = {arm: set() for arm in self.by_arm}  # stopped or failed trial ids
        self.promoted: dict[str, set[str]] = {arm: set() for arm in self.by_arm}  # ASHA said stop, kept on
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for key, default in (("points", None), ("min_finished", 1), ("max_t", None)):  # pickled before them
            self.__dict__.setdefault(key, default)
        for key in ("lost", "promoted"):
            self.__dict__.setdefault(key, {arm: set() for arm in self.by_arm})
        if self.state and Path(self.state).is_file():
            saved = pickle.loads(Path(self.state).read_bytes())
            for key in ("lost", "promoted"):
                getattr(self, key).update(saved.pop(f"_{key}", {}))
            for arm, values in saved.items():
                self.by_arm[arm].__dict__.update(values)

    def _save(self) -> None:
        if self.state:
            saved: dict[str, Any] = {arm: s.__dict__ for arm, s in self.by_arm.items()}
            saved |= {"_lost": self.lost, "_promoted": self.promoted}
            atomic_write(self.state, lambda fh: pickle.dump(saved, fh))

    def able_to_finish(self, arm: str) -> int | None:
        """The arm's trials that may still train every epoch: its points less the trials it lost."""
        return None if self.points is None else self.points - len(self.lost[arm])

    def may_stop(self, arm: str) -> bool:
        """Whether the arm's ASHA may stop one more trial: at least ``min_finished`` of its trials stay able
        to finish after the stop (within the arm only: the other arm's trials do not count)."""
        able = self.able_to_finish(arm)
        return able is None or able - 1 >= self.min_finished

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
        epoch = result.get(TIME_ATTR)
        early = self.max_t is None or (isinstance(epoch, int | float) and epoch < self.max_t)
        if decision == TrialScheduler.STOP and early:
            arm = self.arm_of(trial.config)
            if self.may_stop(arm):
                self.lost[arm].add(trial.trial_id)
            else:
                self.promoted[arm].add(trial.trial_id)
                decision = TrialScheduler.CONTINUE
        self._save()
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)
        self._save()

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)
        self.lost[self.arm_of(trial.config)].add(trial.trial_id)  # it will not finish: later ones may be kept
        self._save()

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "; ".join(f"{arm}: {s.debug_string()}, promoted to the end {len(self.promoted[arm])}"
                         for arm, s in self.by_arm.items())  # fmt: skip


def asha(max_t: int, grace_period: int, reduction_factor: float) -> Callable[[], TrialScheduler]:
    """A factory of Ray Tune's ASHA on :data:`METRIC` (higher is better) over :data:`TIME_ATTR`."""
    from ray.tune.schedulers import ASHAScheduler

    def make() -> TrialScheduler:
        return ASHAScheduler(time_attr=TIME_ATTR, metric=METRIC, mode="max", max_t=max_t,
                             grace_period=grace_period, reduction_factor=reduction_factor)  # fmt: skip

    return make


def candidates(rows: Iterable[Mapping[str, Any]], arm: str, max_t: int) -> list[Mapping[str, Any]]:
    """The arm's candidates, best first: its trials that trained all ``max_t`` epochs (one row per trial: its
    config and last result, ``epoch`` and ``val_acc``), by validation accuracy, highest first; a tie goes to
    the lower point index (the point sampled earlier; rows without one: the earlier row). A trial the
    scheduler stopped (fewer epochs) is never a candidate."""
    done = [
        (i, r) for i, r in enumerate(rows) if r.get(ARM_KEY) == arm and int(r.get(TIME_ATTR) or 0) >= max_t
    ]
    done.sort(key=lambda ir: (-float(ir[1][METRIC]), int(ir[1].get(POINT_KEY, ir[0]))))
    return [r for _, r in done]


def choose(rows: Iterable[Mapping[str, Any]], arm: str, max_t: int) -> Mapping[str, Any] | None:
    """The arm's chosen trial: the first of its :func:`candidates` (None when no trial of the arm finished)."""
    ranked = candidates(rows, arm, max_t)
    return ranked[0] if ranked else None
