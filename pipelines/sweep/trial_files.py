"""Where a sweep trial keeps its files: its directory under the sweep, its logs' names, and reading its JSON
files (its state files' names are pipelines.sweep.replay's: ``STATE``, ``REFUSED``, ``DONE``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# pipelines.sweep.replay's STATE: trial.json; REFUSED, written when a stage refused the trial's inputs
# (stages.harness.runner.REFUSALS): {"tid", "refused": "<stage>: <one line>", "mlflow_run_id"}, the trial is
# not run again; DONE: done.json
STAGE_LOG = "stages.jsonl"
LOG = "trial.log"


def trial_dir(spec: dict[str, Any], tid: str) -> Path:
    return Path(spec["sweep_dir"]) / "trials" / tid


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
