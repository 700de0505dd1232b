"""What tcnn's MLflow experiment opens on: the "Model training" workflow and a saved view of the runs table
whose columns are the headline metrics and the params an experiment most often changes.

MLflow 3's UI opens an experiment tagged ``mlflow.experimentKind`` on its training runs, and shows a runs
table's columns from a shared view stored as an experiment tag (core.utils.mlflow_ui: how the UI reads it).
"""

from __future__ import annotations

from core.utils.mlflow_ui import VIEW_KEY, VIEW_TAG_PREFIX, shared_view
from stages.tracking.names import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

#: The runs table's saved view (core.utils.mlflow_ui.shared_view): the headline first, in the units and under
#: the names `dvc metrics show` prints it (stages.harness.catalogue.headline_summary) -- T-CNN - control in pp
#: with its 95% interval ends, then each model's clean accuracy and mCA in % -- so that both views show one
#: number alike.
VIEW_METRICS: tuple[str, ...] = (
    *(f"tcnn-control {c} {end}" for c in ("clean", "mCA", "mCE") for end in ("pp", "pp low", "pp high")),
    *(f"{m} {c} pct" for c in ("clean", "mCA") for m in ("tcnn", "control", "cnn")),
)
#: The params the view shows first (MLflow's flattened names, stages.tracking.names.flatten_params): what an
#: experiment most often changes (the README's gate init, the fine-tuning lr, the epoch of the switch, the
#: seed), so that a change is visible in a column, not only in the run's name.
VIEW_PARAMS: tuple[str, ...] = ("lambda_init", "finetune.lr", "reparam_epoch", "seed")


def experiment_tags() -> dict[str, str]:
    """The tags of tcnn's experiment: MLflow's experiment kind (the UI's "Model training" workflow opens it on
    its runs) and the saved view of the runs table (:data:`core.utils.mlflow_ui.VIEW_KEY`)."""
    return {
        EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
        VIEW_TAG_PREFIX + VIEW_KEY: shared_view(VIEW_METRICS, VIEW_PARAMS),
    }
