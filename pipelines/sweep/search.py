"""Search over ranges (``sweep.search``), the same points for both arms (issue 49).

A search samples ``num_samples`` points from ``sweep.search.space`` (Ray Tune's ``loguniform`` / ``uniform`` /
``choice``) with Optuna through Ray's ``OptunaSearch``: ``random`` (Optuna's RandomSampler) or ``tpe`` (its TPE
sampler; Bergstra et al. 2011, "Algorithms for Hyper-Parameter Optimization", whose first
``sweep.search.n_startup_trials`` points are random: a warning says so when that is every point), both seeded
by ``sweep.search.seed``, so the same params give the same points. When every key is a ``choice``, the first
points are a seeded shuffle of the space's combinations, so none repeats while the space has one left:
``random``'s every point, ``tpe``'s random start-up (:func:`first_points`; Ray's ``points_to_evaluate``).

:class:`PairedSearcher` makes the search fair to both arms: every point the inner searcher proposes is handed out
twice, first as the T-CNN's trial, then as its matched control's (``config["arm"]``), so both arms are run at
exactly the same points and the number of points is the same. The inner searcher learns one value per point,
the mean of the two arms' validation accuracies at the same epoch: the last epoch both arms' trials reported
(each trial's per-epoch history is kept from ``on_trial_result``), so a point whose control ASHA stopped at
epoch 1 while its T-CNN ran to epoch 3 is valued at epoch 1 for both. One sampler fed this symmetric value, not
one sampler per arm: both arms then get the same points by construction, neither arm steers where the search
goes next, and TPE models the points it proposed itself (a sampler per arm, each told the other's points, would
learn from points it did not propose: no longer TPE). Early stopping acts within each arm (pipelines/sweep/scheduling.py), and each arm chooses among
its own trials that ran to the end, on its own validation accuracy (:func:`pipelines.sweep.scheduling.choose`).

The searcher's state (the inner study, the points handed out and the arms' results) is saved with Tune's
experiment state and restored by ``Tuner.restore``: a resumed driver samples no point twice.
"""

from __future__ import annotations

import itertools
import pickle
import random
from pathlib import Path
from typing import Any

from ray.tune.search import Searcher

from pipelines.sweep.scheduling import ARM_KEY, ARMS, METRIC, POINT_KEY, TIME_ATTR  # POINT_KEY: also here
from pipelines.sweep.settings import SearchConfig


def tune_space(space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``sweep.search.space`` as Ray Tune sampling domains (keys kept dotted: ``finetune.lr``)."""
    from ray import tune

    make = {"loguniform": tune.loguniform, "uniform": tune.uniform}
    out: dict[str, Any] = {}
    for key, spec in space.items():
        kind, values = next(iter(spec.items()))
        out[key] = tune.choice(list(values)) if kind == "choice" else make[kind](*values)
    return out


def combinations(space: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Every point of a space whose keys are all ``choice`` (in the order of the keys and values); None when a
    key is a range."""
    if any(next(iter(spec)) != "choice" for spec in space.values()):
        return None
    keys = list(space)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(space[k]["choice"] for k in keys))
    ]


def first_points(search: SearchConfig) -> list[dict[str, Any]]:
    """The points proposed before the sampler's own: with every key a ``choice``, a shuffle of the combinations
    seeded by ``seed`` (sampling without replacement), as many as the sampler would draw at random: all
    ``num_samples`` for ``random``, the ``n_startup_trials`` first for ``tpe`` (capped at the combinations).
    Empty when a key is a range (a repeat there has probability 0)."""
    combos = combinations(search.space)
    if combos is None:
        return []
    n = search.num_samples
    if search.algorithm == "tpe":
        n = min(n, search.n_startup_trials)
    order = random.Random(search.seed).sample(range(len(combos)), len(combos))
    return [combos[i] for i in order[: min(n, len(combos))]]


def inner_searcher(search: SearchConfig) -> Searcher:
    """Ray's OptunaSearch over the space, maximising :data:`METRIC`, with the seeded sampler of ``algorithm``
    (TPE with ``n_startup_trials`` random points first), after :func:`first_points`."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    seed = search.seed
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=search.n_startup_trials)
               if search.algorithm == "tpe" else optuna.samplers.RandomSampler(seed=seed))  # fmt: skip
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = OptunaSearch.convert_search_space(tune_space(search.space))
    return OptunaSearch(space=space, metric=METRIC, mode="max", sampler=sampler,
                        points_to_evaluate=first_points(search) or None)  # fmt: skip


def warnings_for(search: SearchConfig) -> list[str]:
    """One line per way the search is not what its algorithm promises (printed when a search starts)."""
    out = []
    n, startup = search.num_samples, search.n_startup_trials
    if search.algorithm == "tpe" and n <= startup:
        out.append(f"sweep.search: tpe with num_samples={n} <= n_startup_trials={startup} samples every point at "
                   "random (TPE models only the points after its start-up)")  # fmt: skip
    combos = combinations(search.space)
    if combos is not None and n > len(combos):
        out.append(f"sweep.search: {n} points over the {len(combos)} combinations of the choices: each is "
                   "tried once, then repeated")  # fmt: skip
    elif combos is not None and search.algorithm == "tpe" and n > startup:
        out.append(f"sweep.search: tpe's points after its {startup} start-up points may repeat a combination "
                   "of the choices (each repeat is trained again)")  # fmt: skip
    return out


class PairedSearcher(Searcher):
    """Hands each point of ``inner`` out once per arm (T-CNN first, then its control), and tells ``inner`` the
    mean of the two arms' :data:`METRIC` once both are done (a failed arm counts as missing)."""

    def __init__(self, inner: Searcher, arms: tuple[str, ...] = ARMS) -> None:
        super().__init__(metric=METRIC, mode="max")
        self.inner = inner
        self.arms = arms
        self.points: list[dict[str, Any]] = []  # point index -> its values
        self.queue: list[tuple[int, str]] = []  # (point, arm) still to hand out
        self.trials: dict[str, tuple[int, str]] = {}  # Tune trial id -> (point, arm)
        self.results: dict[int, dict[str, dict[int, float]]] = {}  # point -> arm -> epoch -> METRIC (done)
        self.history: dict[str, dict[int, float]] = {}  # Tune trial id -> epoch -> METRIC (as it runs)
        self.finished = False

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return True  # the space, metric and mode are the inner searcher's own

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if not self.queue:
            if self.finished:
                return Searcher.FINISHED
            values = self.inner.suggest(f"point{len(self.points)}")
            if values is None or values == Searcher.FINISHED:
                self.finished = values == Searcher.FINISHED
                return values
            self.points.append(dict(values))
            self.queue = [(len(self.points) - 1, arm) for arm in self.arms]
        point, arm = self.queue.pop(0)
        self.trials[trial_id] = (point, arm)
        return {**self.points[point], POINT_KEY: point, ARM_KEY: arm}

    def _record(self, trial_id: str, result: dict | None) -> None:
        epoch, value = (result or {}).get(TIME_ATTR), (result or {}).get(METRIC)
        if isinstance(epoch, int | float) and isinstance(value, int | float):
            self.history.setdefault(trial_id, {})[int(epoch)] = float(value)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Keep the trial's validation accuracy at each epoch it reports (what :meth:`value` compares)."""
        if trial_id in self.trials:
            self._record(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.trials:
            return
        point, arm = self.trials[trial_id]
        if not error:
            self._record(trial_id, result)
            value = (result or {}).get(METRIC)
            if trial_id not in self.history and isinstance(value, int | float):  # a result without epochs
                self.history[trial_id] = {0: float(value)}
        got = self.results.setdefault(point, {})
        got[arm] = {} if error else dict(self.history.pop(trial_id, {}))
        if len(got) == len(self.arms):
            mean = self.value(got)
            self.inner.on_trial_complete(
                f"point{point}", None if mean is None else {METRIC: mean}, error=mean is None
            )

    @staticmethod
    def value(by_arm: dict[str, dict[int, float]]) -> float | None:
        """A point's value for the sampler: the mean over its arms of :data:`METRIC` at the last epoch every arm
        with a history reported (an arm that failed before its first epoch counts as missing; None when all
        did). One arm stopped at epoch 1, the other at 3: both at epoch 1."""
        curves = [h for h in by_arm.values() if h]
        if not curves:
            return None
        common = set.intersection(*(set(h) for h in curves))
        if not common:  # no epoch in common (cannot happen with per-epoch reports from 1): each its first
            return sum(h[min(h)] for h in curves) / len(curves)
        epoch = max(common)
        return sum(h[epoch] for h in curves) / len(curves)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as fh:
            pickle.dump(self.__dict__, fh)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as fh:
            self.__dict__.update(pickle.load(fh))


def make_searcher(search: SearchConfig) -> PairedSearcher:
    """The search's searcher, for a fresh start (a restore brings back the saved one); prints
    :func:`warnings_for`."""
    for line in warnings_for(search):
        print(f"sweep: warning: {line}", flush=True)
    return PairedSearcher(inner_searcher(search))


def num_trials(search: SearchConfig) -> int:
    """Tune's ``num_samples``: one trial per point and arm."""
    return search.num_samples * len(ARMS)


def state_file(spec: dict[str, Any]) -> Path:
    """Where the search's scheduler keeps its state (pipelines/sweep/scheduling.py: ArmwiseScheduler)."""
    return Path(spec["sweep_dir"]) / "scheduler_state.pkl"


def max_epochs(spec: dict[str, Any]) -> int:
    """The fine-tuning epochs every trial of a search would train without a scheduler (its ASHA's max_t)."""
    return int(next(iter(spec["trials"].values()))["params"]["finetune"]["epochs"])
