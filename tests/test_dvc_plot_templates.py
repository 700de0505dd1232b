"""The DVC plots' own templates (infra/dvc/plots/*.json), drawn by Vega-Lite itself (vl-convert, the wheel the
offline page bundles) on rows shaped as DVC hands them over: the legend names the models ("control", "T-CNN"),
the epoch axis has integer labels only, and every plot of dvc.yaml has a title and labelled axes (issue 59, 13)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _svg(template: str, rows: list[dict], x: str, y: str) -> str:
    vlc = pytest.importorskip("vl_convert")
    text = (REPO / template).read_text()
    for anchor, value in {"X": x, "Y": y, "TITLE": "t", "X_LABEL": "xl", "Y_LABEL": "yl"}.items():
        text = text.replace(f'"<DVC_METRIC_{anchor}>"', json.dumps(value))
    spec = json.loads(text.replace('"<DVC_METRIC_DATA>"', json.dumps(rows)))
    return vlc.vegalite_to_svg(spec)


def _labels(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def test_fine_tuning_curves_are_labelled_control_and_t_cnn_with_integer_epochs() -> None:
    # DVC's rows for two files of one field: strings, the files' common prefix dropped
    rows = [{"finetune_epoch": str(e), "val_acc": str(0.3 + e / 100), "rev": "workspace", "filename": f}
            for f in ("finetune/history.csv", "control/history.csv") for e in (0, 1)]  # fmt: skip
    labels = _labels(_svg("infra/dvc/plots/curves.json", rows, "finetune_epoch", "val_acc"))
    assert {"control", "T-CNN"} <= {label.split()[0] for label in labels}, labels
    assert not [label for label in labels if "history.csv" in label], labels
    numbers = [label for label in labels if re.fullmatch(r"-?\d+(\.\d+)?", label)]
    assert numbers.count("0") == numbers.count("1") == 1 and "0.5" not in numbers, labels  # no tick between


def test_pretraining_curves_say_train_and_validation() -> None:
    rows = [{"epoch": str(e), "dvc_inferred_y_value": str(v), "rev": "workspace", "field": f}
            for f, v in (("train_acc", 0.2), ("val_acc", 0.3)) for e in (1, 2, 3)]  # fmt: skip
    labels = _labels(_svg("infra/dvc/plots/curves.json", rows, "epoch", "dvc_inferred_y_value"))
    assert {"CNN train", "CNN validation"} <= set(labels), labels
    assert not [label for label in labels if re.fullmatch(r"\d+\.5", label)], labels


def test_every_plot_has_a_title_and_labelled_axes_and_accuracies_say_fraction() -> None:
    plots = yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]
    for entry in plots:
        ((name, spec),) = entry.items()
        assert spec.get("title") and spec.get("y_label"), name
        assert (REPO / spec["template"]).is_file(), name
        if "acc" in name or "robustness" in name:
            assert spec["y_label"].endswith("(fraction)"), name
