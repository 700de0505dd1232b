"""A finished study's small results, committed next to its design: the tables :func:`export` writes from a
finished sweep (``tcnn study export``, pipelines/studies/cli.py) and study_tables.py's ``load`` reads back;
render.py makes the README section from them.

``export`` reads a finished sweep that chose a hyperparameter on validation data (``sweep.select``, one key,
e.g. ``finetune.lr``) and writes kilobytes that hold everything its headline depends on:

- ``results.csv``: one ``grid`` row per (seed, value): each model's validation accuracy, clean accuracy,
  mCA, mCE and relative mCE with percentile intervals, and T-CNN - control at that value with its paired
  interval (paired bootstrap over test images, re-run from the trial's per-image table); and one
  ``selected`` row per seed: each arm at its validation-chosen value, T-CNN - control with its paired
  interval (the sweep's selected.parquet). ``tcnn_selected`` / ``control_selected`` mark the chosen rows.
- ``history.csv``: every fine-tuning epoch of both arms at every value (validation accuracy, losses, lr, and
  the epoch's training time ``train_time_s`` and ``images_per_s`` where the history records them; empty in
  epoch 0, the state before fine-tuning).
- ``attention.csv``: every GPSA head of each seed's chosen T-CNN over fine-tuning: gate sigma(lambda),
  span 1/alpha, nonlocality (gpsa.csv of the finetune stage).
- ``cost.csv``: one row per (trial, stage) the trial ran or shared (study_cost.py ``cost_rows``): the stage's
  sweep role, the key of the shared run (count each once), its wall time as the sweep recorded it and as the
  stage measured it, its training time and epochs, the CPU; empty where nothing records a number. The corrupted
  sets' rows carry the driver's executions; the pretrained CNN's evaluation, shared by the trials of one CNN
  (stages.cnn_evaluation), has a row of its own after evaluate's. study_cost.py's ``cost_hours`` recomputes
  meta.json's ``compute_h`` from it.
- ``meta.json``: sweep name, commit, CPU, the driver's wall time ``wall_s_all_legs`` (the sweep's
  ``metrics.json`` ``wall_s``: summed over every leg in its ``legs.jsonl``, a stopped run and its resumes) and
  ``legs``; the trials' ``data`` and ``robustness`` params that choose
  the images and the ``data_roles`` their fine-tuning recorded (:func:`images`; the README block prints them).
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_text
from core.utils.machine import cpu_model
from pipelines.studies.study_cost import COST, cost_rows, stage_log
from pipelines.studies.study_tables import StudyError, seconds, write_csv
from stages.harness import chain

ARMS = ("tcnn", "control")
MODELS = ("cnn", "tcnn", "control")
METRICS = ("clean_accuracy", "mca", "mce", "relative_mce")
DIFF = "tcnn_minus_control"
ENDS = ("", "_ci_low", "_ci_high")
FILES = ("results.csv", "history.csv", "attention.csv", "cost.csv", "meta.json")
DATA_KEYS = ("val_from", "val_size", "limit")  # meta.json's "data": the params that choose the images
ROBUSTNESS_KEYS = ("n_images", "corruptions", "severities")  # and "robustness": the corrupted sets
HISTORY = ("seed", "arm", "value", "epoch", "val_accuracy", "val_loss", "train_loss", "train_acc", "lr",
           "train_time_s")  # fmt: skip
FIGURES = ("lr_grid.png", "val_curves.png", "attention.png")

# --------------------------------------------------------------------------------------------- export


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _columns() -> list[str]:
    cols = ["row", "seed", "tcnn_value", "control_value", "tcnn_trial", "control_trial", "tcnn_selected",
            "control_selected", *(f"{m}_val_accuracy" for m in MODELS)]  # fmt: skip
    cols += [f"{m}_{k}{e}" for m in (*MODELS, DIFF) for k in METRICS for e in ENDS]
    return cols


def export(sweep_dir: Path, out: Path, cpu: str | None = None) -> list[Path]:
    """Write :data:`FILES` for the finished sweep in ``sweep_dir`` into ``out``. ``cpu`` names the CPU(s) the
    trials ran on where their records do not (records made before they carried ``cpu``)."""
    import pyarrow.parquet as pq

    from core.utils.output_paths import check_output_dir

    check_output_dir(out, "OUT_DIR")  # before anything is read or written
    spec = _json(sweep_dir / "sweep.json")
    over = list((spec.get("select") or {}).get("over") or [])
    if len(over) != 1:
        raise StudyError(
            f"{sweep_dir}: the study tools need a sweep that selects one key (sweep.select.over)"
        )
    key = over[0]
    if not (sweep_dir / "selected.parquet").is_file():
        raise StudyError(f"{sweep_dir}: no selected.parquet (has the sweep finished?)")
    chosen = pq.read_table(sweep_dir / "selected.parquet").to_pylist()
    rows, history, attention = _grid_rows(sweep_dir, spec, key, chosen)
    rows += _chosen_rows(chosen, key)
    out.mkdir(parents=True, exist_ok=True)
    rates = ["images_per_s"] if any(h.get("images_per_s") is not None for h in history) else []
    written = [write_csv(out / "results.csv", rows, _columns()),
               write_csv(out / "history.csv", history, [*HISTORY, *rates]),
               write_csv(out / "attention.csv", attention, list(attention[0]) if attention else ["seed"]),
               write_csv(out / "cost.csv", cost_rows(sweep_dir, spec, key), list(COST))]  # fmt: skip
    atomic_write_text(out / "meta.json", json.dumps(_meta(sweep_dir, spec, key, cpu), indent=1) + "\n")
    return [*written, out / "meta.json"]


def _grid_rows(
    sweep_dir: Path, spec: dict[str, Any], key: str, chosen: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """results.csv's ``grid`` rows (one per trial, grid order), history.csv's rows and attention.csv's (the
    GPSA heads of each seed's chosen T-CNN). Every trial must have finished."""
    picks = {(c["seed"], arm): c[f"{arm}_trial"] for c in chosen for arm in ARMS}
    rows, history, attention = [], [], []
    for tid, t in spec["trials"].items():
        root = sweep_dir / "trials" / tid
        if not (root / "done.json").is_file():
            raise StudyError(f"{root}: trial not finished; resume the sweep first")
        seed, value = t["params"]["seed"], t["overrides"][key]
        rows.append(_grid_row(root, tid, t["params"], value, picks))
        history += _history_rows(root, seed, value)
        gpsa = root / chain.output("finetune", "gpsa.csv")
        if picks.get((seed, "tcnn")) == tid and gpsa.is_file():
            with open(gpsa) as fh:
                attention += [{"seed": seed, **r} for r in csv.DictReader(fh)]
    return rows, history, attention


def _grid_row(root: Path, tid: str, p: dict[str, Any], value: Any, picks: dict[tuple[Any, str], str]) -> dict:
    """The ``grid`` row of trial ``tid`` (params ``p``) at ``value``: each model's validation accuracy and
    T-CNN - control with its paired bootstrap interval, re-run from the trial's per-image table."""
    from core.utils.hashing import derive_seed
    from pipelines.sweep.selection import pair_metrics
    from stages.harness.catalogue import summary_metrics

    seed = p["seed"]
    head = summary_metrics(root)
    row: dict[str, Any] = {"row": "grid", "seed": seed, "tcnn_value": value, "control_value": value,
                           "tcnn_trial": tid, "control_trial": tid}  # fmt: skip
    row |= {f"{arm}_selected": picks.get((seed, arm)) == tid for arm in ARMS}
    row |= {f"{m}_val_accuracy": head.get(f"{m}_val_accuracy") for m in MODELS}
    row |= pair_metrics(root, root, replicates=int(p["robustness"]["bootstrap"]),
                        seed=derive_seed(int(seed), "bootstrap"))  # fmt: skip
    return row


def _chosen_rows(chosen: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """results.csv's ``selected`` rows: per seed, each arm at its validation-chosen ``key`` value
    (selected.parquet's rows)."""
    rows = []
    for c in chosen:
        row = {"row": "selected", "seed": c["seed"], "tcnn_selected": True, "control_selected": True}
        row |= {f"{arm}_value": c[f"{arm}_{key}"] for arm in ARMS} | {
            f"{arm}_trial": c[f"{arm}_trial"] for arm in ARMS
        }
        row |= {k: c.get(k) for k in _columns() if k in c and k not in row}
        rows.append(row)
    return rows


def _meta(sweep_dir: Path, spec: dict[str, Any], key: str, cpu: str | None) -> dict[str, Any]:
    """meta.json: the sweep, its selected key, commit, CPUs, compute hours and wall times, and which images
    played which role (:func:`images`)."""
    metrics = _json(sweep_dir / "metrics.json") if (sweep_dir / "metrics.json").is_file() else {}
    return {"sweep": spec["name"], "selected_key": key, "commit": _commit(sweep_dir),
            "cpus": _cpus(sweep_dir, spec["name"]) or ([cpu] if cpu else []), "export_cpu": cpu_model(),
            "trials": len(spec["trials"]), "compute_h": compute_hours(sweep_dir, spec),
            "wall_s_all_legs": metrics.get("wall_s"), "legs": metrics.get("legs"),
            "first_trial_start": _first_start(sweep_dir), "last_trial_end": _last_end(sweep_dir),
            **images(sweep_dir, spec)}  # fmt: skip


def images(sweep_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The data roles of the study: its trials' configured ``data`` (val_from, val_size, limit) and
    ``robustness`` (n_images, corruptions, severities) sections, and the ``data_roles`` their fine-tuning
    recorded (core.data.split_roles); None for what the trials do not have. Trials that recorded different roles
    are refused: a study's arms and seeds are compared on the same images."""
    params = [t["params"] for t in spec["trials"].values()]
    data = [_section(p, "data", DATA_KEYS) for p in params]
    rob = [_section(p, "robustness", ROBUSTNESS_KEYS) for p in params]
    recorded = [_recorded_roles(sweep_dir / "trials" / tid) for tid in spec["trials"]]
    for name, values in (("data", data), ("robustness", rob), ("data_roles", recorded)):
        if any(v != values[0] for v in values):
            raise StudyError(
                f"{sweep_dir}: the trials differ in {name}; a study compares them on one set of images"
            )
    return {"data": data[0], "robustness": rob[0], "data_roles": recorded[0]}


def _section(params: dict[str, Any], name: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """``keys`` of the params' section ``name`` (None where the trial's params have no such section)."""
    return {k: params[name].get(k) for k in keys} if params.get(name) else None


def _recorded_roles(root: Path) -> dict[str, Any] | None:
    path = root / chain.metrics_file("finetune")
    return _json(path).get("data_roles") if path.is_file() else None


def _history_rows(root: Path, seed: Any, value: Any) -> list[dict[str, Any]]:
    """The fine-tuning history of both arms of the trial in ``root``, one row per epoch. Epoch 0 is the state
    before fine-tuning: no training time."""
    out = []
    for arm, stage in (("tcnn", "finetune"), ("control", "control")):
        for h in _json(root / chain.output(stage, "history.json")):
            epoch = int(h.get("finetune_epoch", 0))
            row = {"seed": seed, "arm": arm, "value": value, "epoch": epoch, "val_accuracy": h.get("val_acc"),
                   **{k: h.get(k) for k in ("val_loss", "train_loss", "train_acc", "lr")}}  # fmt: skip
            if epoch > 0:
                row |= {"train_time_s": seconds(h.get("train_time_s")), "images_per_s": h.get("images_per_s")}  # fmt: skip
            out.append(row)
    return out


def _commit(sweep_dir: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(sweep_dir.parent), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def _stage_times(sweep_dir: Path) -> list[dict[str, Any]]:
    return [r for root in sorted((sweep_dir / "trials").glob("*")) for r in stage_log(root)]


def _shared_records(sweep_dir: Path, name: str) -> list[dict[str, Any]]:
    """This sweep's executions of shared (``meta.sweep: group``) stages, from their directories' logs."""
    from pipelines.sweep.shared import EXECUTIONS

    out = []
    for path in sweep_dir.parent.glob(f"*/*/{EXECUTIONS}"):
        out += [r for line in path.read_text().splitlines() if line.strip() and (r := json.loads(line))]
    return [r for r in out if r.get("sweep") == name]


def _cpus(sweep_dir: Path, name: str) -> list[str]:
    """Every CPU model a stage of the sweep ran on, as its records say."""
    records = _stage_times(sweep_dir) + _shared_records(sweep_dir, name)
    return sorted({r["cpu"] for r in records if r.get("cpu")})


def compute_hours(sweep_dir: Path, spec: dict[str, Any]) -> float:
    """The study's compute: every training epoch it kept (``train_time_s`` of each history, which survives a
    resume; a shared run, such as a seed's pretraining or a search's shared control, counted once) plus the
    recorded time of its other own stages (reparam, evaluate, the CNN evaluation that evaluate made) and of the
    driver's executions of this sweep (the corrupted sets). The trials are the grid's (``spec["trials"]``) and a
    search's arm trials (``trials/p<k>-<arm>``); a shared control's epochs trained before this sweep first used
    it (``control_epochs_before`` in trial.json) are another sweep's. Work lost to a kill is not in it; the gaps
    between sessions are not either."""
    from pipelines.sweep.shared import read_lines, runs_log

    training = {s for s in chain.trial_stages() if chain.trains(s)}
    driver = [r for s in chain.stage_names() if chain.sweep_role(s) == "sweep"
              for r in read_lines(sweep_dir / runs_log(s)) if "started" in r]  # fmt: skip
    seconds = sum(float(r["finished"]) - float(r["started"]) for r in driver)
    histories: dict[Any, tuple[str, int]] = {}  # one key per run: its history's text, the epochs not its own
    for root in _trial_roots(sweep_dir, spec):
        before = int((_read_state(root).get("control_epochs_before")) or 0)
        for stage in sorted(training):
            path = root / chain.output(stage, "history.json")
            if not path.is_file():
                continue
            text, real = path.read_text(), path.resolve()
            key = (stage, text) if chain.sweep_role(stage) == "group" else real
            skip = before if real != path.absolute() else 0  # a linked (shared) control
            if key in histories:
                skip = min(skip, histories[key][1])
            histories[key] = (text, skip)
        for r in stage_log(root):
            if r.get("stage") not in training and "started" in r:
                seconds += float(r["finished"]) - float(r["started"])
    for text, skip in histories.values():
        seconds += sum(float(h.get("train_time_s") or 0.0) for h in json.loads(text)[skip:])
    return round(seconds / 3600, 2)


def _trial_roots(sweep_dir: Path, spec: dict[str, Any]) -> list[Path]:
    """The trials' directories: the spec's and, for a search, every arm trial's."""
    found = {sweep_dir / "trials" / tid for tid in spec["trials"]}
    if (sweep_dir / "trials").is_dir():
        found |= {p for p in (sweep_dir / "trials").iterdir() if p.is_dir()}
    return sorted(found)


def _read_state(root: Path) -> dict[str, Any]:
    from pipelines.sweep.replay import STATE
    from pipelines.sweep.trial_files import read_json

    return read_json(root / STATE) or {}


def _first_start(sweep_dir: Path) -> str | None:
    """The earliest trial attempt (first line of each trial.log: ``--- <date> <time> attempt on ...``)."""
    starts = []
    for log in (sweep_dir / "trials").glob("*/trial.log"):
        with open(log) as fh:
            first = fh.readline().split()
        if len(first) >= 3 and first[0] == "---":
            starts.append(f"{first[1]} {first[2]}")
    return min(starts) if starts else None


def _last_end(sweep_dir: Path) -> str | None:
    import time

    ends = [r["finished"] for r in _stage_times(sweep_dir) if "finished" in r]
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(ends))) if ends else None
