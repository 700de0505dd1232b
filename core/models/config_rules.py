"""The model science's answers to the config (`core.config.rules`): the model kinds (the registry,
`core.models.kinds`), whether an arch builds for a kind and takes its options (the factory), whether a user's
builder lies in ``model.code`` (`core.models.builders`), whether an imported CNN's source fits its arch
(`core.models.importing`). The heavy modules load only when a rule is asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.config import rules
from core.models import kinds


def _check_arch(kind: kinds.ModelKind, arch: str) -> None:
    from core.models.factory import check_arch

    check_arch(kind, arch)


def _check_model_options(kind: kinds.ModelKind, options: dict[str, Any]) -> None:
    from core.models.factory import check_model_options

    check_model_options(kind, options)


def _check_builder_code(arch: str, code: Path) -> None:
    """A user's builder (``package.module:function``) lies in ``model.code`` (a DVC dependency)."""
    from core.models.builders import check_code, is_builder

    if is_builder(arch):
        check_code(arch, code)


def _check_source(arch: str, source: Any) -> None:
    from core.models.importing import check_source

    check_source(arch, source)


rules.register_names(rules.MODEL_KINDS, kinds.kind_names)
rules.register_rule(rules.MODEL_KIND, kinds.get)
rules.register_rule(rules.ALL_MODEL_KINDS, kinds.all_kinds)
rules.register_rule(rules.CHECK_ARCH, _check_arch)
rules.register_rule(rules.CHECK_MODEL_OPTIONS, _check_model_options)
rules.register_rule(rules.CHECK_BUILDER_CODE, _check_builder_code)
rules.register_rule(rules.CHECK_SOURCE, _check_source)
