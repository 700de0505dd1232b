"""Stage `report`: one self-contained HTML report of a run, plus its figures as PNG files.

    python -m stages.report [--params params.yaml]

Reads (relative to `root`; :mod:`stages.report_inputs`):

- required: ``runs/pretrain/cnn-final.pt`` (the CNN), ``runs/finetune/tcnn-final.pt`` (the fine-tuned T-CNN)
  and ``results/metrics.json`` (the evaluate stage's robustness metrics); a missing or unreadable one is a
  StageError (one line, exit 2, nothing written);
- optional (a missing one becomes a note in the report): ``runs/reparam/equivalence.json``,
  ``runs/{pretrain,finetune}/{history,metrics}.json``, ``runs/finetune/gpsa.csv``, ``results/summary.json``,
  ``results/plots/robustness_gain.png`` (else redrawn from ``results/robustness.parquet``), the clean test
  images (``<robustness.dir>/clean.parquet``, else the test split of ``data.dir``), the MLflow run ids.

Writes ``results/report.html`` (images embedded as base64 PNG, so the single file can be logged as an MLflow
artifact) and ``results/plots/{training_curves,fig4_dynamics,fig5_attention,attention_contours,nonlocality}.png``
(drawn by :mod:`core.viz.report_pngs`).
The PNGs always exist after a successful run (a figure without data is a placeholder stating why), so DVC can declare them.

MLflow run ids: ``run(..., run_ids={"parent": ..., "<stage>": ...})`` when the caller knows them; otherwise
:func:`stages.report_inputs.read_run_ids` takes ``runs/mlflow_runs.json``. This module never imports MLflow:
the report renders without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from core.config import Params
from core.viz import report_pngs
from core.viz.report_html import FIGURES, Inputs, render_html
from stages import report_inputs
from stages.harness import chain
from stages.harness.runner import StageError, stage_main

NAME = "report"


def output_paths(root: Path) -> dict[str, Path]:
    """The report's outputs, where dvc.yaml names them (a figure dvc.yaml does not list is an error here)."""
    names = {"html": "report.html", **FIGURES}
    return {k: root / chain.output(NAME, v) for k, v in names.items()}


def run(params: Params, *, root: Path = Path("."), run_ids: dict[str, str] | None = None) -> dict[str, Any]:
    """Write results/report.html and the report's PNGs ([TCNN21] Figs. 3-5 and [ConViT21]'s nonlocality,
    where this run has their data); returns what was rendered and the notes."""
    root = Path(root)
    paths = report_inputs.input_paths(params, root)  # the required ones checked by `check`, run first by DVC
    metrics = report_inputs.required_metrics(params, paths["metrics"])
    cnn, cnn_meta = report_inputs.read_model(paths["cnn"])
    tcnn, tcnn_meta = report_inputs.read_model(paths["tcnn"])
    inputs = report_inputs.optional_inputs(params, paths, metrics, root)
    figs = report_pngs.training_figures(params, paths, inputs)
    figs["fig5"] = report_pngs.figure5(paths, cnn, tcnn, tcnn_meta, cnn_meta, inputs)
    figs["contours"], figs["nonlocality"] = report_pngs.dissection_figures(inputs)
    inputs.figures = figs

    run_ids, ids_note, meta = report_inputs.tracking_context(root, run_ids)
    text = render_html(inputs, run_ids, ids_note, meta, chain.stage_names())
    out = _write_outputs(root, inputs, figs, text)
    notes = [n for section in inputs.notes.values() for n in section]
    return {
        "report": str(out["html"]),
        "report_bytes": len(text.encode()),
        "figures": {k: bool(v) for k, v in figs.items()},
        "run_ids": run_ids or {},
        "attention": inputs.attention_stats,
        "notes": notes,
    }


def _write_outputs(root: Path, inputs: Inputs, figs: dict[str, bytes | None], text: str) -> dict[str, Path]:
    """Write every figure's PNG (a placeholder naming why for one without data), then the HTML; returns the
    output paths."""
    from core.viz.report_plots import write_bytes_atomic

    out = output_paths(root)
    for key in FIGURES:
        why = " ".join(inputs.notes.get(key if key != "training_curves" else "training", [])) or "no data"
        png = figs.get(key) or report_pngs.placeholder(f"{key}: not available ({why})")
        write_bytes_atomic(png, out[key])
    write_bytes_atomic(text.encode(), out["html"])
    return out


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the models and evaluate's metrics exist, every JSON input that exists parses (the
    run ids aside: the stage rewrites them when its runs open), and the local MLflow UI's port its links name
    (``TCNN_MLFLOW_PORT``, core.utils.mlflow_ui) is one."""
    from core.utils.mlflow_ui import ui_port

    ui_port()
    paths = report_inputs.input_paths(params, root)
    missing = [str(paths[k]) for k in ("cnn", "tcnn", "metrics") if not paths[k].is_file()]
    if missing:
        raise StageError(
            f"missing required input(s): {', '.join(missing)} (run pretrain, finetune and evaluate)"
        )
    for key, path in paths.items():
        if key != "run_ids" and path.suffix == ".json" and path.is_file():
            report_inputs.read_json(path, required=False)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
