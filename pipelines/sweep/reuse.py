"""A T-CNN fine-tuning found finished in the same storage, adopted instead of trained again (issue 56).

A grid at a search's chosen values would train again, at the search's seed, the T-CNN its search trial already
fine-tuned. What decides "the same run" is the finetune stage's own resume identity: the run hash its training
loop checks before it resumes (`stages.harness.fine_tuning.identity` over the params, the sha256 of the reparameterized
checkpoint it starts from, the device, the frozen names and how it executes), never a trial's name or values.

- A trial that finished its finetune stage registers it: ``<storage>/finetune/<key>.json`` names its trial
  directory (the first one registered is kept).
- A grid trial runs its own reparam stage (a conversion, no training: seconds) and, before fine-tuning, looks up
  the key of the run it would train. When a registered directory holds that run's published outputs, from the
  same reparameterized checkpoint (its sha256 compared again), they are copied (hard links where the file
  system allows) into the trial's own ``runs/finetune/``, and the trial goes on to its control and evaluate
  stages as if it had trained them: the same files, the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from pipelines.sweep.sweep_params import SweepParams
from stages.harness import chain

STAGE = "finetune"
INDEX = "finetune"  # <storage>/finetune/<key>.json


def finetune_key(params: SweepParams, root: Path) -> str:
    """The key of the T-CNN fine-tuning ``params`` would train in ``root`` (from its reparam stage's output):
    the stable hash of the identity the stage's training loop resumes under (`stages.harness.fine_tuning.train`)."""
    from core.utils.hashing import file_digest, stable_hash
    from stages import finetune
    from stages.harness import fine_tuning
    from stages.harness import training as T

    src = finetune.source_path(root)
    identity = fine_tuning.identity(params, {"checkpoint": file_digest(src)}, T.training_device().type,
                                    freeze=sorted(set(params.finetune.freeze)), variant=finetune.TCNN.name,
                                    workers=params.workers_per_trial)  # fmt: skip
    return stable_hash(identity)[:32]


def _entry(spec: dict[str, Any], key: str) -> Path:
    return Path(spec["storage"]) / INDEX / f"{key}.json"


def register(spec: dict[str, Any], params: SweepParams, root: Path, trial: str) -> None:
    """Record the finished fine-tuning in ``root`` under its key (kept when one is registered already)."""
    entry = _entry(spec, finetune_key(params, root))
    if entry.is_file():
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(entry, {"trial_dir": str(root), "sweep": spec["name"], "trial": trial})


def finished(spec: dict[str, Any], params: SweepParams, root: Path) -> Path | None:
    """The trial directory holding the finished fine-tuning ``params`` would train in ``root``, else None."""
    from core.utils.hashing import file_digest
    from stages import finetune

    try:
        info = json.loads(_entry(spec, finetune_key(params, root)).read_text())
    except (FileNotFoundError, ValueError):
        return None
    source = Path(info["trial_dir"])
    if source.resolve() == root.resolve():
        return None
    outputs = source / chain.run_dir(STAGE)
    if (source / chain.partial_dir(STAGE)).exists() or not (outputs / "metrics.json").is_file():
        return None
    try:
        same = file_digest(finetune.source_path(source)) == file_digest(finetune.source_path(root))
    except FileNotFoundError:
        return None
    return source if same else None


def adopt(source: Path, root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Copy ``source``'s published fine-tuning outputs into ``root/runs/finetune`` (hard links where possible;
    a partial run of ``root``'s own is dropped); returns the stage's metrics (as ``source``'s trial recorded
    them) and its history rows."""
    target = root / chain.run_dir(STAGE)
    tmp = target.with_name(f".{STAGE}.{os.getpid()}.adopt")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(tmp)
    shutil.copytree(source / chain.run_dir(STAGE), tmp, copy_function=_link_or_copy)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    shutil.rmtree(root / chain.partial_dir(STAGE), ignore_errors=True)
    try:
        metrics = json.loads((source / ".sweep" / f"{STAGE}.json").read_text())  # what its run_stage returned
    except (FileNotFoundError, ValueError):
        metrics = json.loads((target / "metrics.json").read_text())
    history = json.loads((target / "history.json").read_text())
    return metrics, history if isinstance(history, list) else []


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
