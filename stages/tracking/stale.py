"""Runs a killed process left behind: found by their tags, and either continued or closed, so that no run
stays RUNNING forever and no stage gets two live runs.

A SIGKILL leaves its runs RUNNING. Under one parent, the RUNNING runs of a stage are the attempts of killed
processes: the newest whose params agree is resumed, the others are tagged ``tcnn.stale`` and marked FAILED.
Of a workspace's *open* parents (a chain whose last stage has not run), the newest whose params agree is
re-attached; the others (other params, or older duplicates) are marked superseded and closed with their
children. MLflow params are write-once, hence the agreement test (:func:`stages.tracking.names.compatible_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from stages.tracking.names import (
    CHAIN_TAG,
    KEY_TAG,
    KIND_TAG,
    PARENT_TAG,
    STAGE_TAG,
    RunStatus,
    compatible_params,
)
from stages.tracking.store import TrackingStore, quote

STALE_TAG = "tcnn.stale"


def close_children(store: TrackingStore, parent_run_id: str, status: RunStatus, reason: str) -> int:
    """End every RUNNING child of ``parent_run_id`` (left by killed processes) with ``status``, tagged
    :data:`STALE_TAG` = ``reason``; returns how many were closed."""
    left = store.search(
        f"tags.`{PARENT_TAG}` = {quote(parent_run_id)} and attributes.status = 'RUNNING'", max_results=1000
    )
    for run in left:
        store.client.set_tag(run.info.run_id, STALE_TAG, reason)
        store.client.set_terminated(run.info.run_id, status=status)
    return len(left)


def open_parent(store: TrackingStore, key: str, flat: Mapping[str, str]) -> str | None:
    """The newest open parent run of ``key`` whose logged params agree with ``flat``, or None; every other
    open parent of ``key`` is tagged superseded and closed FAILED (its RUNNING children too)."""
    found: str | None = None
    flt = f"tags.`{KIND_TAG}` = 'parent' and tags.`{KEY_TAG}` = {quote(key)} and tags.`{CHAIN_TAG}` = 'open'"
    for run in store.search(flt, max_results=20):  # newest first
        if found is None and compatible_params(run.data.params, flat):
            found = run.info.run_id
            continue
        # An execution with other params (or an older duplicate): it will not be continued.
        store.client.set_tag(run.info.run_id, CHAIN_TAG, "superseded")
        close_children(store, run.info.run_id, "FAILED", "its parent was superseded")
        if run.info.status == "RUNNING":  # left by a killed process
            store.client.set_terminated(run.info.run_id, status="FAILED")
    return found


def stale_child(
    store: TrackingStore,
    parent_run_id: str,
    stage: str,
    flat: Mapping[str, str],
    on_stale: Literal["resume", "fail"],
) -> str | None:
    """The RUNNING run of ``stage`` under the parent to resume: with ``on_stale="resume"``, the newest
    whose logged params agree with ``flat``. Every other RUNNING one (a killed attempt) is tagged
    :data:`STALE_TAG` and marked FAILED, so no stage gets two live runs."""
    stale = store.search(
        f"tags.`{PARENT_TAG}` = {quote(parent_run_id)} and tags.`{STAGE_TAG}` = {quote(stage)} "
        "and attributes.status = 'RUNNING'"
    )
    resume_id: str | None = None
    for run in stale:  # newest first
        compatible = compatible_params(run.data.params, flat)
        if on_stale == "resume" and resume_id is None and compatible:
            resume_id = run.info.run_id
        else:
            store.client.set_tag(run.info.run_id, STALE_TAG, "killed attempt, superseded")
            store.client.set_terminated(run.info.run_id, status="FAILED")
    return resume_id
