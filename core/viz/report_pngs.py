"""The run report's figures, drawn from a run's files: the training curves with t1 marked ([TCNN21] Fig. 4A),
the robustness gains (Fig. 3), the GPSA dynamics over fine-tuning (Fig. 4B-C), the attention maps for the
first clean test image ([TCNN21] Fig. 5), their mass contours and the nonlocality per layer ([ConViT21] Fig. 5).

Each function returns PNG bytes, or None with a note in the report's :class:`core.viz.report_html.Inputs`
saying why a figure has no data; :func:`placeholder` draws the PNG that says so, so the stage's declared
outputs always exist. The plotting and model code is imported when a figure is drawn, so the report stage's
`check` stays light.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import Params
from core.robustness.headline import MODEL_LABELS
from core.utils.errors import first_line
from core.viz.report_html import Inputs


def first_test_image(
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


def figure5(
    paths: dict[str, Path],
    cnn: Any,
    tcnn: Any,
    meta: dict[str, Any],
    cnn_meta: dict[str, Any],
    inputs: Inputs,
) -> bytes | None:
    """[TCNN21] Fig. 5 for the first clean test image (`core.viz.report_figures.attention_figure`; its
    attention data kept in ``inputs.attention_stats``)."""
    from core.data import DataError
    from core.models.conversion import attention_modules
    from core.viz.report_figures import attention_figure

    if not attention_modules(tcnn):
        inputs.note("fig5", "The fine-tuned model has no attention layer: no attention maps.")
        return None
    try:
        image, label, source, manifest = first_test_image(paths, inputs.rel)
    except (DataError, FileNotFoundError, ValueError, OSError) as err:
        inputs.note("fig5", f"No clean test image available ({inputs.strip_root(first_line(err))}).")
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


def dissection_figures(inputs: Inputs) -> tuple[bytes | None, bytes | None]:
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


def gain_png(paths: dict[str, Path], inputs: Inputs) -> bytes | None:
    """[TCNN21] Fig. 3: evaluate's robustness-gain plot, else redrawn from the comparisons in its metrics."""
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


def placeholder(text: str) -> bytes:
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


def training_figures(params: Params, paths: dict[str, Path], inputs: Inputs) -> dict[str, bytes | None]:
    """The training curves with t1 marked ([TCNN21] Fig. 4A), Fig. 3 (:func:`gain_png`) and the GPSA dynamics
    over fine-tuning (Fig. 4B-C); None, with a note, for a figure without data."""
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
    figs["fig3"] = gain_png(paths, inputs)
    figs["fig4"] = None
    if inputs.gpsa_rows:
        try:
            figs["fig4"] = plot_gpsa_dynamics(gpsa_dynamics(inputs.gpsa_rows))
        except (ValueError, KeyError) as err:
            inputs.note("fig4", f"{inputs.rel(paths['gpsa'])}: cannot plot ({err}).")
    return figs
