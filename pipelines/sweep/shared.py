"""Work that sweep trials share: one pretraining run per group, one matched control per (pretraining, t1,
fine-tuning recipe) for a grid's trials and a search's control arms alike, one corrupted test set per sweep
input.

Both live in content-addressed directories under ``sweep.storage`` (see pipelines/sweep/plan.py) and are
built under an exclusive ``fcntl.flock`` on a lock file in that directory: the first trial (or driver) to
get the lock does the work, the others block until it is done and then find it complete. The kernel drops
the lock when its holder dies, so a killed trial never leaves it held; the next holder resumes the
interrupted pretraining or control exactly (the stages keep their partial state under the shared directory).

The pretrained CNN's evaluation is shared the same way, by the evaluate stage itself
(stages.cnn_evaluation: ``<storage>/cnn_evaluation/<key>/``).

Layout of ``<storage>/pretrain/<key>/``: ``runs/pretrain/`` (the pretrain stage's outputs: ckpt/, cnn-final.pt,
metrics.json, ...), ``inputs.json`` (the identity hashed into the key), ``complete.json`` (written last:
the epochs kept), ``executions.jsonl`` (one line per completed execution: sweep, trial, host, time).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.utils.atomic import append_json_line as append_line
from core.utils.atomic import atomic_write_json
from core.utils.locks import locked
from core.utils.locks import say as _say
from core.utils.machine import cpu_model
from pipelines.ddp import node_name, run_stage
from pipelines.sweep.sweep_params import SweepParams, validate_sweep_params
from stages.harness import chain

COMPLETE = "complete.json"
EXECUTIONS = "executions.jsonl"


def runs_log(stage: str) -> str:
    """The file in the sweep directory with one line per execution of a shared stage by this sweep."""
    return f"{stage}_runs.jsonl"


SWEEP_PRETRAIN_RUNS = runs_log("pretrain")  # pretraining executed by this sweep


def read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _complete_epochs(group_dir: Path) -> set[int]:
    """The t1 checkpoints a finished pretraining run in ``group_dir`` holds (empty: none usable)."""
    try:
        info = json.loads((group_dir / COMPLETE).read_text())
    except (FileNotFoundError, ValueError):
        return set()
    out = group_dir / chain.run_dir("pretrain")
    if not (out / "cnn-final.pt").is_file() or not (out / "metrics.json").is_file():
        return set()
    kept = {int(e) for e in info.get("checkpoint_epochs", [])}
    return {e for e in kept if (out / "ckpt" / f"ckpt-epoch-{e:03d}.pt").is_file()}


def pretrain_threads(spec: dict[str, Any]) -> int:
    """Torch threads for a shared pretraining run. While one trial of a group pretrains, the group's other
    trials wait on its lock with their CPUs idle, so the run takes this node's CPUs shared among the groups
    that may pretrain at once (the trials start round-robin over groups), never fewer than a trial's own."""
    own = max(1, int(spec.get("threads") or 1))
    node = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(own, node // max(1, len(spec["groups"])))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ensure_pretraining(
    spec: dict[str, Any], key: str, *, trial: str, log: Any = None
) -> tuple[Path, bool, dict[str, Any]]:
    """Make ``<storage>/pretrain/<key>`` hold a finished pretraining run with every t1 its group needs.

    Returns (group directory, whether this call executed pretraining, the pretrain stage's metrics).
    """
    group = spec["groups"][key]
    directory = Path(spec["storage"]) / "pretrain" / key
    need = {int(e) for e in group["epochs"]}
    with locked(directory, f"pretrain {key}", log):
        have = _complete_epochs(directory)
        if need <= have:
            metrics = json.loads((directory / chain.metrics_file("pretrain")).read_text())
            return directory, False, metrics
        params: SweepParams = validate_sweep_params(group["params"])
        if have:  # an earlier sweep's run lacks some t1: rerun (deterministic) keeping old and new epochs
            params = params.with_overrides({"pretrain.checkpoint_epochs": sorted(need | have)})
        metrics = published(directory, "pretrain")
        recovered = metrics is not None and need <= {int(e) for e in metrics.get("checkpoint_epochs", [])}
        t0, threads = time.time(), None
        if recovered:
            _say(log, f"pretrain {key}: finished by a process killed before it recorded that; recorded now")
        else:
            atomic_write_json(directory / "inputs.json", group["identity"])
            epochs = sorted(need | have)
            _say(log, f"pretrain {key}: training {params.pretrain.epochs} epochs, keeping t1 {epochs}")
            on_cpu = not (spec.get("resources") or {}).get("gpu")
            threads = pretrain_threads(spec) if on_cpu else None
            with torch_threads(threads) if threads else contextlib.nullcontext():
                metrics = run_stage("pretrain", params, directory, spec)
        assert metrics is not None
        atomic_write_json(
            directory / COMPLETE,
            {"checkpoint_epochs": metrics["checkpoint_epochs"], "finished": time.time(), "metrics": metrics},
        )
        record = {
            "sweep": spec["name"],
            "sweep_uid": spec.get("uid"),
            "trial": trial,
            "key": key,
            "host": socket.gethostname(),
            "node": node_name(),
            "cpu": cpu_model(),
            "pid": os.getpid(),
            "started": t0,
            "finished": time.time(),
            "epochs": params.pretrain.epochs,
            "threads": threads,
            "checkpoint_epochs": metrics["checkpoint_epochs"],
            "recovered": recovered,
        }
        append_line(directory / EXECUTIONS, record)
        append_line(Path(spec["sweep_dir"]) / SWEEP_PRETRAIN_RUNS, record)
        return directory, True, metrics


def published(root: Path, stage: str) -> dict[str, Any] | None:
    """The metrics of a training stage that completed in ``root``, else None.

    A training stage publishes its outputs (``runs/<stage>/``, metrics.json last) and then removes its work
    dir ``runs/.partial/<stage>``. A process killed after that but before its caller recorded the stage as
    done (a requeue's SIGTERM, a lost node) would otherwise cost the stage a second run from scratch, since
    there is no partial state left to resume from."""
    if (root / chain.partial_dir(stage)).exists():
        return None
    try:
        metrics = json.loads((root / chain.metrics_file(stage)).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None


def link_pretraining(root: Path, group_dir: Path, stage: str = "pretrain") -> None:
    """``root/runs/<stage>`` -> the shared ``<group_dir>/runs/<stage>`` (a relative symlink, replaced
    atomically): the shared pretraining, or the shared control."""
    link = root / chain.run_dir(stage)
    runs = link.parent
    runs.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(group_dir / chain.run_dir(stage), runs)
    if link.is_symlink() and os.readlink(link) == target:
        return
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} exists and is not a link to the shared {stage}")
    tmp = runs / f".{stage}.{os.getpid()}.link"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def ensure_control(
    spec: dict[str, Any], key: str, *, trial: str, log: Any = None
) -> tuple[Path, bool, dict[str, Any]]:
    """Make ``<storage>/control/<key>`` hold the finished matched control of a grid's trials (the plan's
    ``controls`` entry: :func:`train_control`). Returns (directory, whether this call trained it, the control
    stage's metrics)."""
    entry = spec["controls"][key]
    return train_control(spec, key, validate_sweep_params(entry["params"]), entry["pretrain_key"], entry["identity"],
                         trial=trial, log=log, users=f"trials {entry['trials']}")  # fmt: skip


def train_control(
    spec: dict[str, Any],
    key: str,
    params: SweepParams,
    pretrain_key: str,
    identity: dict[str, Any],
    *,
    trial: str,
    log: Any = None,
    users: str = "",
) -> tuple[Path, bool, dict[str, Any]]:
    """Make ``<storage>/control/<key>`` (``key``: that of the control stage's ``identity``) hold its finished
    matched control, run by the control stage in that directory on the shared pretraining ``pretrain_key``
    (which must exist), under the directory's lock: a grid's trials and a search's control arms with the same
    identity find it there, trained once. A holder killed mid-training (a stopped search trial) leaves the
    stage's partial state, which the next holder resumes exactly. Returns (directory, whether this call
    trained it, the control stage's metrics)."""
    from stages import control

    directory = Path(spec["storage"]) / "control" / key
    with locked(directory, f"control {key}", log):
        done = directory / COMPLETE
        if done.is_file() and control.checkpoint_path(directory).is_file():
            return directory, False, json.loads(done.read_text())["metrics"]
        link_pretraining(directory, Path(spec["storage"]) / "pretrain" / pretrain_key)
        t0 = time.time()
        metrics = published(directory, "control") if control.checkpoint_path(directory).is_file() else None
        recovered = metrics is not None
        if recovered:
            _say(log, f"control {key}: finished by a process killed before it recorded that; recorded now")
        else:
            atomic_write_json(directory / "inputs.json", identity)
            _say(log, f"control {key}: fine-tuning the CNN without attention for {users or trial}")
            metrics = run_stage("control", params, directory, spec)
        atomic_write_json(done, {"finished": time.time(), "metrics": metrics})
        record = {"sweep": spec["name"], "trial": trial, "key": key, "host": socket.gethostname(),
                  "node": node_name(), "cpu": cpu_model(), "started": t0, "finished": time.time(),
                  "recovered": recovered}  # fmt: skip
        append_line(directory / EXECUTIONS, record)
        append_line(Path(spec["sweep_dir"]) / runs_log("control"), record)
        return directory, True, metrics


#: How a trial makes sure a shared (dvc.yaml ``meta.sweep: group``) stage's result exists, by stage.
ENSURE = {"pretrain": ensure_pretraining, "control": ensure_control}


def ensure_corrupted(spec: dict[str, Any], key: str, log: Any = None) -> dict[str, Any]:
    """Build (or check) the shared corrupted test sets ``<storage>/corrupt/<key>`` with the corrupt stage, and
    record the execution (its time: finished - started; the stage's own ``wall_s``; how many sets it made) in
    the directory's executions.jsonl and the sweep's ``corrupt_runs.jsonl``."""
    from stages import corrupt

    storage = Path(spec["storage"])
    directory = storage / "corrupt" / key
    with locked(directory, f"corrupt {key}", log):
        t0 = time.time()
        metrics = corrupt.run(validate_sweep_params(spec["corrupt"][key]), root=storage)
        record = {"sweep": spec["name"], "sweep_uid": spec.get("uid"), "key": key, "host": socket.gethostname(),
                  "node": node_name(), "cpu": cpu_model(), "started": t0, "finished": time.time(),
                  "stage_wall_s": metrics.get("wall_s"), "generated": metrics.get("generated")}  # fmt: skip
        append_line(directory / EXECUTIONS, record)
        append_line(Path(spec["sweep_dir"]) / runs_log("corrupt"), record)
        return metrics


def pretrain_runs(sweep_dir: Path) -> int:
    """How many pretraining runs this sweep executed (each completed execution appends one line)."""
    return len(read_lines(sweep_dir / SWEEP_PRETRAIN_RUNS))
