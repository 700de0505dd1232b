"""The one validated configuration model for params.yaml.

Every entry point (DVC stages, `tcnn` verbs, Ray trials) calls :func:`load_params` before any compute.
Errors are raised as :class:`ConfigError` with a single line that names the offending dotted key.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:  # the registry is looked up by importlib at run time (see REGISTRIES)
    from core.models.kinds import ModelKind

FINETUNE_MODES = ("fresh", "continue")  # [TCNN21] Sec. 3 ("fresh") and Table 3 ("continue")
TIMM_WEIGHTS = "timm"  # pretrain.source.weights: timm's own pretrained weights for model.arch (a download)


# The default network: the project's CIFAR-style ResNet-10 with a dilated last stage (timm's output_stride=16),
# so at 28 px its last stage -- the one the T-CNN converts -- works on a 7x7 map, as the paper's last stage
# does at 224 px; on the plain resnet10_cifar it is 4x4, where a 3x3 conv already sees most of the map.
DEFAULT_ARCH = "resnet10_cifar_os16"
# model.code: the workspace file or folder of model.arch's own code, a DVC dependency of every stage that builds
# the network (dvc.yaml's ``${model.code}``); by default the file of the default arch (and of the project's other
# CIFAR ResNets), which those stages list already.
DEFAULT_CODE = "core/models/resnets.py"


# Allowed names live in the registries of the layers above; config sits at the bottom of core/ and imports none
# of them (so no stage depends on science code only for its names). Each is looked up here, by module and
# attribute, when a value is validated: (module, attribute; a callable attribute is called).
REGISTRIES: dict[str, tuple[str, str]] = {
    "datasets": ("core.data.catalog", "DATASETS"),
    "model_kinds": ("core.models.kinds", "kind_names"),
    "stride_modes": ("core.nn.attention_layers", "STRIDE_MODES"),
    "corruptions": ("core.robustness.suite", "CORRUPTIONS"),
    "public_sets": ("core.robustness.public_kinds", "PUBLIC_KINDS"),
    "precisions": ("core.training.precision", "PRECISIONS"),
}


def allowed(registry: str) -> tuple[str, ...]:
    """The names of ``registry`` (a key of `REGISTRIES`), from the module where they are defined."""
    module, attr = REGISTRIES[registry]
    names = getattr(importlib.import_module(module), attr)
    return tuple(names() if callable(names) else names)


def _one_of(value: Any, registry: str) -> Any:
    names = allowed(registry)
    if value not in names:
        quoted = [repr(n) for n in names]
        choices = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
        raise ValueError(f"Input should be {choices}, got {value!r}")
    return value


def _models() -> Any:
    """`core.models.factory` (the model factory), for the model section's checks (arch and options)."""
    return importlib.import_module("core.models.factory")


def _kinds() -> Any:
    """`core.models.kinds`, the kind registry: names and records only (it imports nothing heavy)."""
    return importlib.import_module("core.models.kinds")


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key."""


#: The largest seed: torch.manual_seed takes 64-bit seeds, and derived seeds are hashed from it.
SEED_MAX = 2**63 - 1
#: The largest seed NumPy's legacy seeding and Optuna's samplers take (``sweep.search.seed``): 2**32 - 1.
SEED32_MAX = 2**32 - 1
# Upper bounds of the counts (issue 59): each far beyond any run this project makes, so that a typo
# (10**20 points, a million epochs) is refused in one line instead of running for ever or overflowing a library.
EPOCHS_MAX = 100_000
BATCH_MAX = 1_000_000
IMAGES_MAX = 100_000_000  # images of a split, a corrupted set or a cap (ImageNet's training split: 1.28 M)
STEPS_MAX = 10_000_000
TRIALS_MAX = 10_000  # points of a search, retries of a trial
CPUS_MAX = 4096  # CPUs / GPUs of one trial, processes of a stage


class _Strict(BaseModel):
    # allow_inf_nan=False: every float of the params is finite (NaN passes gt=0 checks, and an infinite lr or
    # init reaches the training loop as a NaN logit or an OverflowError).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1 / 1.0 (YAML also reads yes/no/on/off as booleans).
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation in (
            int,
            float,
            int | None,
            float | None,
        ):
            raise ValueError(f"expected a number, got {v!r}")
        return v


class LimitConfig(_Strict):
    """``data.limit``, the smoke size: a class-balanced cap on the images of each split
    (`core.data.splits.limit_positions`: classes take turns in index order). ``train`` caps the images a run
    trains on (after the validation carve and the fraction; epochs are not rescaled), ``val`` its validation
    images, ``test`` the test split every stage evaluates on and so every set made from it (the corrupted
    sets take at most that many: ``robustness.n_images`` and ``robustness.public.n_images`` are capped at it).
    None leaves a split whole. A capped run answers nothing: it checks that a preset runs end to end."""

    train: int | None = Field(None, gt=0, le=IMAGES_MAX)
    val: int | None = Field(None, gt=0, le=IMAGES_MAX)
    test: int | None = Field(None, gt=0, le=IMAGES_MAX)

    def caps(self) -> dict[str, int | None]:
        return {"train": self.train, "val": self.val, "test": self.test}


class DataConfig(_Strict):
    name: str = "fashion_mnist"  # a key of core.data.catalog.DATASETS
    source: Path | None = None  # raw files; None = the dataset's default location (or a download)
    dir: Path = Path("data/fashion_mnist")  # Parquet shards + manifest.json
    sample_fraction: float = Field(1.0, gt=0.0, le=1.0)
    val_size: int = Field(5000, ge=0, le=IMAGES_MAX)
    # Where validation (lr choice, early stopping) comes from (core.data.splits.VAL_FROM): "train" carves val_size
    # images out of the training split; "test_half" takes a fixed, seed-independent, class-balanced half of the
    # test split (per class in test-index order, the even ranks; core.data.splits.half_split) and keeps the other
    # half as the test split every stage reads -- for a CNN trained on every training image (a released one,
    # pretrain.source). Training then uses every training image: val_size must be 0.
    val_from: Literal["train", "test_half"] = "train"
    image_size: int = Field(28, ge=8, le=1024)
    num_workers: int = Field(0, ge=0, le=64)
    shard_rows: int = Field(10000, ge=16, le=IMAGES_MAX)
    # ImageFolder (encoded) datasets: decode and augment each batch from the shards in `num_workers` DataLoader
    # workers (core.data.stream: RandomResizedCrop(image_size) + flip; eval resize + centre crop) instead of
    # decoding the whole dataset into memory -- what ImageNet needs.
    stream: bool = False
    # [ConViT21] Table 2: at fraction f < 1 every phase trains max(1, round(E / f)) epochs, so it sees as many images
    # as the full-data run (`plan_epochs`; the DVC path and the sweeps apply the same function).
    fraction_scales_epochs: bool = True
    # The smoke size (LimitConfig): None = every image of every split.
    limit: LimitConfig | None = None

    def caps(self) -> dict[str, int | None] | None:
        """``limit`` as the mapping core.data takes (None: no split capped)."""
        return None if self.limit is None else self.limit.caps()

    def capped(self, n: int) -> int:
        """``n`` images of a set made from the test split, capped at ``limit.test``."""
        cap = None if self.limit is None else self.limit.test
        return n if cap is None else min(n, cap)

    @field_validator("name")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        return _one_of(v, "datasets")

    @field_validator("source")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is not None and not os.access(v, os.R_OK):
            raise ValueError(f"path {str(v)!r} does not exist or is not readable")
        return v


class ModelConfig(_Strict):
    kind: str = "tcnn"  # a kind of the registry, core.models.kinds
    arch: str = DEFAULT_ARCH
    # A file or folder, relative to the workspace: DVC reruns the stages that build the network when it changes;
    # a builder's workspace modules must lie in it (`_holds_builder`).
    code: Path = Path(DEFAULT_CODE)
    drop_path: float = Field(0.0, ge=0.0, lt=1.0)
    options: dict[str, Any] = Field(default_factory=dict)

    @property
    def record(self) -> ModelKind:
        """The `core.models.kinds.ModelKind` record of ``kind``: what the stages hand to the model code."""
        return _kinds().get(self.kind)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return _one_of(v, "model_kinds")

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if kind is not None:
            _models().check_arch(_kinds().get(kind), v)
        return v

    @field_validator("code")
    @classmethod
    def _holds_builder(cls, v: Path, info: ValidationInfo) -> Path:
        """``code`` is not the workspace itself (that it is a path relative to the workspace, inside it, that
        exists is checked where the params are read, :func:`check_workspace_paths`: a sweep's trials get it
        absolute), and a user's builder in the workspace (``model.arch: package.module:function``) lies in it:
        dvc.yaml makes it a dependency of every stage that builds the network
        (`core.models.builders.check_code`)."""
        if Path.cwd().resolve().is_relative_to((Path.cwd() / v).resolve()):
            raise ValueError(
                f"{v} holds the whole workspace (the stages' outputs too): name the network's code"
            )
        arch = info.data.get("arch")
        builders = importlib.import_module("core.models.builders")
        if arch is not None and builders.is_builder(arch):
            builders.check_code(arch, v)
        return v

    @field_validator("options")
    @classmethod
    def _kind_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The kind's options as its registry record allows them (`core.models.check_model_options`): the
        ablation switches ([ConViT21] Table 3), a conversion that lives in the options, the kind's own checks."""
        kind = info.data.get("kind")
        if kind is not None:
            try:
                _models().check_model_options(_kinds().get(kind), v)
            except ValueError as err:
                raise ValueError(str(err).removeprefix("options.")) from None
        return v


class AugmentConfig(_Strict):
    """Training augmentation. One policy (`Params.augment`) serves pretraining, fine-tuning and the control;
    `pretrain.augment` / `finetune.augment` replace it for one phase when set."""

    crop_padding: int = Field(0, ge=0, le=1024)
    hflip: bool = True
    randaugment: str | None = None  # a timm RandAugment spec, e.g. "rand-m9-mstd0.5"
    mixup: float = Field(0.0, ge=0.0)
    cutmix: float = Field(0.0, ge=0.0)
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)

    @field_validator("randaugment")
    @classmethod
    def _randaugment_spec(cls, v: str | None) -> str | None:
        if v is not None:
            from timm.data.auto_augment import rand_augment_transform  # lazy, like the arch check

            try:
                rand_augment_transform(v, {})
            except (AssertionError, ValueError, KeyError, IndexError):
                raise ValueError(f"invalid RandAugment spec {v!r} (e.g. 'rand-m9-mstd0.5-inc1')") from None
        return v


class SourceConfig(_Strict):
    """A pretrained CNN imported instead of trained (`stages.pretrain`, T-CNN, d'Ascoli et al. 2021: "transition
    smoothly from any pretrained CNN"): ``weights`` is a checkpoint file (timm / torchvision state dict,
    safetensors, or a dict holding one under ``state_dict`` or ``model``) or "timm" (timm's own pretrained
    weights for model.arch; a download). ``mean`` / ``std``: the input normalization the network was trained
    with (required for a user's own builder; timm archs take their ``pretrained_cfg``'s)."""

    weights: str = Field(min_length=1)
    sha256: str | None = None  # required for a file; checked where the file is read
    mean: list[float] | None = None
    std: list[float] | None = None

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str | None) -> str | None:
        """One spelling only: DVC compares the params' text, so an upper-case copy of the same digest would
        rerun every stage that reads it."""
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v.lower()):
            raise ValueError(f"expected the file's sha256 as 64 hex digits, got {v!r}")
        if v is not None and v != v.lower():
            raise ValueError(f"write the sha256 in lower case, as sha256sum prints it: {v.lower()}")
        return v

    @field_validator("std")
    @classmethod
    def _positive_std(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or not all(math.isfinite(s) and s > 0 for s in v)):
            raise ValueError(f"expected positive finite numbers, got {v!r}")
        return v

    @model_validator(mode="after")
    def _file_or_timm(self) -> SourceConfig:
        if (self.mean is None) != (self.std is None) or (self.mean and len(self.mean) != len(self.std or [])):
            raise ValueError("mean and std: give both, one value per input channel")
        if self.weights == TIMM_WEIGHTS:
            return self
        if self.sha256 is None:
            raise ValueError("sha256: required for a weights file (sha256sum FILE)")
        if not Path(self.weights).is_file() or not os.access(self.weights, os.R_OK):
            raise ValueError(f"weights: {self.weights!r} is not a readable file")
        return self

    @property
    def is_file(self) -> bool:
        return self.weights != TIMM_WEIGHTS


class PretrainConfig(_Strict):
    epochs: int = Field(2, gt=0, le=EPOCHS_MAX)
    batch_size: int = Field(128, gt=0, le=BATCH_MAX)
    lr: float = Field(0.1, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(5e-4, ge=0.0)
    warmup_epochs: float = Field(0.3, ge=0.0)
    checkpoint_epochs: list[int] = Field(default_factory=list)  # extra t1 epochs to keep
    # resume checkpoints between epoch ends; 0 = epoch ends only
    checkpoint_every_steps: int = Field(200, ge=0, le=STEPS_MAX)
    augment: AugmentConfig | None = None  # None = the shared policy `augment`
    # A pretrained CNN to import instead of training one (SourceConfig); None = train it here.
    source: SourceConfig | None = None
    # The pretrained CNN's own seed (its init, data order, the train/validation split and the corruption
    # noise); None = the run's `seed`. Trials that differ only in `seed` then share one CNN and fine-tune it
    # as replicates (Params.cnn_seed; the analysis treats the CNN as the unit, pipelines/sweep/selection.py).
    seed: int | None = Field(None, ge=0, le=SEED_MAX)


class ReparamConfig(_Strict):
    epoch: int = Field(2, ge=0, le=EPOCHS_MAX)  # t1; 0 = reparameterize the untrained CNN
    alpha_init: float = Field(1.0, gt=0.0)
    lambda_init: float = 1.0
    stride_mode: str = "exact"  # core.nn.positional.STRIDE_MODES
    # Which k x k convs become GPSA: indices into a ResNet's stages layer1..layerN (negative from the end), or
    # module-name patterns (fnmatch, e.g. "features.7.*") for a net that is not ResNet-like.
    stages: list[int | str] = Field(default_factory=lambda: [-1])

    @field_validator("stages")
    @classmethod
    def _indices_or_patterns(cls, v: list[int | str]) -> list[int | str]:
        if not v:
            raise ValueError("must name at least one stage index or module-name pattern")
        if any(isinstance(s, bool) for s in v):
            raise ValueError(f"expected stage indices or module-name patterns, got {v!r}")
        return v

    @field_validator("stride_mode")
    @classmethod
    def _known_stride_mode(cls, v: str) -> str:
        return _one_of(v, "stride_modes")


class StopConfig(_Strict):
    """Early stopping on validation accuracy (core.training.early_stop): stop once the validation correct-image
    count has not risen by >= ``min_delta_images`` (0 counts as 1) for ``patience`` consecutive epochs, keeping
    the best-validation epoch's weights; ``finetune.epochs`` is then the maximum."""

    patience: int = Field(3, ge=1, le=EPOCHS_MAX)
    min_delta_images: int = Field(10, ge=0, le=IMAGES_MAX)


class FinetuneConfig(_Strict):
    epochs: int = Field(1, gt=0, le=EPOCHS_MAX)
    mode: Literal[FINETUNE_MODES] = "fresh"
    # Both learning rates are the paper's values at batch 1024 ([TCNN21] Sec. 3: AdamW warmed up to 1e-4, the gates
    # at 0.1) and both scale linearly with batch_size, so the gate / weight ratio stays the paper's 1000.
    lr: float = Field(1e-4, gt=0.0)
    gate_lr: float = Field(0.1, gt=0.0)
    batch_size: int = Field(128, gt=0, le=BATCH_MAX)
    weight_decay: float = Field(0.05, ge=0.0)
    warmup_epochs: float = Field(0.2, ge=0.0)
    drop_path: float = Field(0.1, ge=0.0, lt=1.0)
    image_size: int | None = Field(None, ge=8, le=1024)  # None = pretraining resolution
    checkpoint_every_steps: int = Field(200, ge=0, le=STEPS_MAX)
    freeze: list[str] = Field(default_factory=list)  # parameter leaf names to freeze, e.g. [qkv_weight]
    augment: AugmentConfig | None = None  # None = the shared policy `augment`
    # The matched control: the same pretrained checkpoint fine-tuned with this same recipe, without attention
    # ([TCNN21] Table 1's "without SA" column). false skips it (and every comparison against it).
    control: bool = True
    # The control's own lr (at batch 1024), for a comparison whose arms' lrs were chosen apart on validation
    # data (e.g. a pilot sweep's sweep.select); None = lr, the one recipe of both arms (Params.for_control).
    control_lr: float | None = Field(None, gt=0.0)
    # Early stopping on validation accuracy, the same rule for the T-CNN and its control; None = run all epochs.
    stop: StopConfig | None = None

    def scaled_lrs(self) -> tuple[float, float]:
        """(weight lr, gate lr) at this batch size: both given at batch 1024 and scaled linearly."""
        scale = self.batch_size / 1024
        return self.lr * scale, self.gate_lr * scale


class PublicSetsConfig(_Strict):
    """A published corrupted benchmark to evaluate on (core.robustness.public_sets.PublicSets): next to the
    generated sets (``use: add``: results/public/, metrics.json "public", ``public_*`` summary metrics) or
    instead of them (``use: replace``: the main results are the published sets')."""

    kind: str  # a key of core.robustness.public_kinds.PUBLIC_KINDS
    dir: Path  # CIFAR-10-C: <dir>/<corruption>.npy + labels.npy; ImageNet-C: <dir>/<corruption>/<severity>/<wnid>/
    use: Literal["add", "replace"] = "add"
    n_images: int | None = Field(
        None, gt=0, le=IMAGES_MAX
    )  # images per set (evenly spaced); None = robustness.n_images

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return _one_of(v, "public_sets")

    @field_validator("dir")
    @classmethod
    def _exists(cls, v: Path) -> Path:
        if not Path(v).is_dir():
            raise ValueError(f"{v} is not a directory")
        return v


class RobustnessConfig(_Strict):
    n_images: int = Field(500, gt=0, le=IMAGES_MAX)
    corruptions: list[str] = Field(default_factory=lambda: list(allowed("corruptions")))
    severities: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5])
    dir: Path = Path("data/fashion_mnist-c")
    batch_size: int = Field(500, gt=0, le=BATCH_MAX)
    # CE/mCE normaliser: "cnn" (this run's pretrained CNN), "alexnet" (ImageNet-C only), or a baseline JSON
    baseline: str = Field("cnn", min_length=1)
    workers: int = Field(0, ge=0, le=256)  # corrupt-stage processes; 0 = all cores
    # Paired bootstrap over test images for every difference evaluate reports (95% percentile intervals).
    bootstrap: int = Field(1000, ge=10, le=100_000)
    public: PublicSetsConfig | None = None  # a published benchmark (CIFAR-10-C, ImageNet-C, ...)

    @field_validator("corruptions")
    @classmethod
    def _known_corruptions(cls, v: list[str]) -> list[str]:
        known = allowed("corruptions")
        bad = [c for c in v if c not in known]
        if bad:
            raise ValueError(f"unknown corruption(s) {bad}; choose from {list(known)}")
        if not v:
            raise ValueError("must name at least one corruption")
        return v

    @field_validator("severities")
    @classmethod
    def _severity_range(cls, v: list[int]) -> list[int]:
        if not v or any(s < 1 or s > 5 for s in v):
            raise ValueError(f"severities must be a non-empty subset of 1..5, got {v}")
        return sorted(set(v))


class BracketConfig(_Strict):
    """Bracketing (pipelines/sweep/bracket.py): while an arm's validation-chosen value of ``key`` is the
    smallest or largest value of the grid, the sweep adds the next value beyond that edge (one step of the
    grid's constant ratio) and runs the new trials, at most ``max_rounds`` times."""

    key: str | None = None  # a key of sweep.select.over with a log-spaced grid; None: the one key of over
    max_rounds: int = Field(3, ge=1, le=10)


class SelectConfig(_Strict):
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


class SearchConfig(_Strict):
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


class SchedulerConfig(_Strict):
    """``sweep.scheduler``: early stopping on each arm's own validation accuracy, one copy per arm
    (pipelines/sweep/scheduling.py; ASHA: Li et al. 2020, "A System for Massively Parallel Hyperparameter
    Tuning", Alg. 2)."""

    kind: Literal["asha"] = "asha"
    grace_period: int = Field(
        1, ge=1, le=EPOCHS_MAX
    )  # fine-tuning epochs every trial trains before it can be stopped
    reduction_factor: float = Field(2.0, gt=1.0)  # the top 1/reduction_factor of a rung go on


class SweepConfig(_Strict):
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


class TrackingConfig(_Strict):
    enabled: bool = True
    uri: str = "sqlite:///mlruns.db"
    experiment: str = Field("tcnn", min_length=1)


class Params(_Strict):
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
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, v: str) -> str:
        return _one_of(v, "precisions")

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
        kind = importlib.import_module("core.robustness.public_kinds").PUBLIC_KINDS[pub.kind]
        data = importlib.import_module("core.data.catalog").DATASETS[self.data.name]
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
            tables = importlib.import_module("core.robustness.corruption_tables")
            size = self.test_image_size()
            band = tables.band_for_size(size, size)
            if band != "imagenet":
                raise ValueError(
                    f"robustness.baseline: alexnet holds ImageNet-C's errors, which normalise ImageNet-sized "
                    f"images only; this run tests at {size} px (the {band} band): use cnn or a baseline file"
                )

    def _check_import(self) -> None:
        """What an imported CNN rules out: there is no training run here to pick t1 from or to continue."""
        if "reparam.epoch" in self.sweep.grid:
            raise ValueError(
                "sweep.grid.reparam.epoch: the CNN is imported (pretrain.source), not trained here"
            )
        if self.finetune.mode == "continue":
            raise ValueError(
                "finetune.mode: 'continue' resumes a pretraining run, and pretrain.source imports the CNN"
            )
        if not self.model.record.pretrains_cnn:
            takers = [k.name for k in _kinds().all_kinds() if k.pretrains_cnn]
            raise ValueError(
                f"pretrain.source: imports a CNN for model.kind {takers}, not {self.model.kind!r}"
            )
        importlib.import_module("core.models.importing").check_source(self.model.arch, self.pretrain.source)

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

    def with_overrides(self, overrides: dict[str, Any]) -> Params:
        """A validated copy with dotted keys replaced (used by `-S key=value` and sweep grids)."""
        raw = self.model_dump(mode="json")
        for key, value in overrides.items():
            set_dotted(raw, key, value)
        return validate_params(raw)


def scaled_epochs(epochs: int, fraction: float) -> int:
    """Epochs at training-sample fraction f that see as many images as `epochs` at f = 1 ([ConViT21] Table 2):
    max(1, round(E / f)); e.g. E = 3 gives 10 at f = 0.3 and 4 at f = 0.7."""
    return max(1, round(epochs / fraction))


def plan_epochs(params: Params) -> Params:
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


GRID_PREFIX = "sweep.grid."


def _set_grid(raw: dict[str, Any], key: str, value: Any) -> bool:
    """`sweep.grid.<dotted param>`: everything after the prefix is one grid key (DESIGN section 4)."""
    if not key.startswith(GRID_PREFIX) or len(key) == len(GRID_PREFIX):
        return False
    sweep = raw.setdefault("sweep", {})
    if not isinstance(sweep, dict):
        raise ConfigError(f"{key}: sweep is not a mapping")
    if not isinstance(sweep.get("grid"), dict):
        sweep["grid"] = {}
    sweep["grid"][key[len(GRID_PREFIX) :]] = value
    return True


def set_dotted(raw: dict[str, Any], key: str, value: Any, *, create: bool = False) -> None:
    """Set the dotted ``key`` of the raw params mapping (the one override path: `-S key=value`, sweep grid
    values). ``create``: a key params.yaml leaves at its default may be named (its sections are created; the
    model still rejects unknown keys); otherwise only existing keys, keys of an optional section left at
    null, and grid / options entries."""
    if _set_grid(raw, key, value):
        return
    node = raw
    *parents, leaf = key.split(".")
    opened = False  # an optional section left at null (e.g. pretrain.augment): its keys come from the model
    for part in parents:
        if node.get(part) is None and (part in node or create):
            node[part], opened = {}, True
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"{key}: unknown key")
        node = node[part]
    if leaf not in node and not (opened or create) and not (parents and parents[-1] in ("grid", "options")):
        raise ConfigError(f"{key}: unknown key")
    node[leaf] = value


def _format_error(err: ValidationError) -> str:
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


def validate_params(raw: Any) -> Params:
    if not isinstance(raw, dict):
        raise ConfigError(f"params: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        params = Params.model_validate(copy.deepcopy(raw))
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    for key, values in params.sweep.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
        for value in values:
            try:
                base = params.model_dump(mode="json")
                base["sweep"]["grid"] = {}
                set_dotted(base, key, value)
                Params.model_validate(base)
            except ValidationError as err:
                raise ConfigError(
                    f"sweep.grid.{key}: value {value!r} is invalid ({_format_error(err)})"
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


def _check_search(params: Params) -> None:
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
                Params.model_validate(base)
            except ValidationError as err:
                raise ConfigError(f"sweep.search.space.{key}: {kind} value {value!r} is invalid "
                                  f"({_format_error(err)})") from None  # fmt: skip


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


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `3`, `0.5`, `1e-4`, `true`, `[1, 2]` get their types), by
    the loader of the params files (:class:`ParamsLoader`), so a value reads the same in a file and in `-S`."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, value = text.split("=", 1)
    try:
        return key.strip(), yaml.load(value, Loader=ParamsLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({mark})") from None


#: YAML 1.2's float (core schema, section 10.3.2): a dot or an exponent, so ``1e-4`` and ``1E5`` are numbers.
#: YAML 1.1 (PyYAML) needs a dot, and reads ``1e-4`` as the string "1e-4" where DVC (YAML 1.2) reads a float.
_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")


class ParamsLoader(yaml.SafeLoader):
    """YAML's safe loader reading numbers as YAML 1.2 (and DVC, which reads params.yaml too) does: ``1e-4``,
    ``5E-3``, ``1e5`` are floats, in a params file and in a ``-S`` value alike (block or flow style). Plain
    integers stay integers (PyYAML's int resolver is tried first); ``.inf`` / ``.nan`` keep their YAML 1.1
    spelling."""


ParamsLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+.0123456789"))


def read_yaml(text: str) -> Any:
    """``text`` as :class:`ParamsLoader` reads it (numbers as in a params file)."""
    return yaml.load(text, Loader=ParamsLoader)  # noqa: S506 - a SafeLoader subclass


class _UniqueKeyLoader(ParamsLoader):
    """The params loader (:class:`ParamsLoader`), refusing a key given twice in one mapping (``{epochs: 1,
    epochs: 7}``: plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(path: Path, text: str, err: yaml.YAMLError) -> ConfigError:
    """One line: where (the line of the problem, or of the last line when the file ends early) and what."""
    mark = getattr(err, "problem_mark", None)
    where = ""
    if mark is not None:
        last = max(1, len(text.rstrip("\n").splitlines()))
        where = f" at line {min(mark.line + 1, last)}"
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ConfigError(f"{path}: not valid YAML{where}: {what}")


def check_workspace_paths(params: Params, workspace: Path | None = None) -> None:
    """What the params name in the workspace and must find there before anything runs (docs/configuration.md):
    ``model.code``, a DVC dependency of the stages that build the network, is relative to the workspace and
    stays inside it (no absolute path, no ``..``: DVC would hash another file, and an absolute path changes
    with the clone); in a DVC workspace whose dvc.yaml depends on it (``${model.code}``, where `dvc repro`
    runs the stages) it exists (DVC would fail at the first stage with its own error) and no symlink leads it outside.
    Outside a DVC workspace (a stage run alone from another folder) it is no dependency and is not looked for.
    Called by :func:`load_params`, not by the model: a sweep's trials get it absolute (pipelines/sweep/plan.py)."""
    rel = params.model.code
    if rel.is_absolute() or os.path.normpath(rel).split(os.sep)[0] == "..":
        raise ConfigError(f"model.code: {rel} is not inside the workspace: give the network's code as a path "
                          f"relative to it (a DVC dependency; e.g. {DEFAULT_CODE})")  # fmt: skip
    root = (workspace or Path.cwd()).resolve()
    try:  # a DVC workspace whose stages depend on it (dvc.yaml reads ``${model.code}``)
        if "${model.code}" not in (root / "dvc.yaml").read_text():
            return
    except (OSError, UnicodeDecodeError):
        return
    code = root / rel
    if not code.exists():
        raise ConfigError(f"model.code: {params.model.code} does not exist in the workspace {root} (the file or "
                          f"folder of model.arch's code; the default is {DEFAULT_CODE})")  # fmt: skip
    if not code.resolve().is_relative_to(root):
        raise ConfigError(f"model.code: {params.model.code} leads outside the workspace ({code.resolve()}): "
                          "keep the network's code in the workspace")  # fmt: skip


def load_params(path: str | os.PathLike = "params.yaml", overrides: list[str] | None = None) -> Params:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a params file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the params file ({type(err).__name__})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise _yaml_error(path, text, err) from None
    if raw is None:
        raw = {}
    if overrides:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        for text in overrides:
            key, value = parse_override(text)
            set_dotted(raw, key, value, create=True)
    try:
        params = validate_params(raw)
        check_workspace_paths(params)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return params
