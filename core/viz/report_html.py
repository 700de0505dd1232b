"""The run report's HTML ([TCNN21] Fig. 3-5 and the tables next to them), rendered from what the report
stage gathered (`Inputs`): no file access, no MLflow.

What the report shows is decided here; core/viz/templates/run_*.html lay it out (core.viz.html.render).
Values are escaped by the templates; a cell holding HTML is built as Markup, which escapes what it formats.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from markupsafe import Markup

from core.robustness.headline import COMPARISON_LABELS, MODEL_LABELS
from core.utils import mlflow_ui
from core.viz.html import finite, fmt_delta_pp, fmt_diff, fmt_num, fmt_pct, fmt_sci, render

FIGURES = {
    "training_curves": "training_curves.png",
    "fig4": "fig4_dynamics.png",
    "fig5": "fig5_attention.png",
    "contours": "attention_contours.png",
    "nonlocality": "nonlocality.png",
}
NOT_MODELS = (
    "comparisons",
    "bootstrap",
    "tcnn_gain",
    "public",
    "cnn_evaluation",
)  # results/metrics.json entries that are not models


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


def model_names(metrics: dict[str, Any]) -> list[str]:
    names = [m for m, v in metrics.items() if isinstance(v, dict) and m not in NOT_MODELS]
    return sorted(
        names,
        key=lambda m: (m not in MODEL_LABELS, list(MODEL_LABELS).index(m) if m in MODEL_LABELS else 0, m),
    )


def _label(m: str) -> str:
    return MODEL_LABELS.get(m, m)


def _code(x: Any) -> Markup:
    return Markup("<code>{}</code>").format(x)


def section_runs(
    run_ids: dict[str, str] | None,
    params: dict[str, Any],
    note: str | None,
    meta: Mapping[str, str] | None = None,
    stage_order: Sequence[str] = (),
) -> Markup:
    """The MLflow section: tracking settings, the parent run's place in the UI, the run ids in stage order."""
    tr = params.get("tracking", {})
    meta = meta or {}
    exp = meta.get("experiment_id")
    base = mlflow_ui.ui_base(meta.get("tracking_uri") or tr.get("uri"))
    runs_link = mlflow_ui.runs_url(exp, base) if exp else None

    def run_id_cell(run_id: str) -> Markup:  # the id, a link to the run's page when the experiment is known
        if not exp:
            return _code(run_id)
        return Markup('<a href="{}">{}</a>').format(mlflow_ui.run_url(exp, run_id, base), _code(run_id))

    rows = []
    if run_ids:
        order = ["parent", *stage_order]
        keys = sorted(run_ids, key=lambda k: (order.index(k) if k in order else len(order), k))
        rows = [["parent (pipeline)" if k == "parent" else f"stage: {k}" if k in stage_order else k,
                 run_id_cell(run_ids[k])] for k in keys]  # fmt: skip
    return render(
        "run_mlflow.html",
        enabled=tr.get("enabled"),
        uri=tr.get("uri"),
        experiment=tr.get("experiment"),
        dvc_exp_name=meta.get("dvc_exp_name"),
        runs_link=runs_link,
        local_ui=base == mlflow_ui.local_ui(),
        ui_port=mlflow_ui.ui_port(),
        store=meta.get("tracking_uri", ""),
        rows=rows,
        note=note,
    )


def _source_rows(eq: dict[str, Any]) -> list[list[Any]]:
    """Where the CNN came from: trained here, or imported (pretrain.source: file, sha256, normalization, and
    whether its classifier was replaced)."""
    src = eq.get("source") if eq.get("imported") else None
    if not isinstance(src, dict):
        return [["the CNN", "trained here (the pretrain stage)"]]
    norm = eq.get("normalization") or {}
    head = (f"replaced: {src.get('source_classes')} classes in the checkpoint (the equivalence compares the "
            f"features before it)") if src.get("head_replaced") else "kept"  # fmt: skip
    return [
        ["the CNN", Markup("imported: {} ({})").format(_code(src.get("weights")), _code(src.get("arch")))],
        ["its sha256", _code(src.get("sha256"))],
        ["input normalization", f"mean {norm.get('mean')}, std {norm.get('std')} ({norm.get('from')})"],
        [f"classifier {src.get('classifier')!r}", head],
    ]


def _section_equivalence(eq: dict[str, Any] | None) -> Markup:
    if not eq:
        return Markup()
    other = "s1" if eq.get("stride_mode") == "exact" else "exact"
    lam = eq.get("lambda_init")
    sig = 1 / (1 + math.exp(-lam)) if finite(lam) else None
    diff = eq.get("max_abs_logit_diff")
    scale = eq.get("max_abs_logit_cnn")
    rel = diff / scale if finite(diff) and finite(scale) and scale > 0 else None
    rows = _source_rows(eq) + [
        ["reparameterization epoch t1", fmt_num(eq.get("reparam_epoch"))],
        ["converted layers", ", ".join(eq.get("gpsa_layers") or []) or "none"],
        ["stride mode", _code(eq.get("stride_mode"))],
        ["alpha init", fmt_num(eq.get("alpha_init"))],
        ["lambda init (sigma(lambda))", f"{fmt_num(lam)} ({fmt_num(sig, 3)})"],
        ["probe images", fmt_num(eq.get("probe_images"))],
        ["compared", eq.get("compared") or "logits"],
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
    models = model_names(metrics)
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
    stage_order: Sequence[str] = (),
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
        "t1": (eq or {}).get("reparam_epoch", rp.get("epoch")),  # what reparam converted (0: an import)
        "imported": ((eq or {}).get("source") or {}).get("weights") if (eq or {}).get("imported") else None,
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
        runs=section_runs(run_ids, p, run_ids_note, run_meta, stage_order),
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
