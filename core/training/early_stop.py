"""Early stopping on validation accuracy (``finetune.stop``), as a small pure rule `core.training.loop.fit` calls.

The rule, counted in validation images (accuracy x validation size, so the threshold does not depend on the
split's size): after each epoch, a *rise* is a correct-image count at least ``max(min_delta_images, 1)`` above
the count of the last rise (the first epoch is one). After ``patience`` consecutive epochs without a rise,
training stops. The weights kept are the best-validation epoch's (the highest count; the earliest on a
tie), which is the last rise's unless a later epoch beat it by fewer than ``min_delta_images`` images. Only
the validation split is read; the test split never chooses anything.
"""

from __future__ import annotations

from typing import Any

# `State` is a plain dict (JSON-able, stored in the resume checkpoint):
#   best_correct, best_epoch: the best validation count so far and its epoch label
#   ref_correct: the count of the last rise; since: epochs since it; stopped: the rule fired
State = dict[str, Any]


def new_state() -> State:
    return {"best_correct": None, "best_epoch": None, "ref_correct": None, "since": 0, "stopped": False}


def update(state: State, epoch: int, correct: int, *, patience: int, min_delta_images: int) -> State:
    """The state after epoch label ``epoch`` scored ``correct`` validation images (a new dict)."""
    s = dict(state)
    if s["best_correct"] is None or correct > s["best_correct"]:
        s["best_correct"], s["best_epoch"] = correct, epoch
    if s["ref_correct"] is None or correct - s["ref_correct"] >= max(min_delta_images, 1):
        s["ref_correct"], s["since"] = correct, 0
    else:
        s["since"] += 1
    s["stopped"] = s["since"] >= patience
    return s


def is_best(state: State, epoch: int) -> bool:
    """Whether epoch label ``epoch`` (just scored) is now the best one: its weights are the ones to keep."""
    return state["best_epoch"] == epoch


def reason(state: State, *, patience: int, min_delta_images: int, max_key: str = "finetune.epochs") -> str:
    if state["stopped"]:
        return f"val accuracy did not rise by >= {max(min_delta_images, 1)} images for {patience} epochs"
    return f"reached {max_key}"


def stop_epoch(corrects: list[int], *, patience: int, min_delta_images: int) -> tuple[int, int]:
    """(epochs run, best epoch), both 1-based, of the rule over a whole sequence of per-epoch counts."""
    s = new_state()
    for i, c in enumerate(corrects, start=1):
        s = update(s, i, c, patience=patience, min_delta_images=min_delta_images)
        if s["stopped"]:
            return i, s["best_epoch"]
    return len(corrects), s["best_epoch"]
