"""Addresses in the MLflow UI (MLflow 3.17) and the saved view of the runs table that tcnn links to. Plain
strings: no MLflow import (the report renders them; stages/tracking/view.py stores the view).

What the UI does, read from its source (mlflow/server/js): a browser with no saved choice opens in the
"GenAI" workflow, where an experiment opens on its trace overview; the URL parameter
``workflowType=machine_learning`` selects the "Model training" workflow (kept across the UI's own links), where
the experiment opens on its runs table. The runs table shows the columns of a *shared view*: an experiment
tag ``mlflow.sharedViewState.<key>`` holding the view as JSON (what the UI's "Share" button writes), opened by
``viewStateShareKey=<key>``; without it the table opens with no metric or param column ticked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from core.config import ConfigError

#: The local UI's port: ``TCNN_MLFLOW_PORT``, infra/mlflow/server.sh's own setting (one port for the server, the
#: report's links and its "serve it first" line), else :data:`DEFAULT_PORT`.
PORT_ENV = "TCNN_MLFLOW_PORT"
DEFAULT_PORT = 5000
#: Where `mlflow ui` / infra/mlflow/server.sh serve by default (the README's command).
DEFAULT_UI = f"http://127.0.0.1:{DEFAULT_PORT}"


def ui_port() -> int:
    """The local UI's port (:data:`PORT_ENV`); a value that is not a port (1-65535) is refused (ConfigError:
    one line, exit 2, from a stage or `tcnn`)."""
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return DEFAULT_PORT
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ConfigError(f"{PORT_ENV}={raw!r}: expected a port number, 1-65535")
    return int(raw)


def local_ui() -> str:
    """The address of the local `mlflow ui` (127.0.0.1 on :func:`ui_port`)."""
    return f"http://127.0.0.1:{ui_port()}"


#: The "Model training" workflow, as a URL parameter.
WORKFLOW = "workflowType=machine_learning"
#: The shared view tcnn stores on its experiment: the runs table with the headline's columns.
VIEW_KEY = "tcnn-headline"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."


#: The runs table's own first columns (their ids in the UI's grid), kept first when the view orders its columns.
LEADING_COLUMNS = ("attributes.`Run Name`", "runDateAndNestInfo")


#: A header's width for its name (measured in the UI: ``tcnn_minus_control_clean_accuracy`` fits in 270 px).
HEADER_PX_PER_CHAR, HEADER_PAD_PX = 7.5, 24


def header_px(name: str) -> int:
    """A column's width that shows its whole name in the header (the grid cuts it at the column's width)."""
    return round(HEADER_PX_PER_CHAR * len(name) + HEADER_PAD_PX)


def ui_base(tracking_uri: str | None) -> str:
    """The UI's address: the tracking server itself when runs go to one, else the local `mlflow ui`."""
    uri = (tracking_uri or "").rstrip("/")
    return uri if uri.startswith(("http://", "https://")) else local_ui()


def root_url(base: str | None = None) -> str:
    """The experiments list, in the training workflow (a click on an experiment keeps it)."""
    return f"{base or local_ui()}/#/?{WORKFLOW}"


def runs_url(experiment_id: str, base: str | None = None) -> str:
    """The experiment's runs table with tcnn's saved columns (:data:`VIEW_KEY`)."""
    return f"{base or local_ui()}/#/experiments/{experiment_id}/runs?{WORKFLOW}&viewStateShareKey={VIEW_KEY}"


def run_url(experiment_id: str, run_id: str, base: str | None = None) -> str:
    """One run's page, in the training workflow."""
    return f"{base or local_ui()}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW}"


def column(kind: str, name: str) -> str:
    """A runs-table column id as the UI writes it (``metrics.`tcnn_test_acc```)."""
    return f"{kind}.`{name}`"


def shared_view(metrics: Sequence[str], params: Sequence[str] = ()) -> str:
    """The value of the :data:`VIEW_KEY` tag: the runs table showing ``metrics`` then ``params``, in that order
    (``columnOrder``: the headline's interval on screen first, the params an experiment changes beside it),
    newest run first, parents with their stage runs folded."""
    chosen = [*(column("metrics", m) for m in metrics), *(column("params", p) for p in params)]
    state: dict[str, Any] = {
        # the search facets (EXPERIMENT_PAGE_QUERY_PARAM_KEYS)
        "searchFilter": "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        # the table's UI state (EXPERIMENT_PAGE_UI_STATE_FIELDS)
        "selectedColumns": chosen,
        # the grid sorts chosen metrics by name; this order puts them as given, after the run's name and date
        "columnOrder": [*LEADING_COLUMNS, *chosen],
        # wide enough for the metrics' full names (the grid cuts a header at its column's width)
        "columnWidths": {column("params", p): header_px(p) for p in params}
        | {column("metrics", m): header_px(m) for m in metrics},
        "runsExpanded": {},
        "runsPinned": [],
        "runsHidden": [],
        "runsHiddenMode": "FIRST_10_RUNS",
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "groupBy": None,
        "groupsExpanded": {},
        "autoRefreshEnabled": True,
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }
    return json.dumps(state, separators=(",", ":"))
