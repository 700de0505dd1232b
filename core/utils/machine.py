"""What machine a result came from: the CPU's model name, recorded next to timings and in run records."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path


@cache
def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
