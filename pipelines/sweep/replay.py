"""A trial run on another machine, replayed from its committed record instead of trained again (issue 57).

A study runs for many hours across sessions, and a session may get a fresh machine: the sweep's directory (Tune's
state, the trials' checkpoints) is then gone. What survives is what was committed: one small JSON record per trial
that finished, was refused or was stopped by the scheduler (:func:`export`, run by ``tcnn study snapshot``).

- A record holds the trial's Tune reports in order (without Tune's own keys), its small files (done.json,
  trial.json, the stages' metrics, histories and tables; never checkpoints, partial state or logs, and no file
  over 1 MiB, such as the evaluate stage's per-image table, which ``left_out`` names with its size; files behind
  its links to shared stages are stored as the trial saw them), the identity it ran under and where it ran.
- A trial whose record is found (:func:`lookup`: the same sweep, trial id, Tune config and params, paths under
  the sweep's working directory compared relative to it) and which has no local outcome replays it
  (``TrialRunner._replayed`` in pipelines.sweep.trial): the same reports reach Tune in the same order, so a scheduler records the same results and,
  the trials running one at a time, stops what it stopped before; a finished or refused trial's files are
  restored and its outcome returned. A stopped record whose replay Tune does not stop (another order, another
  scheduler) is trained from scratch, its restored files removed first.
- A trial in flight when the record was taken (its directory's lock held) is not recorded: a lost machine loses
  at most that trial. A replayed trial has no MLflow run on the new machine (its record is the committed file);
  done.json and trial.json keep the recorded run id as ``mlflow_run_id_recorded``.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json, atomic_write_text
from core.utils.hashing import stable_hash
from core.utils.locks import LOCK
from pipelines.sweep.trial_files import LOG

VERSION = 1
#: Tune's own keys of a reported result: not the trial's, added again when replayed.
TUNE_KEYS = frozenset({"training_iteration", "time_total_s", "episodes_total", "timesteps_total", "node_ip",
                       "hostname", "pid", "time_this_iter_s", "timestamp", "date", "time_since_restore",
                       "timesteps_since_restore", "iterations_since_restore", "config", "checkpoint_dir_name",
                       "done", "trial_id", "should_checkpoint", "experiment_tag"})  # fmt: skip
SKIP_NAMES = frozenset({LOCK, LOG, ".partial"})  # the lock, the log, the stages' partial state
SKIP_SUFFIXES = (".pt", ".pth", ".th", ".ckpt", ".safetensors", ".bin", ".onnx")
MAX_FILE = 1 << 20
#: A trial's files that say how far it is (pipelines.sweep.trial): its state (attempts, MLflow run id), written
#: at start; its outcome once it trained every stage, or once a stage refused its inputs.
STATE, DONE, REFUSED = "trial.json", "done.json", "refused.json"
RUN_ID_FILES = (STATE, DONE, REFUSED)


class ReplayError(ValueError):
    """A record that cannot be read or does not belong where it was asked for."""


def identity(spec: dict[str, Any], tid: str, config: dict[str, Any], params: Any) -> str:
    """What a record must match to be replayed: the sweep, the trial, its Tune config and its params, with the
    sweep's working directory written as ``<cwd>`` (a worktree elsewhere runs the same trial) and without the
    tracking settings (where MLflow writes changes no result)."""
    values = params.model_dump(mode="json") if hasattr(params, "model_dump") else dict(params)
    values = {k: v for k, v in values.items() if k != "tracking"}
    text = json.dumps(values, sort_keys=True, default=str)
    cwd = str(spec.get("cwd") or "")
    if cwd:
        text = text.replace(cwd.rstrip("/") + "/", "<cwd>/").replace(json.dumps(cwd), '"<cwd>"')
    return stable_hash({"sweep": spec["name"], "tid": tid, "config": config, "params": text})


def in_flight(root: Path) -> bool:
    """Whether a trial holds its directory's lock now (core.utils.locks.locked)."""
    lock = root / LOCK
    if not lock.exists():
        return False
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def reports(tune_trial: Path) -> list[dict[str, Any]]:
    """A Tune trial's reports (its ``result.json`` lines) without Tune's own keys; a line being written is left."""
    out = []
    path = tune_trial / "result.json"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        out.append({k: v for k, v in row.items() if k not in TUNE_KEYS})
    return out


def files(root: Path, left: dict[str, int] | None = None) -> dict[str, dict[str, str]]:
    """The trial's small files by path under ``root`` (links to shared stages followed), text or base64; the
    files over :data:`MAX_FILE` (such as the evaluate stage's per-image table) go to ``left`` with their size."""
    out: dict[str, dict[str, str]] = {}
    for dirpath, dirnames, names in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_NAMES)
        for name in sorted(names):
            path = Path(dirpath) / name
            if name in SKIP_NAMES or name.endswith(SKIP_SUFFIXES):
                continue
            if path.stat().st_size > MAX_FILE:
                if left is not None:
                    left[str(path.relative_to(root))] = path.stat().st_size
                continue
            data = path.read_bytes()
            rel = str(path.relative_to(root))
            try:
                out[rel] = {"text": data.decode("utf-8")}
            except UnicodeDecodeError:
                out[rel] = {"base64": base64.b64encode(data).decode("ascii")}
    return out


ParamsOf = Callable[[dict[str, Any], str, dict[str, Any]], Any]


def record(spec: dict[str, Any], sweep_dir: Path, tid: str, params_of: ParamsOf) -> dict[str, Any] | None:
    """The record of one trial of the sweep in ``sweep_dir``; None while it runs or before it reported.
    ``params_of(spec, tid, config)``: the trial's params (pipelines.sweep.arm_trial.config_params)."""
    from core.utils.machine import cpu_model

    tune_trial, root = sweep_dir / "tune" / tid, sweep_dir / "trials" / tid
    rows = reports(tune_trial)
    if not rows or in_flight(root):
        return None
    config = json.loads((tune_trial / "params.json").read_text())
    state = "refused" if (root / REFUSED).is_file() else "finished" if (root / DONE).is_file() else "stopped"
    left: dict[str, int] = {}
    kept = files(root, left)
    return {"version": VERSION, "sweep": spec["name"], "tid": tid, "state": state, "config": config,
            "identity": identity(spec, tid, config, params_of(spec, tid, config)), "reports": rows, "files": kept,
            "left_out": left, "recorded": {"time": time.time(), "cpu": cpu_model()}}  # fmt: skip


def export(sweep_dir: Path, out: Path, params_of: ParamsOf) -> list[Path]:
    """Write ``out/<sweep>/<tid>.json`` for every trial of ``sweep_dir`` that finished, was refused or stopped
    (an unchanged record is not rewritten); returns the records written."""
    spec = json.loads((sweep_dir / "sweep.json").read_text())
    name = spec["name"]
    written = []
    for tune_trial in sorted(p.parent for p in (sweep_dir / "tune").glob("*/params.json")):
        rec = record(spec, sweep_dir, tune_trial.name, params_of)
        if rec is None:
            continue
        path = out / name / f"{rec['tid']}.json"
        old = _read(path)
        if old is not None and {**old, "recorded": None} == {**rec, "recorded": None}:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, rec, indent=1)
        written.append(path)
    return written


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise ReplayError(f"{path}: not a trial record ({err})") from None


def lookup(spec: dict[str, Any], tid: str, ident: str) -> dict[str, Any] | None:
    """The record of trial ``tid`` under the spec's ``records`` folder when its identity is ``ident``
    (:func:`identity`; else None: a record of another identity is named in the trial's log, not replayed)."""
    folder = spec.get("records")
    if not folder:
        return None
    rec = _read(Path(folder) / spec["name"] / f"{tid}.json")
    if rec is None:
        return None
    if rec.get("version") != VERSION or rec.get("tid") != tid:
        raise ReplayError(f"{folder}/{spec['name']}/{tid}.json: version {rec.get('version')}, not {VERSION}")
    if rec["identity"] != ident:
        print(f"replay: {tid}: the record's params differ from this trial's; trained here", flush=True)
        return None
    return rec


def restore(rec: dict[str, Any], root: Path) -> None:
    """Write the record's files under ``root``; the outcome files' MLflow run id becomes
    ``mlflow_run_id_recorded`` (that run is in another machine's store)."""
    for rel, content in rec["files"].items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if "base64" in content:
            path.write_bytes(base64.b64decode(content["base64"]))
            continue
        text = content["text"]
        if rel in RUN_ID_FILES:
            obj = json.loads(text)
            obj["mlflow_run_id_recorded"], obj["mlflow_run_id"] = obj.get("mlflow_run_id"), None
            obj["replayed"] = rec["recorded"]
            atomic_write_json(path, obj)
        else:
            atomic_write_text(path, text)


def clear(root: Path) -> None:
    """Remove what :func:`restore` wrote (all but the trial's lock and log)."""
    for child in root.iterdir():
        if child.name in SKIP_NAMES:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def all_recorded(spec: dict[str, Any]) -> bool:
    """Whether every trial of a grid sweep (Tune config ``{"tid": ...}``) has a finished record to replay: the
    driver then builds no shared corrupted sets, which only trials that train and evaluate read."""
    from pipelines.sweep.plan import trial_params

    if not spec.get("records") or spec.get("search") is not None:
        return False
    for tid in spec["trials"]:
        rec = lookup(spec, tid, identity(spec, tid, {"tid": tid}, trial_params(spec, tid)))
        if rec is None or rec["state"] != "finished":
            return False
    return True
