"""What a sweep trial reports as numbers: its headline (the DVC path's summary metrics, under the same names),
a stage's metrics flattened for MLflow, and the numbers of the driver's progress line after a stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.harness.catalogue import SUMMARY_METRICS, numeric_metrics, summary_metrics
from stages.harness.chain import trial_stages

#: The headline numbers every trial reports last (also the summary table's columns): the DVC path's summary
#: metrics, under the same names (stages.harness.catalogue.SUMMARY_METRICS).
HEADLINE = tuple(SUMMARY_METRICS)


def numeric(obj: Any, prefix: str = "") -> dict[str, float]:
    """A stage's returned metrics flattened to MLflow numbers (the DVC path's names: stages.harness.catalogue)."""
    return {f"{prefix}{k}": v for k, v in numeric_metrics(obj).items()}


def headline(root: Path) -> dict[str, float]:
    """The trial's :data:`HEADLINE` numbers, read from its stage outputs as the DVC path reads them."""
    return summary_metrics(root)


def progress(stage: str, metrics: dict[str, Any]) -> dict[str, float]:
    """What a trial reports after a stage (the driver's progress line): its test accuracy or its equivalence
    error, as ``<stage>_<name>``."""
    return {f"{stage}_{k}": float(metrics[k]) for k in ("test_acc", "max_abs_logit_diff")
            if isinstance(metrics.get(k), (int, float))}  # fmt: skip


def last_trial_stage() -> str:
    """The trial's last stage: its metrics are logged under their own names (the DVC path's evaluate run)."""
    return trial_stages()[-1]
