"""The layers' answers to the config (`core.config.rules`): GPSA's stride modes
(`core.nn.attention_layers.STRIDE_MODES`)."""

from __future__ import annotations

from core.config import rules
from core.nn.attention_layers import STRIDE_MODES

rules.register_names(rules.STRIDE_MODES, lambda: STRIDE_MODES)
