"""What the report stage reads: where the other stages' outputs are (:func:`input_paths`, named where
dvc.yaml names them), the required inputs (the models, evaluate's metrics; a missing or unreadable one is a
StageError), the optional ones (a missing one becomes a note in the report's
:class:`core.viz.report_html.Inputs`; a damaged JSON file is still a StageError, never read as missing) and
the MLflow run ids.

Run ids: :func:`read_run_ids` takes ``runs/mlflow_runs.json`` (``{"parent": id, "stages": {stage: id}}`` or a
flat ``{name: id}`` mapping; the tracking adapter starts the file over for every new parent, so it describes
one execution). This module never imports MLflow: the report renders without it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from core.config import Params
from core.utils.errors import first_line
from core.viz.report_html import Inputs, model_names
from stages.harness import chain
from stages.harness.runner import StageError

RUN_IDS_FILE = Path(chain.RUN_IDS_FILE)


def input_paths(params: Params, root: Path) -> dict[str, Path]:
    """Every file the report reads, by role (the DVC deps of the stage: other stages' outputs, named where
    dvc.yaml names them)."""

    def out(stage: str, name: str) -> Path:
        return root / chain.output(stage, name)

    return {
        "cnn": out("pretrain", "cnn-final.pt"),
        "tcnn": out("finetune", "tcnn-final.pt"),
        "metrics": root / chain.metrics_file("evaluate"),
        "equivalence": root / chain.metrics_file("reparam"),
        "pretrain_history": out("pretrain", "history.json"),
        "pretrain_metrics": root / chain.metrics_file("pretrain"),
        "finetune_history": out("finetune", "history.json"),
        "finetune_metrics": root / chain.metrics_file("finetune"),
        "control_history": out("control", "history.json"),
        "control_metrics": root / chain.metrics_file("control"),
        "gpsa": out("finetune", "gpsa.csv"),
        "summary": out("evaluate", "summary.json"),
        "gain_png": out("evaluate", "robustness_gain.png"),
        "robustness": out("evaluate", "robustness.parquet"),
        "clean_set": root / params.robustness.dir / "clean.parquet",
        "data_dir": root / params.data.dir,
        "run_ids": root / RUN_IDS_FILE,
    }


# ------------------------------------------------------------------------------------------------ run ids
def read_run_ids(root: Path) -> tuple[dict[str, str] | None, str | None]:
    """MLflow run ids of this pipeline execution: ({"parent": id, "<stage>": id, ...} or None, note or None),
    from ``root/runs/mlflow_runs.json`` (see the module docstring)."""
    ids: dict[str, str] = {}
    note = None
    path = root / RUN_IDS_FILE
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raw, note = None, f"{path}: unreadable ({err}); no run ids"
        if isinstance(raw, dict):
            stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
            flat = {k: v for k, v in raw.items() if k != "stages"}
            for k, v in {**flat, **stages}.items():
                if isinstance(v, str) and v:
                    ids[str(k).removesuffix("_run_id")] = v
        elif raw is not None:
            note = f"{path}: expected a JSON object; ignored"
    return (ids or None), note


def read_run_meta(root: Path) -> dict[str, str]:
    """The tracking context recorded next to the run ids (experiment, its id, tracking URI, DVC experiment
    name); empty when there is none."""
    try:
        raw = json.loads((root / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    meta = raw.get("meta") if isinstance(raw, dict) else None
    return {str(k): str(v) for k, v in meta.items() if v is not None} if isinstance(meta, dict) else {}


def _recorded_parent(root: Path) -> str | None:
    try:
        raw = json.loads((root / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return raw.get("parent") if isinstance(raw, dict) else None


def tracking_context(
    root: Path, run_ids: dict[str, str] | None
) -> tuple[dict[str, str] | None, str | None, dict[str, str]]:
    """(run ids or None, note or None, tracking context): the caller's ``run_ids`` when it knows them, else
    :func:`read_run_ids`; the recorded context (:func:`read_run_meta`) only when it belongs to their parent."""
    if run_ids is None:
        run_ids, ids_note = read_run_ids(root)
    else:
        run_ids, ids_note = ({str(k): str(v) for k, v in run_ids.items() if v} or None), None
    meta = read_run_meta(root) if run_ids and run_ids.get("parent") == _recorded_parent(root) else {}
    return run_ids, ids_note, meta


# ------------------------------------------------------------------------------------------------ files
def read_json(path: Path, *, required: bool, inputs: Inputs | None = None, section: str = "") -> Any:
    """The parsed file; None for a missing optional one (a note in ``inputs``, given one). A missing required
    file, or any damaged one, is a StageError."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise StageError(f"{path}: missing (run the stage that writes it)") from None
        if inputs is not None:
            inputs.note(section, f"{inputs.rel(path)} is missing.")
    except (OSError, ValueError) as err:  # present but damaged: never read as missing (nor as good)
        reason = first_line(err)
        raise StageError(f"{path}: not valid JSON ({reason}); rerun the stage that writes it") from None
    return None


def read_csv(path: Path, inputs: Inputs, section: str) -> list[dict[str, Any]] | None:
    """The rows of a CSV file; None, with a note, for a missing, unreadable or empty one."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except FileNotFoundError:
        inputs.note(section, f"{inputs.rel(path)} is missing.")
        return None
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        inputs.note(section, f"{inputs.rel(path)} is unreadable ({err}).")
        return None
    if not rows:
        inputs.note(section, f"{inputs.rel(path)} has no rows (the model has no GPSA layer?).")
        return None
    return rows


def read_model(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, checkpoint metadata: normalization, image_size, model_spec)."""
    from core.training.checkpoint import CheckpointError, load, load_model

    try:
        ckpt = load(path, require=("model", "model_spec"))
        meta = {k: ckpt.get(k) for k in ("normalization", "image_size", "model_spec")}
        del ckpt
        return load_model(path), meta
    except CheckpointError as err:
        raise StageError(str(err)) from None


def _check_comparisons(params: Params, metrics: dict[str, Any], path: Path) -> None:
    """evaluate's metrics hold the comparisons the params ask for: with a matched control, the control and
    T-CNN - control (else the report would say "no matched control" for a run that has one)."""
    comps = metrics.get("comparisons")
    if not isinstance(comps, dict | list) or not comps:
        raise StageError(f"{path}: lacks its comparisons (damaged, or not evaluate's; rerun evaluate)")
    wants_control = params.finetune.control and params.model.record.has_control
    if wants_control and ("control" not in metrics or "tcnn-control" not in comps):
        raise StageError(f"{path}: has no matched control, but the params have one (rerun evaluate)")


def required_metrics(params: Params, path: Path) -> dict[str, Any]:
    """evaluate's per-model metrics, with the comparisons the params ask for (else StageError)."""
    metrics = read_json(path, required=True)
    if not isinstance(metrics, dict) or not model_names(metrics):
        raise StageError(f"{path}: expected an object of per-model metrics (written by evaluate)")
    _check_comparisons(params, metrics, path)
    return metrics


def _history(path: Path, inputs: Inputs, section: str) -> list[dict[str, Any]] | None:
    h = read_json(path, required=False, inputs=inputs, section=section)
    if h is not None and not (isinstance(h, list) and all(isinstance(r, dict) for r in h)):
        inputs.note(section, f"{inputs.rel(path)}: expected a list of epoch rows; ignored.")
        return None
    return h


def _dict_or_note(obj: Any, path: Path, inputs: Inputs, section: str) -> dict[str, Any] | None:
    if obj is not None and not isinstance(obj, dict):
        inputs.note(section, f"{inputs.rel(path)}: expected a JSON object; ignored.")
        return None
    return obj


def optional_inputs(params: Params, paths: dict[str, Path], metrics: dict[str, Any], root: Path) -> Inputs:
    """The report's inputs: params, ``metrics`` and the optional files (reparam's equivalence, the training
    histories and metrics, the control's when evaluate compared one, the robustness summary, the GPSA rows);
    a missing or malformed optional file becomes a note."""
    inputs = Inputs(params=params.model_dump(mode="json"), metrics=metrics, root=root)
    inputs.equivalence = _dict_or_note(
        read_json(paths["equivalence"], required=False, inputs=inputs, section="equivalence"),
        paths["equivalence"], inputs, "equivalence",
    )  # fmt: skip
    inputs.pretrain_history = _history(paths["pretrain_history"], inputs, "training")
    inputs.finetune_history = _history(paths["finetune_history"], inputs, "training")
    phases = ["pretrain_metrics", "finetune_metrics"]
    if "control" in metrics:  # evaluate compared a control: its training files belong in the report
        inputs.control_history = _history(paths["control_history"], inputs, "training")
        phases.append("control_metrics")
    for key in phases:
        obj = read_json(paths[key], required=False, inputs=inputs, section="training")
        setattr(inputs, key, _dict_or_note(obj, paths[key], inputs, "training"))
    inputs.summary = _dict_or_note(
        read_json(paths["summary"], required=False), paths["summary"], inputs, "robustness"
    )
    inputs.gpsa_rows = read_csv(paths["gpsa"], inputs, "fig4")
    return inputs
