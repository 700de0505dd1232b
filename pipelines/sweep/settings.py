"""The sweep's settings, ``sweep:`` of params.yaml (grid, select and its bracketing, search, scheduler,
resources), each checked alone; their checks against the science's params are in
pipelines/sweep/sweep_params.py. Core knows none of these: it carries the section as written."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from core.config import CPUS_MAX, EPOCHS_MAX, Strict

#: The largest seed NumPy's legacy seeding and Optuna's samplers take (``sweep.search.seed``): 2**32 - 1.
SEED32_MAX = 2**32 - 1
#: Points of a search, trials of a grid, retries of a trial (issue 59: far beyond any run of this project).
TRIALS_MAX = 10_000


class BracketConfig(Strict):
    """Bracketing (pipelines/sweep/bracket.py): while an arm's validation-chosen value of ``key`` is the
    smallest or largest value of the grid, the sweep adds the next value beyond that edge (one step of the
    grid's constant ratio) and runs the new trials, at most ``max_rounds`` times."""

    key: str | None = None  # a key of sweep.select.over with a log-spaced grid; None: the one key of over
    max_rounds: int = Field(3, ge=1, le=10)


class SelectConfig(Strict):
    """Hyperparameters chosen on validation data (pipelines/sweep/selection.py): for every seed and every
    configuration of the other grid keys, each arm (the T-CNN and its matched control) takes the values of
    ``over`` whose trial has the best ``by`` on the validation split; the test split only reports."""

    over: list[str] = Field(default_factory=list)  # grid keys to choose, e.g. [finetune.lr]
    by: Literal["val_accuracy"] = "val_accuracy"  # <arm>_val_accuracy of the trial (final model)
    bracket: BracketConfig | None = None  # extend the grid until each choice is interior; true: defaults

    @field_validator("bracket", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        if isinstance(v, bool):  # `bracket: true` takes the defaults, `false` is off
            return {} if v else None
        return v


def bracket_key(select: SelectConfig) -> str | None:
    """The grid key bracketing extends (None: no bracketing)."""
    if select.bracket is None:
        return None
    if select.bracket.key is not None:
        return select.bracket.key
    return select.over[0] if len(select.over) == 1 else None


def log_step(values: list[Any]) -> float | None:
    """The constant ratio of a log-spaced grid (its distinct values sorted: at least two, all positive
    numbers, consecutive ratios equal to 1e-6); None when the values are not such a grid."""
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 for v in values):
        return None
    distinct = sorted(set(values))
    if len(distinct) < 2:
        return None
    ratios = [b / a for a, b in zip(distinct, distinct[1:])]
    if any(not math.isclose(r, ratios[0], rel_tol=1e-6) for r in ratios):
        return None
    return float(f"{ratios[0]:.12g}")


#: The range kinds of ``sweep.search.space`` (Ray Tune's sampling functions of the same names).
SEARCH_KINDS = ("loguniform", "uniform", "choice")
#: Keys a search may range over: they change fine-tuning only, so every point of a search shares the base
#: params' pretraining and the arms are compared on one CNN (T-CNN, d'Ascoli et al. 2021, SM A: the lr and the
#: gating parameters' init decide how much of the CNN the T-CNN keeps).
SEARCH_KEYS = ("finetune.lr", "finetune.gate_lr", "finetune.weight_decay", "finetune.warmup_epochs",
               "reparam.alpha_init", "reparam.lambda_init")  # fmt: skip


class SearchConfig(Strict):
    """``sweep.search``: points sampled from ranges instead of a grid (pipelines/sweep/search.py). Each point is
    run by both arms, the T-CNN and its matched control (the same points for both)."""

    space: dict[str, dict[str, Any]]  # key -> {loguniform: [lo, hi]} | {uniform: [lo, hi]} | {choice: [...]}
    algorithm: Literal["random", "tpe"] = "random"  # tpe: Optuna's TPE sampler through Ray's OptunaSearch
    num_samples: int = Field(8, ge=1, le=TRIALS_MAX)  # points (each run by both arms)
    seed: int = Field(0, ge=0, le=SEED32_MAX)  # same params, same seed: the same points (Optuna: < 2**32)
    # each arm chooses among at least this many trials that trained every epoch: the scheduler stops at most
    # num_samples - min_finished trials per arm (pipelines/sweep/scheduling.py: ArmwiseScheduler)
    min_finished: int = Field(3, ge=1, le=TRIALS_MAX)
    # tpe: its first n_startup_trials points are random (Optuna's TPESampler, whose own default is 10)
    n_startup_trials: int = Field(10, ge=1, le=TRIALS_MAX)

    @field_validator("space")
    @classmethod
    def _ranges(cls, space: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not space:
            raise ValueError(
                "name at least one key and its range, e.g. {finetune.lr: {loguniform: [1e-4, 1e-2]}}"
            )
        for key, spec in space.items():
            check_range(key, spec)
        return space


def check_range(key: str, spec: Any) -> None:
    """One ``sweep.search.space`` entry: a searchable key and one range (``loguniform: [lo, hi]`` with
    0 < lo < hi, ``uniform: [lo, hi]`` with lo < hi, or ``choice: [v, ...]``, not empty)."""
    if key not in SEARCH_KEYS:
        raise ValueError(f"{key}: not a searchable key (one of {', '.join(SEARCH_KEYS)})")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SEARCH_KINDS:
        raise ValueError(f"{key}: expected one of {{loguniform: [lo, hi]}}, {{uniform: [lo, hi]}}, "
                         f"{{choice: [v, ...]}}, got {spec!r}")  # fmt: skip
    kind, values = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(values, list) or not values:
            raise ValueError(f"{key}: choice needs a non-empty list, got {values!r}")
        return
    ok = isinstance(values, list) and len(values) == 2
    ok = ok and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )
    if not ok or not values[0] < values[1] or (kind == "loguniform" and not values[0] > 0):
        need = "0 < lo < hi" if kind == "loguniform" else "lo < hi"
        raise ValueError(f"{key}: {kind} needs [lo, hi] with {need}, got {values!r}")


class SchedulerConfig(Strict):
    """``sweep.scheduler``: early stopping on each arm's own validation accuracy, one copy per arm
    (pipelines/sweep/scheduling.py; ASHA: Li et al. 2020, "A System for Massively Parallel Hyperparameter
    Tuning", Alg. 2)."""

    kind: Literal["asha"] = "asha"
    grace_period: int = Field(
        1, ge=1, le=EPOCHS_MAX
    )  # fine-tuning epochs every trial trains before it can be stopped
    reduction_factor: float = Field(2.0, gt=1.0)  # the top 1/reduction_factor of a rung go on


class SweepConfig(Strict):
    """``sweep:``, the whole section: the grid (or a search and its scheduler), the choice on validation data,
    and what each trial gets (Ray resources, retries, where the sweeps write)."""

    grid: dict[str, list[Any]] = Field(default_factory=dict)
    select: SelectConfig = Field(default_factory=SelectConfig)
    cpus_per_trial: float = Field(1.0, gt=0.0, le=CPUS_MAX)
    gpus_per_trial: float = Field(0.0, ge=0.0, le=CPUS_MAX)
    max_failures: int = Field(2, ge=0, le=TRIALS_MAX)
    storage: Path = Path("sweeps")
    # Trials with the same pretraining inputs share one content-addressed pretraining run (pipelines/sweep/plan.py);
    # false = every trial pretrains in its own directory (the naive grid, e.g. for benchmarks/sweep.py).
    share_pretraining: bool = True
    search: SearchConfig | None = None  # points from ranges, both arms alike (instead of the grid)
    scheduler: SchedulerConfig | None = None  # early stopping (with search only)


class BracketPlan(Strict):
    """``sweep.select.bracket`` as the driver runs it (pipelines/sweep/bracket.py): the grid key it extends, the
    grid's constant ratio (:func:`log_step`) and the most rounds."""

    key: str
    ratio: float = Field(gt=0.0)
    max_rounds: int = Field(ge=1, le=10)


# The sweep's spec (``sweep.json``, pipelines/sweep/sweep_spec.py) stores each setting as JSON, so a saved sweep resumes
# from its file; every reader takes it back as the typed setting through these.


def search_of(spec: Mapping[str, Any]) -> SearchConfig | None:
    """The spec's ``sweep.search`` (None: a grid)."""
    raw = spec.get("search")
    return None if raw is None else SearchConfig.model_validate(raw)


def scheduler_of(spec: Mapping[str, Any]) -> SchedulerConfig | None:
    """The spec's ``sweep.scheduler`` (None: every trial trains every epoch)."""
    raw = spec.get("scheduler")
    return None if raw is None else SchedulerConfig.model_validate(raw)


def select_of(spec: Mapping[str, Any]) -> SelectConfig:
    """The spec's ``sweep.select``."""
    return SelectConfig.model_validate(spec["select"])


def bracket_of(spec: Mapping[str, Any]) -> BracketPlan | None:
    """The spec's bracketing plan (None: no bracketing)."""
    raw = spec.get("bracket")
    return None if raw is None else BracketPlan.model_validate(raw)
