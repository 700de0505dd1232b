"""The Ray Tune sweep (`tcnn sweep`, or ``python -m pipelines.sweep``), one module per piece. Each imports only
modules listed below it (.importlinter, contract ``sweep-layers``):

- ``cli``: the command line; runs the driver here or submits it to SLURM (pipelines.slurm) and follows the job.
- ``driver``: one sweep from start to end: the MLflow parent run, the rounds of trials, the outputs at the end.
- ``grid_outputs``, ``search_run``: the end of a grid (its tables, report and parent run), a search's run.
- ``parent_run``, ``driver_lock``, ``driver_legs``, ``driver_lines``: the driver's MLflow parent run, its lock,
  its wall time over legs, its printed lines.
- ``spec``: the spec a driver and its trials run from (``sweep.json``), reconciled with a saved one on resume.
- ``tuner``: Ray and Ray Tune on the driver's side: the connection, each round's Tuner (param_space,
  resources, run config) and its restore.
- ``progress``: the Tune callback that prints one line per trial event.
- ``report``: ``report.html``, the sweep's one page.
- ``summary``: ``summary.parquet`` (one row per trial), the over-seed and model-kind tables, the plots.
- ``bracket``: growing the grid until every arm's validation-chosen value is interior (``sweep.select.bracket``).
- ``selection``: hyperparameters chosen on validation data, the same way for both arms (``sweep.select``).
- ``trial``: one trial, the Tune function trainable: the chain's stages in its directory, exactly once.
- ``trial_tracking``, ``tune_report``, ``epoch_watch``, ``trial_metrics``: a trial's MLflow run, its reports to
  Tune, the epochs it follows as they end, the numbers it reports; ``trial_files``: where its files are.
- ``shared``: the work trials share: pretraining, matched controls, corrupted test sets.
- ``plan``: grid expansion, per-trial params and shared-work keys (pure: no Ray, no MLflow).
- ``tables``: the Parquet writer every table above uses.
- ``scheduling``: early stopping fair to both arms (one ASHA per arm, each on its own validation accuracy)
  and each arm's choice among the trials that ran to the end.
- ``sweep_params``: the params with their ``sweep`` section typed (``SweepParams``) and the sweep's settings
  checked against the science's params; what the sweep's commands load.
- ``settings``: the sweep's settings (grid, select and bracket, search, scheduler, resources), and the typed
  reading of them back from a spec (``sweep.json``). Core knows none of these.

The studies that run on the sweep (designs and their committed results) are pipelines/studies/.
"""

import importlib
from typing import Any

#: What a sweep saved before this package existed names by its old module path (Ray Tune's ``tuner.pkl``
#: pickles the trial-directory function; submitit's job file the SLURM driver): looked up here on first use, so
#: such a sweep still resumes (``--resume``) and a queued job still starts.
_MOVED = {"_trial_dirname": "pipelines.sweep.tuner", "slurm_driver": "pipelines.sweep.driver"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
