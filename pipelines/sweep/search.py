"""Search over ranges (``sweep.search``), the same points for both arms (issue 49).

A search samples ``num_samples`` points from ``sweep.search.space`` (Ray Tune's ``loguniform`` / ``uniform`` /
``choice``) with Optuna through Ray's ``OptunaSearch``: ``random`` (Optuna's RandomSampler) or ``tpe`` (its TPE
sampler; Bergstra et al. 2011, "Algorithms for Hyper-Parameter Optimization"), both seeded by
``sweep.search.seed``, so the same params give the same points.

:class:`PairedSearcher` makes the search fair to both arms: every point the inner searcher proposes is handed out
twice, first as the T-CNN's trial, then as its matched control's (``config["arm"]``), so both arms are run at
exactly the same points and the number of points is the same. The inner searcher learns one value per point, the
mean of the two arms' validation accuracies (symmetric in the arms), so neither arm steers where the search
goes next. Early stopping acts within each arm (pipelines/sweep/scheduling.py), and each arm chooses among its
own trials that ran to the end, on its own validation accuracy (:func:`pipelines.sweep.scheduling.choose`).

The searcher's state (the inner study, the points handed out and the arms' results) is saved with Tune's
experiment state and restored by ``Tuner.restore``: a resumed driver samples no point twice.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from ray.tune.search import Searcher

from pipelines.sweep.scheduling import ARM_KEY, ARMS, METRIC

POINT_KEY = "point"


def tune_space(space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``sweep.search.space`` as Ray Tune sampling domains (keys kept dotted: ``finetune.lr``)."""
    from ray import tune

    make = {"loguniform": tune.loguniform, "uniform": tune.uniform}
    out: dict[str, Any] = {}
    for key, spec in space.items():
        kind, values = next(iter(spec.items()))
        out[key] = tune.choice(list(values)) if kind == "choice" else make[kind](*values)
    return out


def inner_searcher(search: dict[str, Any]) -> Searcher:
    """Ray's OptunaSearch over the space, maximising :data:`METRIC`, with the seeded sampler of ``algorithm``."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    seed = int(search["seed"])
    sampler = (optuna.samplers.TPESampler(seed=seed) if search["algorithm"] == "tpe"
               else optuna.samplers.RandomSampler(seed=seed))  # fmt: skip
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = OptunaSearch.convert_search_space(tune_space(search["space"]))
    return OptunaSearch(space=space, metric=METRIC, mode="max", sampler=sampler)


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
        self.results: dict[int, dict[str, float | None]] = {}  # point -> arm -> its last METRIC
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

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.trials:
            return
        point, arm = self.trials[trial_id]
        value = None if error or not result else result.get(METRIC)
        got = self.results.setdefault(point, {})
        got[arm] = float(value) if isinstance(value, int | float) else None
        if len(got) == len(self.arms):
            values = [v for v in got.values() if v is not None]
            mean = sum(values) / len(values) if values else None
            self.inner.on_trial_complete(
                f"point{point}", None if mean is None else {METRIC: mean}, error=mean is None
            )

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as fh:
            pickle.dump(self.__dict__, fh)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as fh:
            self.__dict__.update(pickle.load(fh))


def make_searcher(search: dict[str, Any]) -> PairedSearcher:
    return PairedSearcher(inner_searcher(search))


def num_trials(search: dict[str, Any]) -> int:
    """Tune's ``num_samples``: one trial per point and arm."""
    return int(search["num_samples"]) * len(ARMS)


def state_file(spec: dict[str, Any]) -> Path:
    """Where the search's scheduler keeps its state (pipelines/sweep/scheduling.py: ArmwiseScheduler)."""
    return Path(spec["sweep_dir"]) / "scheduler_state.pkl"


def max_epochs(spec: dict[str, Any]) -> int:
    """The fine-tuning epochs every trial of a search would train without a scheduler (its ASHA's max_t)."""
    return int(next(iter(spec["trials"].values()))["params"]["finetune"]["epochs"])
