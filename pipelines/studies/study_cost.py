"""A study's cost.csv: one row per (trial, stage) the trial ran or shared, with its wall and training times,
and the compute hours recomputed from those rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.studies.study_tables import seconds
from stages.harness import chain

COST = ("trial", "seed", "value", "stage", "role", "shared_key", "wall_s", "stage_wall_s", "train_time_s",
        "epochs", "recovered", "cpu")  # fmt: skip


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _shared_key(spec: dict[str, Any], trial: dict[str, Any], stage: str, root: Path) -> str | None:
    """The identity key (its directory's name under the sweep storage) of the shared run of ``stage`` the trial
    used; None for a stage the trial ran itself."""
    role = chain.sweep_role(stage)
    if role == "sweep":
        return trial.get(f"{stage}_key")
    if role != "group":
        return None
    key = trial.get(f"{stage}_key") if spec.get("share_pretraining") else None
    link = root / chain.run_dir(stage)
    if not key and link.is_symlink():  # the link to the shared run (pipelines.sweep.shared.link_pretraining)
        key = link.resolve().parents[1].name
    return key or None


def _stage_wall(root: Path, stage: str) -> float | None:
    """The ``wall_s`` the stage wrote in its metrics file (None for a stage without one, or that writes none)."""
    try:
        path = root / chain.metrics_file(stage)
    except (KeyError, ValueError):  # no metrics file in dvc.yaml (corrupt)
        return None
    try:
        wall = _json(path).get("wall_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(wall) if isinstance(wall, (int, float)) else None


def _trained(root: Path, stage: str) -> tuple[float | None, int | None]:
    """(the sum of the recorded ``train_time_s`` of its history's training epochs, how many epochs it trained);
    (None, None) without a history."""
    path = root / chain.output(stage, "history.json")
    if not path.is_file():
        return None, None
    epochs = [h for h in _json(path) if h.get("train_time_s") is not None or h.get("train_loss") is not None]
    times = [float(h["train_time_s"]) for h in epochs if h.get("train_time_s") is not None]
    return (sum(times) if times else None), len(epochs)


def cost_rows(sweep_dir: Path, spec: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """One row per (trial, stage) the trial ran or shared, in the chain's order (the rows of cost.csv), and after
    evaluate the row of the pretrained CNN's evaluation it made or read (stage ``cnn_evaluation``, :func:`_cnn_row`).

    ``role``: the stage's ``meta.sweep`` (group: shared by the trials of one identity; trial: its own; sweep:
    built once by the driver). ``shared_key``: the identity of the shared run (the same in every trial using
    it; count it once); empty for a run of the trial's own. ``wall_s``: finished - started of the records of its
    completed executions (the trial's stages.jsonl; for a shared run this sweep's ``<stage>_runs.jsonl``;
    empty for a run no record of this sweep times). ``stage_wall_s``: the ``wall_s`` in the stage's metrics file
    (corrupt: its records'). Evaluate's two times leave out the CNN evaluation it did, which is in its own row.
    ``train_time_s`` / ``epochs``: over the training epochs of its history (training stages). ``recovered``: a
    record says the execution was found finished after a kill (its ``wall_s`` is not the run's)."""
    from pipelines.sweep.shared import read_lines, runs_log

    stages = [s for s in chain.stage_names() if chain.sweep_role(s) in ("sweep", "group", "trial")]
    shared_runs = {s: read_lines(sweep_dir / runs_log(s)) for s in stages if chain.sweep_role(s) != "trial"}
    notes = {tid: _cnn_note(sweep_dir / "trials" / tid) for tid in spec["trials"]}
    rows = []
    for tid, t in spec["trials"].items():
        root = sweep_dir / "trials" / tid
        log = stage_log(root)
        head = {"trial": tid, "seed": t["params"]["seed"], "value": t["overrides"][key]}
        for stage in stages:
            shared = _shared_key(spec, t, stage, root)
            if chain.sweep_role(stage) == "sweep" and shared is None:
                continue
            records = ([r for r in log if r.get("stage") == stage] if shared is None
                       else [r for r in shared_runs.get(stage, []) if r.get("key") == shared])  # fmt: skip
            row = head | _cost_row(root, stage, shared, records)
            if stage == "evaluate" and notes[tid]:
                spent = float(notes[tid].get("seconds") or 0.0)
                row |= {k: None if row[k] is None else row[k] - spent for k in ("wall_s", "stage_wall_s")}
                rows += [row, head | _cnn_row(sweep_dir.parent, notes, tid, row["cpu"])]
            else:
                rows.append(row)
    return [r | {k: seconds(r[k]) for k in ("wall_s", "stage_wall_s", "train_time_s")} for r in rows]


def _cost_row(root: Path, stage: str, shared: str | None, records: list[dict[str, Any]]) -> dict[str, Any]:
    """A stage's numbers in a trial (:func:`cost_rows`) from its execution ``records``."""
    timed = [r for r in records if "started" in r and "finished" in r]
    train, epochs = _trained(root, stage) if chain.trains(stage) else (None, None)
    cpus = sorted({r["cpu"] for r in records if r.get("cpu")})
    walls = [float(r["stage_wall_s"]) for r in records if isinstance(r.get("stage_wall_s"), (int, float))]
    wall = _stage_wall(root, stage)  # its metrics file's; a stage without one (corrupt): its records'
    return {"stage": stage, "role": chain.sweep_role(stage), "shared_key": shared,
            "wall_s": sum(float(r["finished"]) - float(r["started"]) for r in timed) if timed else None,
            "stage_wall_s": sum(walls) if wall is None and walls else wall,
            "train_time_s": train, "epochs": epochs,
            "recovered": any(bool(r.get("recovered")) for r in records) or None, "cpu": " / ".join(cpus) or None}  # fmt: skip


def _cnn_note(root: Path) -> dict[str, Any]:
    """How the trial's evaluate had the pretrained CNN's evaluation (metrics.json's ``cnn_evaluation``; {}:
    not recorded)."""
    try:
        note = _json(root / chain.metrics_file("evaluate")).get("cnn_evaluation")
    except (OSError, ValueError, AttributeError):
        return {}
    return note if isinstance(note, dict) else {}


def _cnn_row(storage: Path, notes: dict[str, dict[str, Any]], tid: str, cpu: str | None) -> dict[str, Any]:
    """The trial's row of the pretrained CNN's evaluation (stages.cnn_evaluation). Made into or read from the
    shared store: role group, its key, its wall time the seconds this sweep's trials spent making it (empty when
    an earlier sweep made it), the stage's time and CPU as the store records them. Made by the trial for itself
    (no store, or the check disagreed): role trial, its seconds."""
    from stages.cnn_evaluation import DIR, RECORD

    note = notes[tid]
    row = {"stage": DIR, "train_time_s": None, "epochs": None, "recovered": None}
    if note.get("source") not in ("computed", "shared"):
        seconds = note.get("seconds")
        return row | {
            "role": "trial",
            "shared_key": None,
            "wall_s": seconds,
            "stage_wall_s": seconds,
            "cpu": cpu,
        }
    k = note["key"]
    made = [
        float(n["seconds"]) for n in notes.values() if n.get("key") == k and n.get("source") == "computed"
    ]
    try:
        record = _json(storage / DIR / k / RECORD)
    except (OSError, ValueError):
        record = {}
    return row | {"role": "group", "shared_key": k, "wall_s": sum(made) if made else None,
                  "stage_wall_s": record.get("seconds"), "cpu": record.get("cpu")}  # fmt: skip


def _trains(stage: str) -> bool:
    """A training stage of the chain (its cost is its training time); cost.csv's other rows are not."""
    return stage in chain.stage_names() and chain.trains(stage)


def cost_hours(rows: list[dict[str, Any]]) -> float:
    """:func:`compute_hours` from cost.csv's rows: the training time of each training stage and the wall time of
    each other stage, a shared run (the same stage and ``shared_key``) counted once."""
    seconds, seen = 0.0, set()
    for r in rows:
        if r.get("shared_key") not in (None, ""):
            if (r["stage"], r["shared_key"]) in seen:
                continue
            seen.add((r["stage"], r["shared_key"]))
        seconds += float(r.get("train_time_s" if _trains(r["stage"]) else "wall_s") or 0.0)
    return round(seconds / 3600, 2)


def stage_log(root: Path) -> list[dict[str, Any]]:
    from pipelines.sweep.trial_files import STAGE_LOG

    path = root / STAGE_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
