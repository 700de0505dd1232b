"""The ground every section of the params model stands on: the strict base model, the bounds of the counts
and the one error type of a bad configuration (a single line naming the dotted key)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

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


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key."""


#: The largest seed: torch.manual_seed takes 64-bit seeds, and derived seeds are hashed from it.
SEED_MAX = 2**63 - 1
# Upper bounds of the counts (issue 59): each far beyond any run this project makes, so that a typo
# (10**20 points, a million epochs) is refused in one line instead of running for ever or overflowing a library.
EPOCHS_MAX = 100_000
BATCH_MAX = 1_000_000
IMAGES_MAX = 100_000_000  # images of a split, a corrupted set or a cap (ImageNet's training split: 1.28 M)
STEPS_MAX = 10_000_000
CPUS_MAX = 4096  # processes of a stage (and CPUs / GPUs of a sweep's trial)


class Strict(BaseModel):
    """A section of the params: unknown keys refused, assignments validated, every float finite, no bool for a
    number."""

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
