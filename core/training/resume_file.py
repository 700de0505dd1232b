"""The in-progress checkpoint `resume.pt` of a training run (core.training.loop): its name and format, the
check that it belongs to this run (same `run_hash`), and each rank's RNG states restored from it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.training import distributed as D
from core.training.checkpoint import CheckpointError, load, restore_rng
from core.training.environment import seed_everything

RESUME_FILE = "resume.pt"


STATE_FORMAT = "tcnn-train-state/1"


def try_resume(path: Path, run_hash: str, log: Callable[[str], None], notes: list[str]) -> dict | None:
    """The state in `path` when it is readable and belongs to this run (format and `run_hash`), else None (the
    reason logged and noted)."""
    if not path.exists():
        return None
    try:
        state = load(path)
    except CheckpointError as err:
        msg = f"ignoring unreadable in-progress checkpoint ({err}); starting fresh"
        log(msg)
        notes.append(msg)
        return None
    if state.get("format") != STATE_FORMAT or state.get("run_hash") != run_hash:
        msg = f"in-progress checkpoint {path} belongs to other params or inputs; starting fresh"
        log(msg)
        notes.append(msg)
        return None
    return state


def restore_rank_rng(state: dict[str, Any], world: D.World) -> None:
    """Each rank's own RNG states when the checkpoint comes from the same world size; otherwise rank 0
    takes the saved (rank 0) states and the others re-seed from them and their rank (deterministic)."""
    ranks = state.get("rng_ranks")
    if ranks is not None and len(ranks) == world.size:
        restore_rng(ranks[world.rank])
        return
    restore_rng(state["rng"])
    if not world.main:
        seed_everything(torch.initial_seed() + 1_000_003 * world.rank + int(state["global_step"]))
