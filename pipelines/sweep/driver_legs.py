"""The sweep driver's wall time over its legs (a driver stopped, then resumed): one line per leg that ended in
``legs.jsonl``, summed into the parent run's ``wall_s``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.utils.atomic import append_json_line

#: One line per leg of the driver that ended (stopped or finished): its seconds. ``wall_s`` sums them all.
LEGS = "legs.jsonl"


def earlier_legs_s(sweep_dir: Path) -> float:
    """The wall time of the driver's earlier legs of this sweep (stopped, then resumed), from ``legs.jsonl``."""
    try:
        lines = (sweep_dir / LEGS).read_text().splitlines()
    except FileNotFoundError:
        return 0.0
    return sum(float(json.loads(x)["wall_s"]) for x in lines if x.strip())


def end_leg(sweep_dir: Path, t0: float | None, how: str) -> float:
    """Record this leg (``how``: stopped, finished) in ``legs.jsonl``; returns its seconds."""
    if t0 is None or not sweep_dir.is_dir():
        return 0.0
    wall = time.monotonic() - t0
    append_json_line(sweep_dir / LEGS, {"ended": how, "wall_s": wall, "at": time.time()})
    return wall


def wall_metrics(sweep_dir: Path, t0: float) -> dict[str, float]:
    """``wall_s``: every leg of the driver (the earlier ones from legs.jsonl, this one ended now as finished);
    ``legs``: how many."""
    earlier = earlier_legs_s(sweep_dir)
    n = len((sweep_dir / LEGS).read_text().splitlines()) if (sweep_dir / LEGS).is_file() else 0
    return {"wall_s": earlier + end_leg(sweep_dir, t0, "finished"), "legs": float(n + 1)}
