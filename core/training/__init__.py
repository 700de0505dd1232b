"""Training: the loop with exact resume (`loop.fit`), optimizers and schedules, checkpoints, histories.

Layer: imports ``core.models``, ``core.data``, ``core.nn`` and ``core.utils``."""
