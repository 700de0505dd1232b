"""Robustness metrics (CE, mCE, relative mCE, per category / severity, extras, exclusions), the AlexNet
baseline, evaluate_model against a direct numpy computation, and the Fig. 3 numbers and plots."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from core.robustness import corruptions as C
from core.robustness.baseline import Baseline
from core.robustness.eval_table import TABLE_SCHEMA, table_from_errors
from core.robustness.evaluation import count_correct, evaluate_model
from core.robustness.metrics import flat_metrics, summarize
from core.robustness.paired_bootstrap import comparisons
from core.viz.plots import contact_sheet, plot_gains

# a copy of ../shared/reference/alexnet_imagenet_c_errors.json, kept in the repo so the check runs everywhere
REFERENCE = Path(__file__).parent / "reference" / "alexnet_imagenet_c_errors.json"

BASE = [0.5, 0.6, 0.7, 0.8, 0.9]  # baseline error at severities 1..5, every corruption; clean 0.4
HALF = [e / 2 for e in BASE]  # the model halves the baseline's errors ...
GAUSS = [0.1, 0.2, 0.3, 0.4, 0.5]  # ... except on gaussian_noise; model clean error 0.05


def _tables() -> tuple[pa.Table, Baseline]:
    errors = {c: (GAUSS if c == "gaussian_noise" else HALF) for c in C.CORRUPTIONS}
    model = table_from_errors("f", 0.05, errors)
    base = Baseline("base", 0.4, {c: dict(enumerate(BASE, start=1)) for c in C.CORRUPTIONS})
    return model, base


def test_ce_mce_and_relative_mce_equal_hand_computed_values():
    table, base = _tables()
    s = summarize(table, base)
    # gaussian_noise: CE = 1.5 / 3.5 = 3/7; rCE = (1.5 - 5 x 0.05) / (3.5 - 5 x 0.4) = 1.25 / 1.5 = 5/6
    # the other 14: CE = 1.75 / 3.5 = 1/2; rCE = (1.75 - 0.25) / 1.5 = 1
    assert s["per_corruption"]["gaussian_noise"]["ce"] == pytest.approx(3 / 7)
    assert s["per_corruption"]["gaussian_noise"]["relative_ce"] == pytest.approx(5 / 6)
    assert s["per_corruption"]["fog"]["ce"] == pytest.approx(0.5)
    assert s["per_corruption"]["fog"]["relative_ce"] == pytest.approx(1.0)
    assert s["mce"] == pytest.approx(float((Fraction(3, 7) + 14 * Fraction(1, 2)) / 15))
    assert s["relative_mce"] == pytest.approx(float((Fraction(5, 6) + 14) / 15))
    # categories: noise = mean(3/7, 1/2, 1/2); blur = 1/2
    assert s["per_category"]["noise"]["mce"] == pytest.approx((3 / 7 + 1) / 3)
    assert s["per_category"]["blur"]["mce"] == pytest.approx(0.5)
    # severity 1: mean over the 15 of E(f,1,c)/E(base,1,c) = (0.1/0.5 + 14 x 0.5) / 15
    assert s["per_severity"]["1"]["mce"] == pytest.approx((0.2 + 14 * 0.5) / 15)
    assert s["per_severity"]["5"]["accuracy"] == pytest.approx(1 - (0.5 + 14 * 0.45) / 15)
    # unnormalised mean corruption accuracy over the 15 x 5 cells: mean error (0.3 + 14 x 0.35) / 15
    assert s["mca"] == pytest.approx(1 - (0.3 + 14 * 0.35) / 15)
    assert s["clean_accuracy"] == pytest.approx(0.95)
    # the 4 extras are separate: CE 1/2 each, not inside mCE
    assert s["extra"]["mce"] == pytest.approx(0.5) and s["extra"]["accuracy"] == pytest.approx(0.65)
    assert s["corruptions"] == list(C.BENCHMARK_CORRUPTIONS) and s["complete"]


def test_mce_is_a_mean_of_ratios_not_a_ratio_of_means():
    errors = {"gaussian_noise": [0.2] * 5, "fog": [0.6] * 5}
    base = Baseline(
        "b", 0.1, {"gaussian_noise": dict.fromkeys(range(1, 6), 0.4), "fog": dict.fromkeys(range(1, 6), 0.6)}
    )
    s = summarize(table_from_errors("m", 0.1, errors), base)
    assert s["mce"] == pytest.approx((0.5 + 1.0) / 2)  # a ratio of sums would give 0.8 / 1.0
    assert not s["complete"]


def test_not_meaningful_sets_are_excluded_everywhere():
    table, base = _tables()
    rows = table.to_pylist()
    for r in rows:
        if r["corruption"] == "saturate":
            r["meaningful"] = False
            r["error"], r["accuracy"] = 0.0, 1.0  # would change the extras if counted
    s = summarize(pa.Table.from_pylist(rows, schema=TABLE_SCHEMA), base)
    assert s["excluded"] == ["saturate"] and "saturate" not in s["per_corruption"]
    assert s["extra"]["corruptions"] == ["speckle_noise", "gaussian_blur", "spatter"]
    assert s["extra"]["accuracy"] == pytest.approx(0.65)


def test_without_baseline_only_accuracies_and_missing_severities_give_no_ce():
    table, base = _tables()
    s = summarize(table, None)
    assert s["mce"] is None and s["per_corruption"]["fog"]["ce"] is None and s["mca"] is not None
    partial = Baseline("p", 0.4, {c: {1: 0.5} for c in C.CORRUPTIONS})  # severity 1 only
    s = summarize(table, partial)
    assert s["per_corruption"]["fog"]["ce"] is None and s["mce"] is None
    # a baseline that does not degrade gives an undefined relative CE, not a division by zero
    flat = Baseline("flat", 0.9, {c: dict(enumerate(BASE, start=1)) for c in C.CORRUPTIONS})
    assert summarize(table, flat)["per_corruption"]["fog"]["relative_ce"] is None


def test_alexnet_baseline_matches_the_reference_file():
    alex = Baseline.alexnet()
    assert set(alex.errors) == set(C.BENCHMARK_CORRUPTIONS) and alex.clean_error == pytest.approx(0.4348)
    ref = json.loads(REFERENCE.read_text())
    for c, values in ref["per_severity"].items():
        assert [alex.errors[c][s] for s in range(1, 6)] == values
        assert np.mean(values) == pytest.approx(ref["mean"][c], abs=1e-6)  # the usual CE normalisers
    # a model with AlexNet's errors has CE 1 everywhere
    same = table_from_errors("a", 0.4348, {c: ref["per_severity"][c] for c in C.BENCHMARK_CORRUPTIONS})
    s = summarize(same, "alexnet")
    assert s["mce"] == pytest.approx(1.0) and s["relative_mce"] == pytest.approx(1.0)


def test_frozen_baseline_roundtrip(tmp_path):
    table, _ = _tables()
    base = Baseline.from_table(table, name="cnn")
    path = base.save(tmp_path / "baseline.json")
    again = Baseline.load(path)
    assert again.clean_error == pytest.approx(0.05) and again.errors["fog"][3] == pytest.approx(HALF[2])
    assert summarize(table, path)["mce"] == pytest.approx(1.0)
    with pytest.raises(FileNotFoundError, match="baseline file not found"):
        Baseline.load(tmp_path / "missing.json")


def test_flat_metrics_are_numbers_only():
    table, base = _tables()
    flat = flat_metrics(summarize(table, base))
    assert flat["mce"] == pytest.approx(summarize(table, base)["mce"]) and "ce_fog" in flat
    assert "mca_noise" in flat and "mce_sev3" in flat
    assert all(isinstance(v, float) for v in flat.values())
    assert "mce" not in flat_metrics(summarize(table, None))


# ---------------------------------------------------------------------------------------------- evaluation


class Linear(nn.Module):
    def __init__(self, w: np.ndarray, b: np.ndarray) -> None:
        super().__init__()
        self.fc = nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            self.fc.weight.copy_(torch.from_numpy(w))
            self.fc.bias.copy_(torch.from_numpy(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def _predict(w, b, images, mean, std):
    x = (images.astype(np.float64) / 255.0 - mean) / std
    return (x.reshape(len(x), -1) @ w.T.astype(np.float64) + b).argmax(1)


def test_evaluate_model_matches_a_direct_computation(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 12, 12, 1), dtype=np.uint8)
    labels = rng.integers(0, 3, 40)
    w = rng.normal(size=(3, 144)).astype(np.float32)
    b = rng.normal(size=3).astype(np.float32)
    mean, std = 0.3, 0.2
    for c, meaningful in (("fog", True), ("saturate", False)):
        for s in (1, 3):
            x = C.corrupt_batch(images, c, s)
            meta = C.set_meta(c, s, seed=0, band="cifar", image_shape=x.shape[1:], n=40, source="t")
            assert meta["meaningful"] is meaningful
            C.write_set(C.set_path(tmp_path, c, s), x, labels, np.arange(40), meta)
    table = evaluate_model(
        Linear(w, b), (images, labels), tmp_path, ["fog", "saturate"], [1, 3],
        mean=[mean], std=[std], batch_size=7, model_name="lin",
    )  # fmt: skip
    assert table.schema == TABLE_SCHEMA and table.num_rows == 5
    rows = {(r["corruption"], r["severity"]): r for r in table.to_pylist()}
    exp_clean = (_predict(w, b, images, mean, std) == labels).mean()
    assert rows[("clean", 0)]["accuracy"] == pytest.approx(exp_clean) and rows[("clean", 0)]["n"] == 40
    for s in (1, 3):
        x = C.read_set(C.set_path(tmp_path, "fog", s)).images
        assert rows[("fog", s)]["accuracy"] == pytest.approx((_predict(w, b, x, mean, std) == labels).mean())
        assert rows[("fog", s)]["correct"] == round(rows[("fog", s)]["accuracy"] * 40)
    assert rows[("saturate", 1)]["meaningful"] is False and rows[("fog", 1)]["category"] == "weather"
    with pytest.raises(FileNotFoundError, match="corrupted set not found"):
        evaluate_model(Linear(w, b), (images, labels), tmp_path, ["snow"], [1], mean=[mean], std=[std])


def test_class_subset_predicts_the_best_class_of_the_subset():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (30, 4, 4, 3), dtype=np.uint8)
    w = rng.normal(size=(10, 48)).astype(np.float32)
    b = np.zeros(10, np.float32)
    subset = np.array([2, 5, 7])
    x = (images / 255.0 - 0.5) / 0.25
    logits = x.transpose(0, 3, 1, 2).reshape(30, -1) @ w.T.astype(np.float64)  # the model sees NCHW
    pred = subset[logits[:, subset].argmax(1)]
    labels = np.where(rng.random(30) < 0.5, pred, 5)
    correct, n = count_correct(
        Linear(w, b), [(images, labels)], mean=[0.5] * 3, std=[0.25] * 3, class_subset=subset
    )
    assert n == 30 and correct == int((pred == labels).sum())
    full, _ = count_correct(Linear(w, b), [(images, labels)], mean=[0.5] * 3, std=[0.25] * 3)
    assert full == int((logits.argmax(1) == labels).sum())


# ---------------------------------------------------------------------------------------------- plots


def _two_models() -> pa.Table:
    a = {c: [0.5] * 5 for c in C.BENCHMARK_CORRUPTIONS}
    b = {
        c: ([0.25] * 5 if c in C.CATEGORIES["blur"] else [0.5, 0.5, 0.5, 0.5, 0.0])
        for c in C.BENCHMARK_CORRUPTIONS
    }
    return pa.concat_tables([table_from_errors("cnn", 0.1, a), table_from_errors("tcnn", 0.1, b)])


def test_relative_improvement_per_category_and_severity(tmp_path):
    """[TCNN21] Fig. 3's relative gain acc_B / acc_A - 1 per category and severity (the ``gain_<group>`` entries of
    the comparisons), against hand-computed values, and its plot."""
    table = _two_models()
    base = Baseline.from_table(table, model="cnn")
    points = {m: flat_metrics(summarize(table, base, model=m)) for m in ("cnn", "tcnn")}
    samples = {m: {k: np.full(5, v) for k, v in p.items()} for m, p in points.items()}  # no spread
    g = comparisons(points, samples, [("cnn", "tcnn")])["tcnn-cnn"]
    # blur: accuracy 0.75 vs 0.5 -> +50%; noise: severities 1-4 at 0.5, 5 at 1.0 -> mean 0.6 -> +20%
    assert g["gain_blur"]["diff"] == pytest.approx(0.5) and g["gain_noise"]["diff"] == pytest.approx(0.2)
    assert [k for k in g if k.startswith("gain_") and "sev" not in k] == [
        "gain_noise", "gain_blur", "gain_weather", "gain_digital",
    ]  # fmt: skip
    # severity 5: 4 blurs at 0.75, 11 others at 1.0 -> mean (3 + 11) / 15 vs 0.5
    assert g["gain_sev5"]["diff"] == pytest.approx((3 + 11) / 15 / 0.5 - 1)
    assert g["gain_sev1"]["diff"] == pytest.approx((4 * 0.75 + 11 * 0.5) / 15 / 0.5 - 1)
    assert g["gain_blur"]["low"] == pytest.approx(0.5) and g["gain_blur"]["excludes_zero"]
    plot_gains({"tcnn-cnn": g}, ["tcnn-cnn"], tmp_path / "fig3.png")
    assert (tmp_path / "fig3.png").read_bytes()[:4] == b"\x89PNG"


def test_contact_sheet_is_written(tmp_path):
    from PIL import Image

    x = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    sets = {(c, s): C.corrupt_batch(x, c, s) for c in ("fog", "contrast") for s in (1, 5)}
    path = contact_sheet(x, sets, tmp_path / "sheet.png", title="t")
    with Image.open(path) as im:
        assert im.size[0] > 2 * 3 * 84 and im.size[1] > 2 * 84
    assert [p.name for p in tmp_path.iterdir()] == ["sheet.png"]


def test_a_baseline_without_errors_on_a_corruption_leaves_its_ce_undefined() -> None:
    """Found on CUDA (scripts/gpu_check.sh): a baseline that is right on every image of a corruption made CE a
    division by zero. CE of that corruption is then undefined (None), like the per-severity mCE, and the mCE,
    which averages every benchmark corruption's CE, is None too; the other corruptions keep theirs."""
    bench = list(C.BENCHMARK_CORRUPTIONS)
    base_errors = {c: [0.1, 0.2, 0.3, 0.4, 0.5] for c in bench}
    base_errors[bench[0]] = [0.0] * 5
    base = table_from_errors("cnn", 0.05, base_errors)
    model = table_from_errors("tcnn", 0.04, {c: [0.2] * 5 for c in bench})
    s = summarize(model, Baseline.from_table(base, model="cnn", name="cnn"), model="tcnn")
    assert s["per_corruption"][bench[0]]["ce"] is None
    assert s["per_corruption"][bench[1]]["ce"] == pytest.approx(1.0 / 1.5)  # 5 x 0.2 / (0.1 + ... + 0.5)
    assert s["mce"] is None and s["mca"] == pytest.approx(0.8)
    assert "mce" not in flat_metrics(s) and "ce_" + bench[1] in flat_metrics(s)
