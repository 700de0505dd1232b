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
import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from markupsafe import Markup

from core.config import Params
from core.viz.html import finite, fmt_delta_pp, fmt_diff, fmt_num, fmt_pct, fmt_sci, render
from stages.runner import StageError, stage_main

NAME = "report"
RUN_IDS_FILE = Path("runs") / "mlflow_runs.json"
STAGE_ORDER = ("prepare", "pretrain", "reparam", "finetune", "control", "corrupt", "evaluate", "report")
FIGURES = {
    "training_curves": "training_curves.png",
    "fig4": "fig4_dynamics.png",
    "fig5": "fig5_attention.png",
    "contours": "attention_contours.png",
    "nonlocality": "nonlocality.png",
}
MODEL_LABELS = {"cnn": "pretrained CNN", "control": "control", "tcnn": "T-CNN"}
NOT_MODELS = (
    "comparisons",
    "bootstrap",
    "tcnn_gain",
    "public",
)  # results/metrics.json entries that are not models


def input_paths(params: Params, root: Path) -> dict[str, Path]:
    """Every file the report reads, by role (the DVC deps of the stage)."""
    runs, res = root / "runs", root / "results"
    return {
        "cnn": runs / "pretrain" / "cnn-final.pt",
        "tcnn": runs / "finetune" / "tcnn-final.pt",
        "metrics": res / "metrics.json",
        "equivalence": runs / "reparam" / "equivalence.json",
        "pretrain_history": runs / "pretrain" / "history.json",
        "pretrain_metrics": runs / "pretrain" / "metrics.json",
        "finetune_history": runs / "finetune" / "history.json",
        "finetune_metrics": runs / "finetune" / "metrics.json",
        "control_history": runs / "control" / "history.json",
        "control_metrics": runs / "control" / "metrics.json",
        "gpsa": runs / "finetune" / "gpsa.csv",
        "summary": res / "summary.json",
        "gain_png": res / "plots" / "robustness_gain.png",
        "robustness": res / "robustness.parquet",
        "clean_set": root / params.robustness.dir / "clean.parquet",
        "data_dir": root / params.data.dir,
        "run_ids": root / RUN_IDS_FILE,
    }


def output_paths(root: Path) -> dict[str, Path]:
    plots = root / "results" / "plots"
    return {"html": root / "results" / "report.html", **{k: plots / v for k, v in FIGURES.items()}}


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


# ------------------------------------------------------------------------------------------------ inputs
@dataclass
class Inputs:
    """What the report is made of; every optional part may be None (with a note saying why)."""

    params: dict[str, Any]
    metrics: dict[str, Any]
    root: Path = Path(".")
    equivalence: dict[str, Any] | None = None
    pretrain_history: list[dict[str, Any]] | None = None
    pretrain_metrics: dict[str, Any] | None = None
    finetune_history: list[dict[str, Any]] | None = None
    finetune_metrics: dict[str, Any] | None = None
    control_history: list[dict[str, Any]] | None = None
    control_metrics: dict[str, Any] | None = None
    gpsa_rows: list[dict[str, Any]] | None = None
    summary: dict[str, Any] | None = None
    figures: dict[str, bytes | None] = field(default_factory=dict)
    fig5_caption: str | None = None
    attention_stats: list[dict[str, Any]] = field(default_factory=list)
    attention_layers: list[Any] = field(default_factory=list)  # core.analysis.dissect.LayerAttention of fig5
    notes: dict[str, list[str]] = field(default_factory=dict)

    def note(self, section: str, text: str) -> None:
        self.notes.setdefault(section, []).append(text)

    def strip_root(self, text: str) -> str:
        """An error message with the run's root prefix removed from the paths it names."""
        prefix = str(self.root).rstrip(os.sep) + os.sep
        return text.replace(prefix, "") if prefix != "." + os.sep else text

    def rel(self, path: Path) -> str:
        """`path` as shown in the report: relative to the run's root when inside it."""
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)


def _read_json(path: Path, *, required: bool, inputs: Inputs | None = None, section: str = "") -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise StageError(f"{path}: missing (run the stage that writes it)") from None
        if inputs is not None:
            inputs.note(section, f"{inputs.rel(path)} is missing.")
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if required:
            raise StageError(f"{path}: not valid JSON ({reason})") from None
        if inputs is not None:
            inputs.note(section, f"{inputs.rel(path)} is unreadable ({reason}).")
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
    """[TCNN21] Fig. 5 for the first clean test image (attention data kept in ``inputs.attention_stats``)."""
    import numpy as np

    from core.analysis.dissect import centre_query_maps
    from core.data import DataError
    from core.models.reparam import attention_modules
    from core.viz.report_plots import plot_attention_maps, preprocess_image

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
    names = (manifest or {}).get("label_names") or []

    def name(i: int | None) -> str:
        return "?" if i is None else (f"{i} ({names[i]})" if 0 <= i < len(names) else str(i))

    x = preprocess_image(image, norm["mean"], norm["std"], meta.get("image_size"))
    try:
        layers, logits = centre_query_maps(tcnn, x)
    except ValueError as err:  # e.g. ConViT-mode GPSA (token inputs): no conv-grid maps to draw
        inputs.note("fig5", f"No attention maps: {str(err).splitlines()[0]}.")
        return None
    cnorm = cnn_meta.get("normalization") or norm
    import torch

    with torch.no_grad():
        cnn_pred = int(
            cnn(preprocess_image(image, cnorm["mean"], cnorm["std"], cnn_meta.get("image_size"))).argmax()
        )
    tcnn_pred = int(logits.argmax())
    inputs.attention_layers = list(layers)
    inputs.fig5_caption = f"Input: {source}; label {name(label)}; CNN predicts {name(cnn_pred)}, T-CNN predicts {name(tcnn_pred)}."
    for la in layers:
        q = la.maps
        inputs.attention_stats.append(
            {
                "layer": la.name,
                "grid": f"{la.grid[0]}x{la.grid[1]}",
                "query": f"({la.query[0]}, {la.query[1]})",
                "mass": float(q.sum(axis=(1, 2)).min()),
                "peak": float(q.reshape(q.shape[0], -1).max(axis=1).mean()),
                "gate": float(np.nanmean(la.gate)) if np.isfinite(la.gate).any() else None,
            }
        )
    return plot_attention_maps(layers, image, title=f"Centre-query attention per GPSA layer and head ([TCNN21] Fig. 5); "
                               f"label {name(label)}, T-CNN predicts {name(tcnn_pred)}")  # fmt: skip


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


# ------------------------------------------------------------------------------------------------ HTML
# What the report shows is decided here; core/viz/templates/run_*.html lay it out (core.viz.html.render).
# Values are escaped by the templates; a cell holding HTML is built as Markup, which escapes what it formats.
def _models(metrics: dict[str, Any]) -> list[str]:
    names = [m for m, v in metrics.items() if isinstance(v, dict) and m not in NOT_MODELS]
    return sorted(
        names,
        key=lambda m: (m not in MODEL_LABELS, list(MODEL_LABELS).index(m) if m in MODEL_LABELS else 0, m),
    )


def _label(m: str) -> str:
    return MODEL_LABELS.get(m, m)


def _code(x: Any) -> Markup:
    return Markup("<code>{}</code>").format(x)


def _section_runs(
    run_ids: dict[str, str] | None,
    params: dict[str, Any],
    note: str | None,
    meta: Mapping[str, str] | None = None,
) -> Markup:
    """The MLflow section: tracking settings, the parent run's place in the UI, the run ids in stage order."""
    tr = params.get("tracking", {})
    meta = meta or {}
    ui_link = None
    if run_ids and run_ids.get("parent") and meta.get("experiment_id"):
        ui_link = f"#/experiments/{meta['experiment_id']}/runs/{run_ids['parent']}"
    rows = []
    if run_ids:
        order = ["parent", *STAGE_ORDER]
        keys = sorted(run_ids, key=lambda k: (order.index(k) if k in order else len(order), k))
        rows = [["parent (pipeline)" if k == "parent" else f"stage: {k}" if k in STAGE_ORDER else k,
                 _code(run_ids[k])] for k in keys]  # fmt: skip
    return render(
        "run_mlflow.html",
        enabled=tr.get("enabled"),
        uri=tr.get("uri"),
        experiment=tr.get("experiment"),
        dvc_exp_name=meta.get("dvc_exp_name"),
        ui_link=ui_link,
        store=meta.get("tracking_uri", ""),
        rows=rows,
        note=note,
    )


def _section_equivalence(eq: dict[str, Any] | None) -> Markup:
    if not eq:
        return Markup()
    other = "s1" if eq.get("stride_mode") == "exact" else "exact"
    lam = eq.get("lambda_init")
    sig = 1 / (1 + math.exp(-lam)) if finite(lam) else None
    diff = eq.get("max_abs_logit_diff")
    scale = eq.get("max_abs_logit_cnn")
    rel = diff / scale if finite(diff) and finite(scale) and scale > 0 else None
    rows = [
        ["reparameterization epoch t1", fmt_num(eq.get("reparam_epoch"))],
        ["converted layers", ", ".join(eq.get("gpsa_layers") or []) or "none"],
        ["stride mode", _code(eq.get("stride_mode"))],
        ["alpha init", fmt_num(eq.get("alpha_init"))],
        ["lambda init (sigma(lambda))", f"{fmt_num(lam)} ({fmt_num(sig, 3)})"],
        ["probe images", fmt_num(eq.get("probe_images"))],
        [f"max |logit diff| T-CNN vs CNN ({eq.get('stride_mode')})", Markup("<b>{}</b>{}").format(fmt_sci(diff),
         f" (relative to max |logit| {fmt_num(scale, 3)}: {fmt_sci(rel)})" if rel is not None else "")],
        ["mean |logit diff|", fmt_sci(eq.get("mean_abs_logit_diff"))],
        [f"max |logit diff| with stride mode {other}", fmt_sci(eq.get(f"max_abs_logit_diff_{other}"))
         + (f" ({eq[f'{other}_error']})" if eq.get(f"{other}_error") else "")],
        ["prediction agreement", fmt_pct(eq.get("prediction_agreement"))],
    ]  # fmt: skip
    for split in ("val", "test"):
        if f"{split}_acc_cnn" in eq:
            a, b = eq.get(f"{split}_acc_cnn"), eq.get(f"{split}_acc_tcnn")
            rows.append([f"{split} accuracy: CNN / T-CNN before fine-tuning",
                         f"{fmt_pct(a)} / {fmt_pct(b)} ({fmt_delta_pp(a, b)})"])  # fmt: skip
    if "params_cnn" in eq:
        rows.append(
            ["parameters CNN / T-CNN", f"{fmt_num(eq.get('params_cnn'))} / {fmt_num(eq.get('params_tcnn'))}"]
        )
    if eq.get("note"):
        rows.append(["note", eq["note"]])
    names = {"paper": "the paper's init ([TCNN21] Sec. 2)", "large": "a large init"}
    inits = [[names.get(r.get("init"), r.get("init")), fmt_num(r.get("alpha_init")), fmt_num(r.get("lambda_init")),
              fmt_sci(r.get("max_abs_logit_diff")), fmt_pct(r.get("prediction_agreement")),
              fmt_pct(r.get("test_acc")) if "test_acc" in r else "not measured"]
             for r in eq.get("inits") or [] if isinstance(r, dict)]  # fmt: skip
    exact = diff <= 1e-4 if finite(diff) else None  # to float precision; None: not measured
    return render("run_equivalence.html", rows=rows, exact=exact, inits=inits)


def _coverage(summary: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Coverage facts from results/summary.json (corruptions left out, incomplete benchmark) as (the models
    it applies to, fact), one per fact."""
    facts: dict[str, list[str]] = {}
    for m, s in (summary or {}).items():
        if not isinstance(s, dict):
            continue
        if s.get("excluded"):
            text = f"left out of every number as not meaningful on this data: {', '.join(map(str, s['excluded']))}."
            facts.setdefault(text, []).append(_label(m))
        if s.get("complete") is False:
            text = (f"evaluated on {len(s.get('corruptions') or [])} of the 15 benchmark corruptions and/or a "
                    "subset of the 5 severities (CE and mCE over what was evaluated).")  # fmt: skip
            facts.setdefault(text, []).append(_label(m))
    return [(", ".join(who), text) for text, who in facts.items()]


HEADLINE = (
    ("clean accuracy", "clean_accuracy", "acc"),
    ("mean corruption accuracy (mCA, 15 benchmark corruptions)", "mca", "acc"),
    ("mCE (lower is better)", "mce", "err"),
    ("relative mCE (lower is better)", "relative_mce", "err"),
    ("extra corruptions: mean accuracy", "extra_accuracy", "acc"),
    ("extra corruptions: mCE", "extra_mce", "err"),
)
COMPARISON_LABELS = {
    "tcnn-control": "T-CNN − control",
    "tcnn-cnn": "T-CNN − pretrained CNN",
    "control-cnn": "control − pretrained CNN",
}


def verdict(
    name: str, d: Mapping[str, Any] | None, higher_is_better: bool = True, other: str = "the control"
) -> str:
    """One sentence on what the interval of a difference (T-CNN minus `other`) says."""
    if not d or not finite(d.get("diff")):
        return ""
    span = f"{100 * d['diff']:+.2f} pp, 95% interval [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}] pp"
    if not d.get("excludes_zero"):
        return (f"{name}: {span}. The interval includes 0: the difference is within what resampling the test "
                f"images gives, so this run cannot tell the T-CNN and {other} apart.")  # fmt: skip
    better = (d["diff"] > 0) == higher_is_better
    return (f"{name}: {span}. The interval excludes 0: on these test images the T-CNN is "
            f"{'better' if better else 'worse'} than {other} (one training run: the interval covers test-set "
            "sampling, not seed-to-seed variation).")  # fmt: skip


def _section_robustness(metrics: dict[str, Any]) -> Markup:
    models = _models(metrics)
    if not models:
        return render("run_robustness.html", headline=None)
    comps = metrics.get("comparisons") or {}
    keys = [k for k in COMPARISON_LABELS if k in comps]
    headers = ["metric", *[_label(m) for m in models], *[COMPARISON_LABELS[k] + " [95% CI]" for k in keys]]
    rows = []
    for label, key, kind in HEADLINE:
        vals = [metrics[m].get(key) for m in models]
        if all(v is None for v in vals):
            continue
        digits = 2 if kind == "acc" else 1
        rows.append(
            [label, *[fmt_pct(v, digits) for v in vals], *[fmt_diff(comps[k].get(key), kind) for k in keys]]
        )
    breakdowns = []
    for title, pred, strip in (
        ("per category", lambda k: k.startswith("mca_") and not k.startswith("mca_sev"), "mca_"),
        ("per severity", lambda k: k.startswith("mca_sev"), "mca_sev"),
    ):
        mkeys = list(dict.fromkeys(k for m in models for k in metrics[m] if pred(k)))
        if not mkeys:
            continue
        hdr = [title.split()[1], *[f"{_label(m)} mCA" for m in models]]
        hdr += [f"{COMPARISON_LABELS[k]} [95% CI]" for k in keys]
        hdr += [
            f"relative gain {COMPARISON_LABELS[k].replace(' − ', ' over ')}"
            for k in keys
            if k.startswith("tcnn")
        ]
        body = []
        for k in mkeys:
            g = k.removeprefix(strip)
            gain_key = f"gain_{'sev' if strip == 'mca_sev' else ''}{g}"
            row = [g, *[fmt_pct(metrics[m].get(k)) for m in models]]
            row += [fmt_diff(comps[c].get(k)) for c in keys]
            row += [fmt_diff(comps[c].get(gain_key), "ratio") for c in keys if c.startswith("tcnn")]
            body.append(row)
        breakdowns.append({"title": title, "headers": hdr, "rows": body})
    boot = metrics.get("bootstrap") or {}
    images = boot.get("images") or {}
    return render(
        "run_robustness.html",
        headline={"headers": headers, "rows": rows},
        baseline=metrics.get("baseline", "n/a"),
        image_size=metrics.get("test_image_size", "n/a"),
        clean_images=images.get("clean"),
        images_per_set=images.get("per_corrupted_set"),
        replicates=boot.get("replicates"),
        breakdowns=breakdowns,
    )


def _lead(metrics: dict[str, Any]) -> Markup:
    """The report's first words: what attention buys (T-CNN vs its matched control), in sentences."""
    comps = metrics.get("comparisons") or {}
    main = comps.get("tcnn-control")
    if not main:
        why = ("the control is off (finetune.control: false) or this model kind has none"
               if "tcnn-cnn" in comps else "results/metrics.json has no comparisons")  # fmt: skip
        return render("run_lead.html", why=why, sentences=[])
    sentences = [
        verdict(f"{name} (T-CNN − control)", main.get(key), better)
        for name, key, better in (("Clean accuracy", "clean_accuracy", True), ("mCA", "mca", True),
                                  ("mCE", "mce", False))
    ]  # fmt: skip
    return render("run_lead.html", why=None, sentences=[s for s in sentences if s])


def _training_rows(inputs: Inputs) -> list[list[str]]:
    """One row per training phase with final metrics (the control only when it was enabled)."""
    rows = []
    for phase, m in (
        ("pretrain (CNN)", inputs.pretrain_metrics),
        ("finetune (T-CNN)", inputs.finetune_metrics),
        ("control (CNN, same fine-tuning recipe)", inputs.control_metrics),
    ):
        if not m or m.get("enabled") is False:
            continue
        epochs = m.get("epochs", m.get("epochs_run"))
        rows.append([phase, fmt_num(epochs), fmt_pct(m.get("train_acc")), fmt_pct(m.get("val_acc")),
                     fmt_pct(m.get("test_acc")), fmt_num(m.get("test_loss")),
                     fmt_num(m.get("train_time_s"), 3), m.get("device", "")])  # fmt: skip
    return rows


def _fig4_table(rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Per GPSA layer, the mean span, gate and nonlocality right after reparameterization and at the last
    fine-tuning epoch: {"rows": ..., "last_epoch": ...}; None without (readable) GPSA history."""
    if not rows:
        return None
    from core.viz.report_plots import gpsa_dynamics

    try:
        dyn = gpsa_dynamics(rows)
    except ValueError:
        return None
    import numpy as np

    body = []
    for layer, qs in dyn.values.items():
        cells = [layer]
        for q in ("inv_alpha", "gate", "nonlocality"):
            if q in qs:
                with np.errstate(all="ignore"):
                    m = np.nanmean(qs[q], axis=1)
                cells.append(f"{fmt_num(float(m[0]), 3)} → {fmt_num(float(m[-1]), 3)}")
            else:
                cells.append("n/a")
        body.append(cells)
    return {"rows": body, "last_epoch": int(dyn.epochs[-1])}


def render_html(
    inputs: Inputs,
    run_ids: dict[str, str] | None = None,
    run_ids_note: str | None = None,
    run_meta: Mapping[str, str] | None = None,
) -> str:
    """The report as one HTML string (no file access, no MLflow): config, MLflow run ids, equivalence,
    CNN vs T-CNN robustness, training curves, Fig. 3, Fig. 4, Fig. 5, notes on missing optional inputs."""
    p, m, eq = inputs.params, inputs.metrics, inputs.equivalence
    comps = m.get("comparisons") or {}
    ref = "tcnn-control" if "tcnn-control" in comps else "tcnn-cnn"
    vs = COMPARISON_LABELS.get(ref, ref)
    kpis = [
        (f"{vs}: clean accuracy", fmt_diff((comps.get(ref) or {}).get("clean_accuracy"))),
        (f"{vs}: mCA", fmt_diff((comps.get(ref) or {}).get("mca"))),
        (f"{vs}: mCE", fmt_diff((comps.get(ref) or {}).get("mce"), "err")),
        ("T-CNN clean accuracy", fmt_pct((m.get("tcnn") or {}).get("clean_accuracy"))),
        ("equivalence max |Δlogit|", fmt_sci((eq or {}).get("max_abs_logit_diff"))),
    ]
    data, model, rp = p.get("data", {}), p.get("model", {}), p.get("reparam", {})
    run = {
        "data": data.get("name"),
        "kind": model.get("kind"),
        "arch": model.get("arch"),
        "t1": rp.get("epoch"),
        "alpha_init": rp.get("alpha_init"),
        "lambda_init": rp.get("lambda_init"),
        "finetune_mode": p.get("finetune", {}).get("mode"),
        "seed": p.get("seed"),
    }
    attention = [[a["layer"], a["grid"], a["query"], fmt_num(a["mass"], 6), fmt_num(a["peak"], 3),
                  fmt_num(a["gate"], 3)] for a in inputs.attention_stats]  # fmt: skip
    return render(
        "run_report.html",
        run=run,
        kpis=kpis,
        lead=_lead(m),
        runs=_section_runs(run_ids, p, run_ids_note, run_meta),
        robustness=_section_robustness(m),
        public=_section_robustness(m["public"]) if isinstance(m.get("public"), dict) else None,
        public_kind=(m.get("public") or {}).get("kind"),
        coverage=_coverage(inputs.summary),
        equivalence=_section_equivalence(eq),
        training=_training_rows(inputs),
        fig4=_fig4_table(inputs.gpsa_rows),
        fig5_caption=inputs.fig5_caption,
        attention=attention,
        figures={k: inputs.figures.get(k) for k in ("fig3", *FIGURES)},
        section_notes=defaultdict(list, inputs.notes),
        config=yaml.safe_dump(p, sort_keys=False, default_flow_style=None, width=100),
    )


# ------------------------------------------------------------------------------------------------ stage
def run(params: Params, *, root: Path = Path("."), run_ids: dict[str, str] | None = None) -> dict[str, Any]:
    """Write results/report.html and the report's PNGs; returns what was rendered and the notes."""
    root = Path(root)
    paths = input_paths(params, root)
    missing = [str(paths[k]) for k in ("cnn", "tcnn", "metrics") if not paths[k].is_file()]
    if missing:
        raise StageError(
            f"missing required input(s): {', '.join(missing)} (run pretrain, finetune and evaluate)"
        )
    metrics = _read_json(paths["metrics"], required=True)
    if not isinstance(metrics, dict) or not _models(metrics):
        raise StageError(f"{paths['metrics']}: expected an object of per-model metrics (written by evaluate)")
    cnn, cnn_meta = _load_model(paths["cnn"])
    tcnn, tcnn_meta = _load_model(paths["tcnn"])

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

    from core.viz.report_plots import (
        gpsa_dynamics,
        plot_gpsa_dynamics,
        plot_training_curves,
        write_bytes_atomic,
    )

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
    figs["fig5"] = _figure5(paths, cnn, tcnn, tcnn_meta, cnn_meta, inputs)
    figs["contours"], figs["nonlocality"] = _dissection_figures(inputs)
    inputs.figures = figs

    if run_ids is None:
        run_ids, ids_note = read_run_ids(root)
    else:
        run_ids, ids_note = ({str(k): str(v) for k, v in run_ids.items() if v} or None), None
    meta = read_run_meta(root) if run_ids and run_ids.get("parent") == _recorded_parent(root) else {}
    text = render_html(inputs, run_ids, ids_note, meta)

    out = output_paths(root)
    for key in FIGURES:
        why = " ".join(inputs.notes.get(key if key != "training_curves" else "training", [])) or "no data"
        write_bytes_atomic(figs.get(key) or _placeholder(f"{key}: not available ({why})"), out[key])
    write_bytes_atomic(text.encode(), out["html"])
    notes = [n for section in inputs.notes.values() for n in section]
    return {
        "report": str(out["html"]),
        "report_bytes": len(text.encode()),
        "figures": {k: bool(v) for k, v in figs.items()},
        "run_ids": run_ids or {},
        "attention": inputs.attention_stats,
        "notes": notes,
    }


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the models and evaluate's metrics exist."""
    paths = input_paths(params, root)
    missing = [str(paths[k]) for k in ("cnn", "tcnn", "metrics") if not paths[k].is_file()]
    if missing:
        raise StageError(
            f"missing required input(s): {', '.join(missing)} (run pretrain, finetune and evaluate)"
        )


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
