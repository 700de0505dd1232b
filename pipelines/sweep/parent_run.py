"""The sweep's MLflow parent run: opened (or reopened) with its tags, params and environment, and ended with
every trial run still open under it when the driver is stopped (KILLED) or fails (FAILED)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

FROM_SEARCH_TAG = "tcnn.from_search"  # the parent run of a grid made by --from-search: the search's name


def open_parent(spec: dict) -> Any:
    """The sweep's parent run (reopened when the spec has its id), its tags, params and environment logged."""
    from stages.tracking.names import UV_LOCK_FILE, UV_LOCK_TAG, digest_if_present
    from stages.tracking.tracker import Tracker

    t = spec["tracking"]
    tracker = Tracker(enabled=t["enabled"], uri=t["uri"], experiment=t["experiment"])
    if not tracker.enabled:
        return tracker
    tags = {"tcnn.kind": "parent", "tcnn.sweep": spec["name"], "tcnn.sweep_dir": spec["sweep_dir"],
            UV_LOCK_TAG: digest_if_present(UV_LOCK_FILE)}  # fmt: skip
    if origin := spec.get("from_search"):  # a grid at a search's choices (tcnn sweep --from-search)
        tags |= {FROM_SEARCH_TAG: origin["name"], f"{FROM_SEARCH_TAG}_dir": origin["sweep_dir"]}
    tracker.start_parent(f"sweep:{spec['name']}", tags, run_id=t.get("parent_run_id") or None)
    if tracker.parent_created:
        tracker.log_environment()
    params = {f"grid.{k}": json.dumps(v) for k, v in spec["grid"].items()}
    params.update({"sweep.name": spec["name"], "sweep.share_pretraining": str(spec["share_pretraining"])})
    tracker.log_params(params)
    return tracker


def close_stopped(tracker: Any) -> None:
    """A stopped driver ends its MLflow parent and every trial run still open under it as KILLED (a resume
    reopens them: trial_tracking.open_run)."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    tracker.close_children(tracker.parent_run_id, "KILLED", reason="the sweep driver was stopped")
    tracker.end_parent("KILLED")


def close_failed(tracker: Any) -> None:
    """A driver ended by an I/O or store fault, or by a bug, ends its MLflow parent and every trial run still
    open under it as FAILED, as far as the store still takes writes."""
    if tracker is None or not tracker.enabled or tracker.parent_run_id is None:
        return
    with contextlib.suppress(Exception):
        tracker.close_children(tracker.parent_run_id, "FAILED", reason="the sweep driver failed")
    with contextlib.suppress(Exception):
        tracker.end_parent("FAILED")
