"""`Params`, the validated model of a params file's science (its sections, `core.config.sections`) with the
rules across sections, and the epoch plan of a run at a training-sample fraction ([ConViT21] Table 2).

A layer above adds its own section by subclassing `Params` (the sweep: ``pipelines/sweep/sweep_params.py``);
here the ``sweep`` section is only carried, as written."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator

from core.config import rules
from core.config.base import CPUS_MAX, SEED_MAX, ConfigError, Strict
from core.config.dotted import set_dotted
from core.config.sections import (
    AugmentConfig,
    DataConfig,
    FinetuneConfig,
    ModelConfig,
    PretrainConfig,
    ReparamConfig,
    RobustnessConfig,
    TrackingConfig,
)

P = TypeVar("P", bound="Params")


class Params(Strict):
    """params.yaml's science. ``sweep`` is the sweep's own section, carried as written (its model and checks
    live in the sweep package, which subclasses this model; core reads none of it)."""

    #: Mappings whose keys are whole dotted params (`core.config.dotted.set_dotted`'s ``flat``): none here.
    DOTTED_MAPS: ClassVar[tuple[str, ...]] = ()

    seed: int = Field(0, ge=0, le=SEED_MAX)
    precision: str = "auto"  # core.training.precision.PRECISIONS: auto | fp32 | bf16 | fp16
    # Data-parallel (DDP) processes per training run: torchrun under `dvc repro`, Ray Train workers in a sweep
    # trial (core.training.distributed). batch sizes stay global and must divide by it.
    workers_per_trial: int = Field(1, ge=1, le=CPUS_MAX)
    data: DataConfig = Field(default_factory=DataConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    reparam: ReparamConfig = Field(default_factory=ReparamConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    robustness: RobustnessConfig = Field(default_factory=RobustnessConfig)
    sweep: dict[str, Any] = Field(default_factory=dict)  # the sweep's section (pipelines/sweep/settings.py)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, v: str) -> str:
        return rules.one_of(v, rules.PRECISIONS)

    @model_validator(mode="after")
    def _cross_checks(self) -> Params:
        if self.pretrain.source is not None:
            self._check_import()
        elif self.reparam.epoch > self.pretrain.epochs:
            raise ValueError(
                f"reparam.epoch: t1={self.reparam.epoch} exceeds pretrain.epochs={self.pretrain.epochs}"
            )
        bad = [e for e in self.pretrain.checkpoint_epochs if not 0 <= e <= self.pretrain.epochs]
        if bad:
            raise ValueError(
                f"pretrain.checkpoint_epochs: {bad} outside 0..pretrain.epochs={self.pretrain.epochs}"
            )
        for key, size in (("pretrain", self.pretrain.batch_size), ("finetune", self.finetune.batch_size)):
            if size % self.workers_per_trial:
                raise ValueError(
                    f"{key}.batch_size: {size} is not divisible by workers_per_trial={self.workers_per_trial}"
                    " (batch sizes are global, split evenly among the data-parallel workers)"
                )
        if self.data.stream and self.data.name != "imagefolder":
            raise ValueError("data.stream: only ImageFolder (encoded) datasets are streamed")
        if self.data.stream and any(self.augment_for(p).randaugment for p in ("pretrain", "finetune")):
            raise ValueError("augment.randaugment: not available with data.stream (RandomResizedCrop + flip)")
        if self.data.name == "imagefolder" and self.data.source is None:
            raise ValueError("data.source: an imagefolder dataset needs the path of its tree")
        self._check_val_from()
        self._check_robustness_paths_and_baseline()
        self._check_public_fits_dataset()
        return self

    def _check_val_from(self) -> None:
        """``data.val_from: test_half`` takes validation from the test split, so none is carved from the training
        split, and a published benchmark (made from the whole test split, validation half included) cannot be
        evaluated as its test half."""
        if self.data.val_from != "test_half":
            return
        if self.data.val_size:
            raise ValueError(f"data.val_size: {self.data.val_size} carves validation from the training split, "
                             "data.val_from: test_half takes it from the test split; set data.val_size: 0")  # fmt: skip
        if self.robustness.public is not None:
            raise ValueError("robustness.public: a published benchmark covers the whole test split, validation "
                             "half included, not data.val_from: test_half's test half; drop one of them")  # fmt: skip

    def _check_public_fits_dataset(self) -> None:
        """A published benchmark's images (core.robustness.public_kinds.PUBLIC_KINDS) against this dataset's
        (core.data.catalog.DATASETS), where both names say enough: channels, classes and stored size."""
        pub = self.robustness.public
        if pub is None:
            return
        kind = rules.rule(rules.PUBLIC_SET)(pub.kind)
        data = rules.rule(rules.DATASET)(self.data.name)
        name = self.data.name
        for theirs, ours, says in (
            (
                kind.channels,
                data.channels,
                f"{kind.channels}-channel images, data.name {name} {data.channels}-channel ones",
            ),
            (
                kind.num_classes,
                data.num_classes,
                f"{kind.num_classes} classes, data.name {name} {data.num_classes}",
            ),
            (
                kind.image_size,
                data.image_size,
                f"{kind.image_size} px images, data.name {name} {data.image_size} px ones",
            ),
        ):
            if None not in (theirs, ours) and theirs != ours:
                raise ValueError(
                    f"robustness.public.kind: {pub.kind} holds {says} (it is not of this dataset)"
                )

    def _check_robustness_paths_and_baseline(self) -> None:
        """The corrupted sets live apart from the prepared data (inside it they would change prepare's DVC
        output), and AlexNet's ImageNet-C errors normalise only ImageNet-sized images (Hendrycks & Dietterich
        2019: the published errors are of 224 px ImageNet-C)."""
        rob, data = Path(self.robustness.dir), Path(self.data.dir)
        if rob == data or data in rob.parents or rob in data.parents:
            raise ValueError(
                f"robustness.dir: {rob} overlaps data.dir {data} (the corrupted sets need their own folder)"
            )
        if self.robustness.baseline == "alexnet":
            size = self.test_image_size()
            band = rules.rule(rules.CORRUPTION_BAND)(size, size)
            if band != "imagenet":
                raise ValueError(
                    f"robustness.baseline: alexnet holds ImageNet-C's errors, which normalise ImageNet-sized "
                    f"images only; this run tests at {size} px (the {band} band): use cnn or a baseline file"
                )

    def _check_import(self) -> None:
        """What an imported CNN rules out: there is no training run here to pick t1 from or to continue."""
        if self.finetune.mode == "continue":
            raise ValueError(
                "finetune.mode: 'continue' resumes a pretraining run, and pretrain.source imports the CNN"
            )
        if not self.model.record.pretrains_cnn:
            takers = [k.name for k in rules.rule(rules.ALL_MODEL_KINDS)() if k.pretrains_cnn]
            raise ValueError(
                f"pretrain.source: imports a CNN for model.kind {takers}, not {self.model.kind!r}"
            )
        rules.rule(rules.CHECK_SOURCE)(self.model.arch, self.pretrain.source)

    @property
    def cnn_seed(self) -> int:
        """The seed of what the pretrained CNN depends on (`pretrain.seed`, else `seed`): its init and data order,
        the train/validation split every stage reads, and the corrupted sets' noise."""
        return self.seed if self.pretrain.seed is None else self.pretrain.seed

    def for_control(self) -> Params:
        """The params the matched control trains with: these, at ``finetune.control_lr`` where it is set."""
        if self.finetune.control_lr is None:
            return self
        return self.model_copy(
            update={
                "finetune": self.finetune.model_copy(
                    update={"lr": self.finetune.control_lr, "control_lr": None}
                )
            }
        )

    @property
    def imports_cnn(self) -> bool:
        """The CNN comes from ``pretrain.source`` (imported), not from training here."""
        return self.pretrain.source is not None

    def t1(self) -> int:
        """The pretraining epoch whose checkpoint reparam converts and the control starts from: reparam.epoch,
        or 0 for an imported CNN (its state as imported; no epoch of training here)."""
        return 0 if self.imports_cnn else self.reparam.epoch

    def augment_for(self, phase: Literal["pretrain", "finetune"]) -> AugmentConfig:
        """The augmentation of a training phase: its own section's when set, else the shared policy."""
        own = getattr(self, phase).augment
        return own if own is not None else self.augment

    def test_image_size(self) -> int:
        """The one resolution every model is evaluated at: the fine-tuning resolution ([TCNN21] Sec. 3 may raise it
        over the pretraining one), so the CNN, the control and the T-CNN see the same test pixels."""
        return self.finetune.image_size or self.data.image_size

    def corrupted_images(self) -> int:
        """The test images each generated corrupted set holds: ``robustness.n_images``, capped at
        ``data.limit.test``."""
        return self.data.capped(self.robustness.n_images)

    def public_images(self) -> int:
        """The images per set of the published benchmark: ``robustness.public.n_images`` (None:
        ``robustness.n_images``), capped at ``data.limit.test``."""
        pub = self.robustness.public
        return self.data.capped((pub.n_images if pub is not None else None) or self.robustness.n_images)

    def with_overrides(self: P, overrides: dict[str, Any]) -> P:
        """A validated copy, of this same model, with dotted keys replaced (used by `-S key=value` and sweep
        grids)."""
        raw = self.model_dump(mode="json")
        for key, value in overrides.items():
            set_dotted(raw, key, value, flat=self.DOTTED_MAPS)
        return type(self).validated(raw)

    @classmethod
    def validated(cls: type[P], raw: Any) -> P:
        """``raw`` validated as this model, every rule included; a bad value is one `ConfigError` line. A
        subclass with its own section adds the checks of that section against the rest here."""
        return validate_params(raw, cls)


def scaled_epochs(epochs: int, fraction: float) -> int:
    """Epochs at training-sample fraction f that see as many images as `epochs` at f = 1 ([ConViT21] Table 2):
    max(1, round(E / f)); e.g. E = 3 gives 10 at f = 0.3 and 4 at f = 0.7."""
    return max(1, round(epochs / fraction))


def plan_epochs(params: P) -> P:
    """The epoch plan of a run at ``data.sample_fraction`` f < 1 with ``data.fraction_scales_epochs``: every
    phase trains E' = scaled_epochs(E, f) epochs. t1 (and every pretrain.checkpoint_epochs value) keeps its
    place in the schedule, t1' = round(t1 E'/E); warmups keep their share of the schedule. The DVC stages and
    the sweep planner both call this; the result has ``fraction_scales_epochs`` false, so planning an already
    planned config changes nothing."""
    f = params.data.sample_fraction
    if not params.data.fraction_scales_epochs or f >= 1.0:
        return params
    p, ft = params.pretrain, params.finetune
    e_new = scaled_epochs(p.epochs, f)
    s = e_new / p.epochs
    f_new = scaled_epochs(ft.epochs, f)
    return params.with_overrides(
        {
            "data.fraction_scales_epochs": False,
            "pretrain.epochs": e_new,
            "pretrain.warmup_epochs": p.warmup_epochs * s,
            "pretrain.checkpoint_epochs": sorted({min(e_new, round(e * s)) for e in p.checkpoint_epochs}),
            "reparam.epoch": min(e_new, round(params.reparam.epoch * s)),
            "finetune.epochs": f_new,
            "finetune.warmup_epochs": ft.warmup_epochs * f_new / ft.epochs,
        }
    )


def format_error(err: ValidationError) -> str:
    """pydantic's first error as one line naming the dotted key."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "params"
    msg = first["msg"].removeprefix("Value error, ")
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = "unknown key"
    elif (
        kind not in ("value_error", "missing")
        and isinstance(first.get("input"), (str, int, float, bool))
        and ", got " not in msg
    ):
        msg = f"{msg}, got {first['input']!r}"
    if not first["loc"] and ":" in msg:  # model-level errors already start with their key
        return msg
    return f"{loc}: {msg}"


def validate_params(raw: Any, model: type[P] = Params) -> P:  # type: ignore[assignment]
    """``raw`` (a params mapping) as ``model``'s fields and rules validate it, or one `ConfigError` line."""
    if not isinstance(raw, dict):
        raise ConfigError(f"params: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        return model.model_validate(copy.deepcopy(raw))
    except ValidationError as err:
        raise ConfigError(format_error(err)) from None
