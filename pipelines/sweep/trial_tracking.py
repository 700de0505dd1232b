"""A sweep trial's MLflow run: its description and tags, opening (or reopening) it under the sweep's parent
run, closing it, the epochs it has logged and the files it logs."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from pipelines.sweep.plan import trial_label
from pipelines.sweep.sweep_params import SweepParams
from stages.harness.catalogue import stage_artifacts
from stages.harness.runner import Stopped
from stages.tracking.names import NOTE_TAG

REFUSED_TAG = "tcnn.refused"  # the stage and the line a refused trial's run ends with
NODE_TAG = "tcnn.node"  # MLflow tags of a trial's run: the node of its current attempt, and of every attempt
ATTEMPT_NODES_TAG = "tcnn.attempt_nodes"
WORKER_NODES_TAG = "tcnn.worker_nodes"  # nodes its data-parallel stages (its own and shared) had ranks on


def trial_description(tid: str, params: SweepParams, overrides: dict[str, Any]) -> str:
    """A trial run's description head (Markdown): the trial, dataset, model kind and arch, seed, its grid point;
    both arms (the T-CNN and its matched control) run in it."""
    point = trial_label(overrides) or "the base params"
    return (f"trial {tid} · dataset {params.data.name} · {params.model.kind} ({params.model.arch}) · "
            f"seed {params.seed} · {point} · both arms: the T-CNN and its matched control")  # fmt: skip


def open_run(
    spec: dict[str, Any],
    tid: str,
    params: SweepParams,
    root: Path,
    known_id: str | None,
    nodes: list[str] | None = None,
) -> Any:
    """The trial's MLflow child run under the sweep's parent: reopened when the trial ran before.
    ``nodes``: the node of every attempt so far, this one last (tags ``tcnn.node``, ``tcnn.attempt_nodes``)."""
    from stages.tracking.tracker import Tracker, TrackingError

    cfg = spec["tracking"]
    tracker = Tracker(enabled=cfg["enabled"], uri=cfg["uri"], experiment=cfg["experiment"])
    if not tracker.enabled:
        return tracker
    tracker.parent_run_id = cfg["parent_run_id"]
    t = spec["trials"][tid]
    tags = {
        "tcnn.kind": "trial",
        "tcnn.sweep": spec["name"],
        "tcnn.trial": tid,
        "tcnn.trial_dir": str(root),
        "tcnn.pretrain_key": t["pretrain_key"],
        **{f"grid.{k}": json.dumps(v) for k, v in t["overrides"].items()},
        NOTE_TAG: trial_description(tid, params, t["overrides"]),
    }
    if nodes:
        tags.update({NODE_TAG: nodes[-1], ATTEMPT_NODES_TAG: ",".join(nodes)})
    if not known_id:  # a trial whose driver was stopped before its first Tune checkpoint: its run is KILLED
        killed = tracker.find_child(tid, status="KILLED")
        known_id = killed[0].info.run_id if killed else None
    if known_id:
        with contextlib.suppress(TrackingError):
            tracker.start_child(tid, params=params, tags=tags, run_id=known_id)
            return tracker
    # start_child also resumes a RUNNING run of this trial (tag tcnn.stage = tid) left by a killed attempt.
    tracker.start_child(tid, params=params, tags=tags, run_name=tid)
    return tracker


def stopped(err: BaseException) -> bool:
    """Whether ``err`` ends the trial from outside (a stop signal, Ray ending the worker, a checkpointed
    preemption) rather than a failure of its own: its run is then KILLED, not FAILED."""
    return isinstance(err, KeyboardInterrupt | SystemExit | Stopped) or type(err).__name__ == "Preempted"


def close_run(spec: dict[str, Any], run_id: str | None) -> None:
    """Mark a finished trial's run FINISHED if a kill left it RUNNING (between done.json and the end call)."""
    cfg = spec["tracking"]
    if not cfg["enabled"] or not run_id:
        return
    from stages.tracking.tracker import Tracker

    tracker = Tracker(enabled=True, uri=cfg["uri"], experiment=cfg["experiment"])
    if tracker.client.get_run(run_id).info.status != "FINISHED":
        tracker.client.set_terminated(run_id, status="FINISHED")


def logged_epochs(tracker: Any) -> set[int]:
    """The fine-tuning epochs the trial's run has logged already (``epoch/finetune_epoch`` steps)."""
    if not tracker.enabled or tracker.run_id is None:
        return set()
    history = tracker.client.get_metric_history(tracker.run_id, "epoch/finetune_epoch")
    return {int(m.step) for m in history}


def trial_artifacts(stages: tuple[str, ...], params: SweepParams, root: Path) -> list[tuple[Path, str]]:
    """The files a trial logs on its run: what its stages log on the DVC path
    (`stages.harness.catalogue.stage_artifacts`) but checkpoints, which stay in the trial's directory, each under its
    folder relative to ``root`` (runs/finetune/metrics.json -> runs/finetune)."""
    values = params.model_dump(mode="json")
    out = []
    for stage in stages:
        for path, folder in stage_artifacts(stage, values, root):
            if path.is_file() and not (folder or "").startswith("checkpoints"):
                out.append((path, os.path.dirname(os.path.relpath(path, root))))
    return out
