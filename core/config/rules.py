"""The science's answers to the config's questions: a registry the science owns and fills.

The config sits at the bottom of core/ and imports none of the science; a value it cannot judge alone (is
``fashion_mnist`` a dataset? does this arch build for this model kind?) it asks here, and the science layers
answer by registering at their import (``core/<package>/config_rules.py``; ``core/__init__.py`` imports those
modules, so any ``import core...`` has them registered before a params file is validated). Two kinds of
answers: the allowed names of a registry (:func:`names`) and a rule, a callable (:func:`rule`)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

# The questions (each answered by exactly one module of the science).
DATASETS = "datasets"  # names: core.data.catalog.DATASETS
DATASET = "dataset"  # rule: name -> its catalog record (channels, num_classes, image_size)
MODEL_KINDS = "model_kinds"  # names: core.models.kinds.kind_names
MODEL_KIND = "model_kind"  # rule: name -> its core.models.kinds.ModelKind record
ALL_MODEL_KINDS = "all_model_kinds"  # rule: () -> every ModelKind record
CHECK_ARCH = "check_arch"  # rule: (kind record, arch) -> None; ValueError when the arch does not build
CHECK_MODEL_OPTIONS = "check_model_options"  # rule: (kind record, options) -> None; ValueError
CHECK_BUILDER_CODE = "check_builder_code"  # rule: (arch, code path) -> None; ValueError (a user's builder)
CHECK_SOURCE = "check_source"  # rule: (arch, SourceConfig) -> None; ValueError (an imported CNN)
STRIDE_MODES = "stride_modes"  # names: core.nn.attention_layers.STRIDE_MODES
CORRUPTIONS = "corruptions"  # names: core.robustness.suite.CORRUPTIONS
PUBLIC_SETS = "public_sets"  # names: core.robustness.public_kinds.PUBLIC_KINDS
PUBLIC_SET = "public_set"  # rule: name -> its PublicKind record (channels, num_classes, image_size)
CORRUPTION_BAND = "corruption_band"  # rule: (height, width) -> the band of core.robustness.corruption_tables
PRECISIONS = "precisions"  # names: core.training.precision.PRECISIONS

_NAMES: dict[str, Callable[[], Collection[str]]] = {}
_RULES: dict[str, Callable[..., Any]] = {}


def register_names(question: str, provider: Callable[[], Collection[str]]) -> None:
    """The science answers ``question`` with the names ``provider()`` returns (called at each question)."""
    _NAMES[question] = provider


def register_rule(question: str, answer: Callable[..., Any]) -> None:
    """The science answers ``question`` with the callable ``answer``."""
    _RULES[question] = answer


def names(question: str) -> tuple[str, ...]:
    """The allowed names the science registered for ``question``."""
    try:
        provider = _NAMES[question]
    except KeyError:
        raise LookupError(f"no science module answered {question!r} (import core first)") from None
    return tuple(provider())


def rule(question: str) -> Callable[..., Any]:
    """The callable the science registered for ``question``."""
    try:
        return _RULES[question]
    except KeyError:
        raise LookupError(f"no science module answered {question!r} (import core first)") from None


def one_of(value: Any, question: str) -> Any:
    """``value`` when it is one of the names registered for ``question``; else ValueError, one line."""
    allowed = names(question)
    if value not in allowed:
        quoted = [repr(n) for n in allowed]
        choices = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
        raise ValueError(f"Input should be {choices}, got {value!r}")
    return value


def name_questions() -> tuple[str, ...]:
    """The questions answered with names so far (every one, once ``core`` is imported)."""
    return tuple(_NAMES)
