"""Stage `report`: one self-contained HTML report of a run, plus its figures as PNG files.

    python -m stages.report [--params params.yaml]

Reads (relative to `root`):

- required: ``runs/pretrain/cnn-final.pt`` (the CNN), ``runs/finetune/tcnn-final.pt`` (the fine-tuned T-CNN)
  and ``results/metrics.json`` (the evaluate stage's robustness metrics); a missing or unreadable one is a
  StageError (one line, exit 2, nothing written);
- optional (a missing one becomes a note in the report): ``runs/reparam/equivalence.json``,
  ``runs/{pretrain,finetune}/{history,metrics}.json``, ``runs/finetune/gpsa.csv``, ``results/summary.json``,
  ``results/plots/robustness_gain.png`` (else redrawn from ``results/robustness.parquet``), the clean test
  images (``<robustness.dir>/clean.parquet``, else the test split of ``data.dir``), the MLflow run ids.

Writes ``results/report.html`` (images embedded as base64 PNG, so the single file can be logged as an MLflow
artifact) and ``results/plots/{training_curves,fig4_dynamics,fig5_attention,attention_contours,nonlocality}.png``.
The PNGs always exist after a successful run (a figure without data is a placeholder stating why), so DVC can declare them.

MLflow run ids: ``run(..., run_ids={"parent": ..., "<stage>": ...})`` when the caller knows them; otherwise
:func:`read_run_ids` takes ``runs/mlflow_runs.json`` (``{"parent": id, "stages": {stage: id}}`` or a flat
``{name: id}`` mapping; the tracking adapter starts the file over for every new parent, so it describes one
execution). This module never imports MLflow: the report renders without it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import Params
from core.viz.report_html import FIGURES, MODEL_LABELS, Inputs, model_names, render_html
from stages.harness import chain
from stages.harness.runner import StageError, stage_main

NAME = "report"
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


def output_paths(root: Path) -> dict[str, Path]:
    """The report's outputs, where dvc.yaml names them (a figure dvc.yaml does not list is an error here)."""
    names = {"html": "report.html", **FIGURES}
    return {k: root / chain.output(NAME, v) for k, v in names.items()}


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


def _read_json(path: Path, *, required: bool, inputs: Inputs | None = None, section: str = "") -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise StageError(f"{path}: missing (run the stage that writes it)") from None
        if inputs is not None:
            inputs.note(section, f"{inputs.rel(path)} is missing.")
    except (OSError, ValueError) as err:  # present but damaged: never read as missing (nor as good)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StageError(f"{path}: not valid JSON ({reason}); rerun the stage that writes it") from None
    return None


def _read_csv(path: Path, inputs: Inputs, section: str) -> list[dict[str, Any]] | None:
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


def _check_comparisons(params: Params, metrics: dict[str, Any], path: Path) -> None:
    """evaluate's metrics hold the comparisons the params ask for: with a matched control, the control and
    T-CNN - control (else the report would say "no matched control" for a run that has one)."""
    comps = metrics.get("comparisons")
    if not isinstance(comps, dict | list) or not comps:
        raise StageError(f"{path}: lacks its comparisons (damaged, or not evaluate's; rerun evaluate)")
    wants_control = params.finetune.control and params.model.record.has_control
    if wants_control and ("control" not in metrics or "tcnn-control" not in comps):
        raise StageError(f"{path}: has no matched control, but the params have one (rerun evaluate)")


def _load_model(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, checkpoint metadata: normalization, image_size, model_spec)."""
    from core.training.checkpoint import CheckpointError, load, load_model

    try:
        ckpt = load(path, require=("model", "model_spec"))
        meta = {k: ckpt.get(k) for k in ("normalization", "image_size", "model_spec")}
        del ckpt
        return load_model(path), meta
    except CheckpointError as err:
        raise StageError(str(err)) from None


def _history(path: Path, inputs: Inputs, section: str) -> list[dict[str, Any]] | None:
    h = _read_json(path, required=False, inputs=inputs, section=section)
    if h is not None and not (isinstance(h, list) and all(isinstance(r, dict) for r in h)):
        inputs.note(section, f"{inputs.rel(path)}: expected a list of epoch rows; ignored.")
        return None
    return h


def _dict_or_note(obj: Any, path: Path, inputs: Inputs, section: str) -> dict[str, Any] | None:
    if obj is not None and not isinstance(obj, dict):
        inputs.note(section, f"{inputs.rel(path)}: expected a JSON object; ignored.")
        return None
    return obj


# ------------------------------------------------------------------------------------------------ figures
def _test_image(
    paths: dict[str, Path], rel: Callable[[Path], str] = str
) -> tuple[Any, int | None, str, dict[str, Any] | None]:
    """(uint8 image [H, W, C], label, where it came from, manifest or None) of the first clean test image."""
    from core.data import DataError, load_split, read_manifest
    from core.robustness.corruptions import read_set

    manifest = None
    with contextlib.suppress(DataError, FileNotFoundError, ValueError, OSError):
        manifest = read_manifest(paths["data_dir"])
    if paths["clean_set"].is_file():
        try:
            s = read_set(paths["clean_set"])
            if len(s.images):
                return (
                    s.images[0],
                    int(s.labels[0]),
                    f"{rel(paths['clean_set'])} (test index {int(s.indices[0])})",
                    manifest,
                )
        except (ValueError, OSError, FileNotFoundError):
            pass
    images, labels = load_split(paths["data_dir"], "test")
    if not len(images):
        raise ValueError(f"{paths['data_dir']}: empty test split")
    return images[0], int(labels[0]), f"{rel(paths['data_dir'])} test split, index 0", manifest


def _figure5(
    paths: dict[str, Path], cnn: Any, tcnn: Any, meta: dict, cnn_meta: dict, inputs: Inputs
) -> bytes | None:
    """[TCNN21] Fig. 5 for the first clean test image (`core.viz.report_figures.attention_figure`; its
    attention data kept in ``inputs.attention_stats``)."""
    from core.data import DataError
    from core.models.reparam import attention_modules
    from core.viz.report_figures import attention_figure

    if not attention_modules(tcnn):
        inputs.note("fig5", "The fine-tuned model has no attention layer: no attention maps.")
        return None
    try:
        image, label, source, manifest = _test_image(paths, inputs.rel)
    except (DataError, FileNotFoundError, ValueError, OSError) as err:
        inputs.note("fig5", f"No clean test image available ({inputs.strip_root(str(err).splitlines()[0])}).")
        return None
    norm = meta.get("normalization") or (manifest and {"mean": manifest["mean"], "std": manifest["std"]})
    if not norm:
        inputs.note("fig5", "Neither the T-CNN checkpoint nor the data manifest gives the normalization.")
        return None
    fig = attention_figure(
        cnn, tcnn, image, label, source, norm=norm, cnn_norm=cnn_meta.get("normalization") or norm,
        image_size=meta.get("image_size"), cnn_image_size=cnn_meta.get("image_size"),
        label_names=(manifest or {}).get("label_names") or [],
    )  # fmt: skip
    if fig.note:
        inputs.note("fig5", fig.note)
    inputs.attention_layers, inputs.fig5_caption = fig.layers, fig.caption
    inputs.attention_stats.extend(fig.stats)
    return fig.png


def _dissection_figures(inputs: Inputs) -> tuple[bytes | None, bytes | None]:
    """Mass contours of the Fig. 5 maps and [ConViT21] Fig. 5 (nonlocality per layer over fine-tuning epochs)."""
    from core.viz.report_plots import plot_attention_contours, plot_nonlocality, to_png

    contours = nonloc = None
    if inputs.attention_layers:
        contours = to_png(plot_attention_contours(inputs.attention_layers))
    else:
        inputs.note("contours", "No attention maps (see Fig. 5): no contours.")
    rows = [r for r in inputs.gpsa_rows or [] if r.get("nonlocality") not in (None, "", "nan")]
    if rows:
        try:
            nonloc = to_png(plot_nonlocality(rows))
        except (ValueError, KeyError) as err:
            inputs.note("nonlocality", f"cannot plot the nonlocality ({err}).")
    else:
        inputs.note("nonlocality", "No nonlocality recorded during fine-tuning: no nonlocality plot.")
    return contours, nonloc


def _gain_png(paths: dict[str, Path], inputs: Inputs) -> bytes | None:
    if paths["gain_png"].is_file():
        return paths["gain_png"].read_bytes()
    comps = inputs.metrics.get("comparisons") or {}
    keys = [k for k in ("tcnn-control", "tcnn-cnn") if comps.get(k)]
    if not keys:
        inputs.note(
            "fig3",
            f"{inputs.rel(paths['gain_png'])} is missing and metrics.json has no comparisons: no Fig. 3.",
        )
        return None
    import tempfile

    from core.viz.plots import plot_gains

    with tempfile.TemporaryDirectory() as tmp:
        plot_gains(comps, keys, Path(tmp) / "gain.png", labels=MODEL_LABELS)
        data = (Path(tmp) / "gain.png").read_bytes()
    inputs.note("fig3", f"{inputs.rel(paths['gain_png'])} is missing; redrawn from results/metrics.json.")
    return data


def _placeholder(text: str) -> bytes:
    """A small PNG that says why a figure is missing (so the stage's declared outputs always exist)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(6, 1.2), dpi=100)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ stage
def run(params: Params, *, root: Path = Path("."), run_ids: dict[str, str] | None = None) -> dict[str, Any]:
    """Write results/report.html and the report's PNGs ([TCNN21] Figs. 3-5 and [ConViT21]'s nonlocality,
    where this run has their data); returns what was rendered and the notes."""
    root = Path(root)
    paths = input_paths(params, root)  # the required ones checked by `check`, which the DVC path runs first
    metrics = _required_metrics(params, paths["metrics"])
    cnn, cnn_meta = _load_model(paths["cnn"])
    tcnn, tcnn_meta = _load_model(paths["tcnn"])
    inputs = _optional_inputs(params, paths, metrics, root)
    figs = _training_figures(params, paths, inputs)
    figs["fig5"] = _figure5(paths, cnn, tcnn, tcnn_meta, cnn_meta, inputs)
    figs["contours"], figs["nonlocality"] = _dissection_figures(inputs)
    inputs.figures = figs

    if run_ids is None:
        run_ids, ids_note = read_run_ids(root)
    else:
        run_ids, ids_note = ({str(k): str(v) for k, v in run_ids.items() if v} or None), None
    meta = read_run_meta(root) if run_ids and run_ids.get("parent") == _recorded_parent(root) else {}
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


def _required_metrics(params: Params, path: Path) -> dict[str, Any]:
    """evaluate's per-model metrics, with the comparisons the params ask for (else StageError)."""
    metrics = _read_json(path, required=True)
    if not isinstance(metrics, dict) or not model_names(metrics):
        raise StageError(f"{path}: expected an object of per-model metrics (written by evaluate)")
    _check_comparisons(params, metrics, path)
    return metrics


def _optional_inputs(params: Params, paths: dict[str, Path], metrics: dict[str, Any], root: Path) -> Inputs:
    """The report's inputs: params, ``metrics`` and the optional files (reparam's equivalence, the training
    histories and metrics, the control's when evaluate compared one, the robustness summary, the GPSA rows);
    a missing or malformed optional file becomes a note."""
    inputs = Inputs(params=params.model_dump(mode="json"), metrics=metrics, root=root)
    inputs.equivalence = _dict_or_note(
        _read_json(paths["equivalence"], required=False, inputs=inputs, section="equivalence"),
        paths["equivalence"], inputs, "equivalence",
    )  # fmt: skip
    inputs.pretrain_history = _history(paths["pretrain_history"], inputs, "training")
    inputs.finetune_history = _history(paths["finetune_history"], inputs, "training")
    phases = ["pretrain_metrics", "finetune_metrics"]
    if "control" in metrics:  # evaluate compared a control: its training files belong in the report
        inputs.control_history = _history(paths["control_history"], inputs, "training")
        phases.append("control_metrics")
    for key in phases:
        obj = _read_json(paths[key], required=False, inputs=inputs, section="training")
        setattr(inputs, key, _dict_or_note(obj, paths[key], inputs, "training"))
    inputs.summary = _dict_or_note(
        _read_json(paths["summary"], required=False), paths["summary"], inputs, "robustness"
    )
    inputs.gpsa_rows = _read_csv(paths["gpsa"], inputs, "fig4")
    return inputs


def _training_figures(params: Params, paths: dict[str, Path], inputs: Inputs) -> dict[str, bytes | None]:
    """The training curves with t1 marked ([TCNN21] Fig. 4A), Fig. 3 (`_gain_png`) and the GPSA dynamics over
    fine-tuning (Fig. 4B-C); None, with a note, for a figure without data."""
    from core.viz.report_plots import gpsa_dynamics, plot_gpsa_dynamics, plot_training_curves

    figs: dict[str, bytes | None] = {}
    t1 = (inputs.equivalence or {}).get("reparam_epoch", params.reparam.epoch)
    if inputs.pretrain_history or inputs.finetune_history:
        figs["training_curves"] = plot_training_curves(
            inputs.pretrain_history, inputs.finetune_history, reparam_epoch=t1, control=inputs.control_history
        )
    else:
        figs["training_curves"] = None
        inputs.note("training", "No training history: no training curves.")
    figs["fig3"] = _gain_png(paths, inputs)
    figs["fig4"] = None
    if inputs.gpsa_rows:
        try:
            figs["fig4"] = plot_gpsa_dynamics(gpsa_dynamics(inputs.gpsa_rows))
        except (ValueError, KeyError) as err:
            inputs.note("fig4", f"{inputs.rel(paths['gpsa'])}: cannot plot ({err}).")
    return figs


def _write_outputs(root: Path, inputs: Inputs, figs: dict[str, bytes | None], text: str) -> dict[str, Path]:
    """Write every figure's PNG (a placeholder naming why for one without data), then the HTML; returns the
    output paths."""
    from core.viz.report_plots import write_bytes_atomic

    out = output_paths(root)
    for key in FIGURES:
        why = " ".join(inputs.notes.get(key if key != "training_curves" else "training", [])) or "no data"
        write_bytes_atomic(figs.get(key) or _placeholder(f"{key}: not available ({why})"), out[key])
    write_bytes_atomic(text.encode(), out["html"])
    return out


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the models and evaluate's metrics exist, and every JSON input that exists parses
    (the run ids aside: the stage rewrites them when its runs open)."""
    paths = input_paths(params, root)
    missing = [str(paths[k]) for k in ("cnn", "tcnn", "metrics") if not paths[k].is_file()]
    if missing:
        raise StageError(
            f"missing required input(s): {', '.join(missing)} (run pretrain, finetune and evaluate)"
        )
    for key, path in paths.items():
        if key != "run_ids" and path.suffix == ".json" and path.is_file():
            _read_json(path, required=False)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
