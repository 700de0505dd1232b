"""The science's sections of params.yaml (data, model, augment, pretrain, reparam, finetune, robustness) and
tracking: plain validated values. A name or a rule only the science knows (a dataset, a model kind, an arch)
is asked of it through `core.config.rules`, never imported here."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from core.config import rules
from core.config.base import (
    BATCH_MAX,
    DEFAULT_ARCH,
    DEFAULT_CODE,
    EPOCHS_MAX,
    FINETUNE_MODES,
    IMAGES_MAX,
    SEED_MAX,
    STEPS_MAX,
    TIMM_WEIGHTS,
    Strict,
)

if TYPE_CHECKING:  # the record comes from the science's answer (rules.MODEL_KIND)
    from core.models.kinds import ModelKind


class LimitConfig(Strict):
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


class DataConfig(Strict):
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
        return rules.one_of(v, rules.DATASETS)

    @field_validator("source")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is not None and not os.access(v, os.R_OK):
            raise ValueError(f"path {str(v)!r} does not exist or is not readable")
        return v


class ModelConfig(Strict):
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
        return rules.rule(rules.MODEL_KIND)(self.kind)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return rules.one_of(v, rules.MODEL_KINDS)

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if kind is not None:
            rules.rule(rules.CHECK_ARCH)(rules.rule(rules.MODEL_KIND)(kind), v)
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
        if arch is not None:
            rules.rule(rules.CHECK_BUILDER_CODE)(arch, v)
        return v

    @field_validator("options")
    @classmethod
    def _kind_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The kind's options as its registry record allows them (`core.models.check_model_options`): the
        ablation switches ([ConViT21] Table 3), a conversion that lives in the options, the kind's own checks."""
        kind = info.data.get("kind")
        if kind is not None:
            try:
                rules.rule(rules.CHECK_MODEL_OPTIONS)(rules.rule(rules.MODEL_KIND)(kind), v)
            except ValueError as err:
                raise ValueError(str(err).removeprefix("options.")) from None
        return v


class AugmentConfig(Strict):
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


class SourceConfig(Strict):
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


class PretrainConfig(Strict):
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


class ReparamConfig(Strict):
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
        return rules.one_of(v, rules.STRIDE_MODES)


class StopConfig(Strict):
    """Early stopping on validation accuracy (core.training.early_stop): stop once the validation correct-image
    count has not risen by >= ``min_delta_images`` (0 counts as 1) for ``patience`` consecutive epochs, keeping
    the best-validation epoch's weights; ``finetune.epochs`` is then the maximum."""

    patience: int = Field(3, ge=1, le=EPOCHS_MAX)
    min_delta_images: int = Field(10, ge=0, le=IMAGES_MAX)


class FinetuneConfig(Strict):
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


class PublicSetsConfig(Strict):
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
        return rules.one_of(v, rules.PUBLIC_SETS)

    @field_validator("dir")
    @classmethod
    def _exists(cls, v: Path) -> Path:
        if not Path(v).is_dir():
            raise ValueError(f"{v} is not a directory")
        return v


class RobustnessConfig(Strict):
    n_images: int = Field(500, gt=0, le=IMAGES_MAX)
    corruptions: list[str] = Field(default_factory=lambda: list(rules.names(rules.CORRUPTIONS)))
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
        known = rules.names(rules.CORRUPTIONS)
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


class TrackingConfig(Strict):
    enabled: bool = True
    uri: str = "sqlite:///mlruns.db"
    experiment: str = Field("tcnn", min_length=1)
