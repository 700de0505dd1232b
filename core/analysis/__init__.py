"""Analysis of trained networks: GPSA dissection (spans, gates, nonlocality, attention maps).

Layer: imports ``core.models``, ``core.nn`` and ``core.utils``."""
