"""A params file with its ``sweep`` section typed (`SweepParams`) and the sweep's settings checked against the
science's params: every grid value and every value of a search's ranges is a valid value of its key, a choice
on validation data has validation data, a scheduler could stop a trial (ASHA, Li et al. 2020), a bracketed key is
chosen and log-spaced. What the sweep's commands load (:func:`load_sweep_params`); a bad value is one
`ConfigError` line naming the dotted key, as for the science's own sections."""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator

from core.config import ConfigError, Params, format_error, load_as, set_dotted, validate_params
from pipelines.sweep.settings import (
    TRIALS_MAX,
    SchedulerConfig,
    SearchConfig,
    SweepConfig,
    bracket_key,
    log_step,
)

#: ``sweep.grid``'s keys are whole dotted params: ``-S sweep.grid.finetune.lr=[...]`` sets one of them.
GRID = "sweep.grid"


class SweepParams(Params):
    """`core.config.Params` with its ``sweep`` section as the sweep's model (`SweepConfig`)."""

    DOTTED_MAPS: ClassVar[tuple[str, ...]] = (GRID,)

    sweep: SweepConfig = Field(default_factory=SweepConfig)  # type: ignore[assignment]

    @model_validator(mode="after")
    def _imported_cnn_has_no_t1(self) -> SweepParams:
        """An imported CNN (``pretrain.source``) has no training run here to pick t1 from."""
        if self.pretrain.source is not None and "reparam.epoch" in self.sweep.grid:
            raise ValueError(
                "sweep.grid.reparam.epoch: the CNN is imported (pretrain.source), not trained here"
            )
        return self

    @classmethod
    def validated(cls, raw: Any) -> SweepParams:
        return validate_sweep_params(raw)


def load_sweep_params(
    path: str | os.PathLike = "params.yaml", overrides: list[str] | None = None
) -> SweepParams:
    """The params file ``path`` (with ``-S`` ``overrides``), its sweep section included, validated."""
    return load_as(path, overrides, validate_sweep_params, flat=SweepParams.DOTTED_MAPS)


def validate_sweep_params(raw: Any) -> SweepParams:
    """``raw`` validated as `SweepParams`, the sweep's settings checked against the rest."""
    params = validate_params(raw, SweepParams)
    for key, values in params.sweep.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
        for value in values:
            try:
                base = params.model_dump(mode="json")
                base["sweep"]["grid"] = {}
                set_dotted(base, key, value)
                SweepParams.model_validate(base)
            except ValidationError as err:
                raise ConfigError(
                    f"sweep.grid.{key}: value {value!r} is invalid ({format_error(err)})"
                ) from None
            except ConfigError as err:
                raise ConfigError(f"sweep.grid.{key}: {err}") from None
    trials = math.prod(len(v) for v in params.sweep.grid.values())
    if trials > TRIALS_MAX:
        raise ConfigError(f"sweep.grid: {trials} trials (the product of its lists' lengths) is more than "
                          f"{TRIALS_MAX}; sweep fewer values")  # fmt: skip
    _check_search(params)
    for key in params.sweep.select.over:
        fixed = params.finetune.control_lr is not None or "finetune.control_lr" in params.sweep.grid
        if key == "finetune.lr" and fixed:  # the scalar and the grid form alike
            raise ConfigError("sweep.select.over: finetune.lr is chosen per arm, which finetune.control_lr fixes "
                              "for the control; drop one of them")  # fmt: skip
        if key in ("seed", "pretrain.seed") or key not in params.sweep.grid:
            raise ConfigError(
                f"sweep.select.over: {key!r} is not a grid key other than seed and pretrain.seed "
                f"(sweep.grid has {sorted(params.sweep.grid) or 'none'})"
            )
    _check_bracket(params.sweep)
    return params


def _check_search(params: SweepParams) -> None:
    """``sweep.search`` / ``sweep.scheduler`` against the rest: a search replaces the grid and the grid's
    selection; each value of its ranges is a valid value of its key; both arms must see every point, so the
    control's lr is not fixed apart; the scheduler and the choice need validation data."""
    sw = params.sweep
    if sw.search is None:
        if sw.scheduler is not None:
            raise ConfigError(
                "sweep.scheduler: early stopping acts on the trials of a search; set sweep.search"
            )
        return
    if sw.grid:
        raise ConfigError(f"sweep.search: a search samples its points instead of the grid; sweep.grid must be "
                          f"empty (has {sorted(sw.grid)}): search on one seed, then run the seeds at the values "
                          "it chose")  # fmt: skip
    if sw.select.over or sw.select.bracket is not None:
        raise ConfigError("sweep.select: a search chooses per arm itself (on validation accuracy); "
                          "leave sweep.select.over and bracket empty")  # fmt: skip
    if "finetune.lr" in sw.search.space and params.finetune.control_lr is not None:
        raise ConfigError("sweep.search.space.finetune.lr: the control must get the same points; "
                          "finetune.control_lr fixes its lr apart: drop it")  # fmt: skip
    if params.finetune.stop is not None:
        raise ConfigError("finetune.stop: a search stops its trials itself (sweep.scheduler), and each arm chooses "
                          "among trials that trained every epoch; drop finetune.stop")  # fmt: skip
    if params.data.val_from == "train" and params.data.val_size == 0:
        raise ConfigError("sweep.search: each arm chooses on its validation accuracy; data.val_size is 0 "
                          "(set it, or data.val_from: test_half)")  # fmt: skip
    if sw.search.min_finished > sw.search.num_samples:
        raise ConfigError(f"sweep.search.min_finished: {sw.search.min_finished} exceeds num_samples="
                          f"{sw.search.num_samples} (each arm has num_samples trials to choose among)")  # fmt: skip
    if sw.scheduler is not None:
        _check_scheduler(sw.scheduler, sw.search, params.finetune.epochs)
    for key, spec in sw.search.space.items():
        kind, values = next(iter(spec.items()))
        for value in values:
            base = params.model_dump(mode="json")
            base["sweep"]["search"] = base["sweep"]["scheduler"] = None
            set_dotted(base, key, value)
            try:
                SweepParams.model_validate(base)
            except ValidationError as err:
                raise ConfigError(f"sweep.search.space.{key}: {kind} value {value!r} is invalid "
                                  f"({format_error(err)})") from None  # fmt: skip


def _check_scheduler(sched: SchedulerConfig, search: SearchConfig, epochs: int) -> None:
    """A scheduler that could stop no trial is refused (ASHA, Li et al. 2020: a trial is stopped at a rung,
    ``grace_period * reduction_factor**k`` epochs, short of the last epoch; a rung keeps the top
    1/reduction_factor of an arm's points; at most ``num_samples - min_finished`` trials per arm are stopped)."""
    if sched.grace_period > epochs:
        raise ConfigError(
            f"sweep.scheduler.grace_period: {sched.grace_period} exceeds finetune.epochs={epochs}"
        )
    if sched.grace_period == epochs:
        raise ConfigError(f"sweep.scheduler.grace_period: {sched.grace_period} equals finetune.epochs, so no "
                          "trial could be stopped before its last epoch; lower it or drop sweep.scheduler")  # fmt: skip
    if search.num_samples < sched.reduction_factor:
        raise ConfigError(f"sweep.scheduler.reduction_factor: {sched.reduction_factor:g} points per arm make one "
                          f"rung, sweep.search.num_samples={search.num_samples} is fewer; raise it or drop "
                          "sweep.scheduler")  # fmt: skip
    if search.min_finished >= search.num_samples:
        raise ConfigError(f"sweep.search.min_finished: {search.min_finished} of num_samples={search.num_samples} "
                          "trials per arm must train every epoch, so the scheduler could stop none; lower it or "
                          "drop sweep.scheduler")  # fmt: skip


def _check_bracket(sweep: SweepConfig) -> None:
    """``sweep.select.bracket``: its key is chosen (in ``over``) and its grid values are log-spaced."""
    select = sweep.select
    if select.bracket is None:
        return
    key = bracket_key(select)
    if key is None:
        raise ConfigError(
            f"sweep.select.bracket.key: name the key to extend, one of sweep.select.over "
            f"({select.over or 'empty'})"
        )
    if key not in select.over:
        raise ConfigError(f"sweep.select.bracket.key: {key!r} is not in sweep.select.over ({select.over})")
    values = sweep.grid[key]
    if log_step(values) is None:
        raise ConfigError(
            f"sweep.select.bracket: sweep.grid.{key} must hold at least two positive numbers with a constant "
            f"ratio (a log-spaced grid, e.g. [0.0001, 0.001, 0.01]), got {values}"
        )
