"""The robustness science's answers to the config (`core.config.rules`): the corruption names
(`core.robustness.suite`, Hendrycks & Dietterich 2019), the published benchmarks
(`core.robustness.public_kinds`), and the image-size band of the published errors
(`core.robustness.corruption_tables`, loaded when asked: it needs NumPy)."""

from __future__ import annotations

from core.config import rules
from core.robustness.public_kinds import PUBLIC_KINDS
from core.robustness.suite import CORRUPTIONS


def _band_for_size(height: int, width: int) -> str:
    from core.robustness.corruption_tables import band_for_size

    return band_for_size(height, width)


rules.register_names(rules.CORRUPTIONS, lambda: CORRUPTIONS)
rules.register_names(rules.PUBLIC_SETS, lambda: PUBLIC_KINDS)
rules.register_rule(rules.PUBLIC_SET, PUBLIC_KINDS.__getitem__)
rules.register_rule(rules.CORRUPTION_BAND, _band_for_size)
