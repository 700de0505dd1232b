"""The training science's answers to the config (`core.config.rules`): the numeric precisions
(`core.training.precision.PRECISIONS`)."""

from __future__ import annotations

from core.config import rules
from core.training.precision import PRECISIONS

rules.register_names(rules.PRECISIONS, lambda: PRECISIONS)
