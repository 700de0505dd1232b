"""The one validated configuration model for params.yaml's science, by concern: the strict base and bounds
(`base`), the science's answers to the config's questions (`rules`), the sections (`sections`), the whole model
with its cross-section rules and the epoch plan (`params`), dotted overrides (`dotted`) and reading a file
(`loading`). Errors are raised as :class:`ConfigError` with a single line that names the offending dotted key.

The sweep's section (grid, select, search, scheduler, resources) is the sweep's: pipelines/sweep/settings.py."""

from core.config import rules
from core.config.base import (
    BATCH_MAX,
    CPUS_MAX,
    DEFAULT_ARCH,
    DEFAULT_CODE,
    EPOCHS_MAX,
    FINETUNE_MODES,
    IMAGES_MAX,
    SEED_MAX,
    STEPS_MAX,
    TIMM_WEIGHTS,
    ConfigError,
    Strict,
)
from core.config.dotted import set_dotted
from core.config.loading import (
    ParamsLoader,
    check_workspace_paths,
    load_as,
    load_params,
    parse_override,
    read_params,
    read_yaml,
)
from core.config.params import Params, format_error, plan_epochs, scaled_epochs, validate_params
from core.config.rules import names as allowed
from core.config.sections import (
    AugmentConfig,
    DataConfig,
    FinetuneConfig,
    LimitConfig,
    ModelConfig,
    PretrainConfig,
    PublicSetsConfig,
    ReparamConfig,
    RobustnessConfig,
    SourceConfig,
    StopConfig,
    TrackingConfig,
)

__all__ = [
    "BATCH_MAX", "CPUS_MAX", "DEFAULT_ARCH", "DEFAULT_CODE", "EPOCHS_MAX", "FINETUNE_MODES", "IMAGES_MAX",
    "SEED_MAX", "STEPS_MAX", "TIMM_WEIGHTS", "AugmentConfig", "ConfigError", "DataConfig", "FinetuneConfig",
    "LimitConfig", "ModelConfig", "Params", "ParamsLoader", "PretrainConfig", "PublicSetsConfig", "ReparamConfig",
    "RobustnessConfig", "SourceConfig", "StopConfig", "Strict", "TrackingConfig", "allowed",
    "check_workspace_paths", "format_error", "rules", "load_as", "load_params", "parse_override", "plan_epochs",
    "read_params", "read_yaml", "scaled_epochs", "set_dotted", "validate_params",
]  # fmt: skip
