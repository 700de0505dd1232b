"""Intervals: the paired bootstrap over test images against a direct numpy reference, its determinism and
shrinking with n; the t-interval over seeds against scipy; the epoch plan at fractions that do not divide."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from core.config import Params, plan_epochs, scaled_epochs
from core.robustness.baseline import Baseline
from core.robustness.eval_table import TABLE_SCHEMA, per_image_table, table_row
from core.robustness.intervals import difference, percentile_interval, resample_counts, t_interval
from core.robustness.metrics import flat_metrics, summarize
from core.robustness.paired_bootstrap import _cells, bootstrap_metrics, comparisons

B = 300


def _table(n: int, subset: np.ndarray, p: dict[str, tuple[float, float]], seed: int = 1):
    """A hand-made evaluation: clean on test images 0..n-1, one corrupted set (gaussian_noise, severity 1) on
    `subset`; model m is right with probability p[m] = (clean, corrupted)."""
    rng = np.random.default_rng(seed)
    tables, per_image, truth = [], [], {}
    for model, (pc, pn) in p.items():
        clean, noisy = rng.random(n) < pc, rng.random(len(subset)) < pn
        truth[model] = (clean, noisy)
        parts = [("clean", 0, np.arange(n), clean), ("gaussian_noise", 1, subset, noisy)]
        per_image.append(per_image_table(model, parts))
        rows = [table_row(model, c, s, int(k.sum()), len(k), True) for c, s, _, k in parts]
        tables.append(pa.Table.from_pylist(rows, schema=TABLE_SCHEMA))
    return pa.concat_tables(tables), pa.concat_tables(per_image), truth


def _numpy_reference(truth, subset, n, seed, replicates=B):
    """The bootstrap written out directly: draw n test images with replacement, recompute each accuracy."""
    rng = np.random.default_rng(seed)
    out = {"clean": [], "noise": []}
    for _ in range(replicates):
        idx = rng.integers(0, n, size=n)
        counts = np.bincount(idx, minlength=n)
        w = counts[subset]
        (ca, na), (cb, nb) = truth["a"], truth["b"]
        out["clean"].append(cb[idx].mean() - ca[idx].mean())
        out["noise"].append((w * nb).sum() / w.sum() - (w * na).sum() / w.sum())
    return {k: np.percentile(v, [2.5, 97.5]) for k, v in out.items()}


def _compare(table, per_image, seed, replicates=B):
    base = Baseline.from_table(table, model="a", name="a")
    points = {m: flat_metrics(summarize(table, base, model=m)) for m in ("a", "b")}
    samples = bootstrap_metrics(table, per_image, "a", replicates=replicates, seed=seed)
    return comparisons(points, samples, [("a", "b")])["b-a"], points


def test_paired_bootstrap_equals_a_direct_numpy_reference() -> None:
    n, subset = 200, np.arange(0, 200, 4)
    table, per_image, truth = _table(n, subset, {"a": (0.8, 0.6), "b": (0.85, 0.62)})
    got, points = _compare(table, per_image, seed=7)
    ref = _numpy_reference(truth, subset, n, seed=7)
    assert (got["clean_accuracy"]["low"], got["clean_accuracy"]["high"]) == pytest.approx(
        tuple(ref["clean"]), abs=1e-12
    )
    assert (got["mca"]["low"], got["mca"]["high"]) == pytest.approx(tuple(ref["noise"]), abs=1e-12)
    assert got["clean_accuracy"]["diff"] == pytest.approx(truth["b"][0].mean() - truth["a"][0].mean())
    # The baseline's own mCE is 1 in every replicate; b's mCE difference has an interval around its point.
    assert points["a"]["mce"] == 1.0 and got["mce"]["low"] <= got["mce"]["diff"] <= got["mce"]["high"]


def test_bootstrap_is_deterministic_per_seed_and_narrows_with_n() -> None:
    n, subset = 200, np.arange(0, 200, 2)
    table, per_image, _ = _table(n, subset, {"a": (0.8, 0.6), "b": (0.85, 0.62)})
    one, _ = _compare(table, per_image, seed=3)
    assert _compare(table, per_image, seed=3)[0] == one
    assert _compare(table, per_image, seed=4)[0]["clean_accuracy"] != one["clean_accuracy"]
    big = np.arange(2000)
    table_l, per_image_l, _ = _table(2000, big[::2], {"a": (0.8, 0.6), "b": (0.85, 0.62)})
    wide, _ = _compare(table_l, per_image_l, seed=3)

    def width(d):
        return d["high"] - d["low"]

    assert width(wide["clean_accuracy"]) < 0.5 * width(one["clean_accuracy"])  # ~ 1/sqrt(10)
    assert width(wide["mca"]) < 0.5 * width(one["mca"])


def test_at_unit_weights_the_bootstrap_statistic_is_the_point_summary() -> None:
    table, per_image, _ = _table(100, np.arange(0, 100, 5), {"a": (0.7, 0.5), "b": (0.9, 0.4)})
    cells, n = _cells(per_image)
    meaningful = {(r["corruption"], int(r["severity"])): r["meaningful"] for r in table.to_pylist()}
    rows = {m: c.rows(m, np.ones(n, np.int32), meaningful) for m, c in cells.items()}
    base = Baseline.from_table(rows["a"], model="a", name="a")
    point = Baseline.from_table(table, model="a", name="a")
    for m in ("a", "b"):
        got = flat_metrics(summarize(rows[m], base, model=m))
        want = flat_metrics(summarize(table, point, model=m))
        assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], abs=1e-12) for k in got)


def test_resample_scheme_and_percentiles() -> None:
    counts = np.concatenate(list(resample_counts(10, 5, seed=1, chunk=2)))
    rng = np.random.default_rng(1)
    for row in counts:
        assert (row == np.bincount(rng.integers(0, 10, size=10), minlength=10)).all()
    assert percentile_interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    assert percentile_interval(np.array([np.nan, np.nan])) != percentile_interval(np.array([1.0]))
    d = difference(0.5, 0.6, np.array([0.5, 0.5]), np.array([0.55, 0.7]))
    assert d["diff"] == pytest.approx(0.1) and d["excludes_zero"]
    g = difference(0.5, 0.6, np.array([0.5]), np.array([0.6]), ratio=True)
    assert g["diff"] == pytest.approx(0.2)


def test_t_interval_equals_scipy() -> None:
    values = [0.912, 0.917, 0.905, 0.921]
    got = t_interval(values)
    lo, hi = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert got["mean"] == pytest.approx(np.mean(values)) and got["n"] == 4
    assert (got["low"], got["high"]) == pytest.approx((lo, hi), abs=1e-12)
    assert t_interval([0.5])["low"] is None and t_interval([])["mean"] is None
    same = t_interval([0.25, 0.25, 0.25])  # no spread: the interval is the point (scipy returns nan here)
    assert (same["low"], same["high"]) == (0.25, 0.25)


def test_seed_rows_aggregate_each_configuration_over_seeds() -> None:
    from pipelines.sweep.summary import seed_rows, with_seed_columns

    spec = {"grid": {"reparam.stride_mode": ["exact", "s1"], "seed": [0, 1, 2]}}
    rows = []
    for mode, offset in (("exact", 0.0), ("s1", 0.01)):
        for seed, v in zip((0, 1, 2), (0.90, 0.93, 0.91)):
            rows.append({"trial": f"{mode}{seed}", "reparam.stride_mode": mode, "seed": seed, "status": "finished",
                         "tcnn_clean_accuracy": v + offset, "tcnn_minus_control_mca": v - 0.9,
                         "tcnn_minus_control_mca_ci_low": v - 0.95})  # its own bootstrap interval  # fmt: skip
    out = seed_rows(spec, rows)
    assert [r["config"] for r in out] == ["stride_mode=exact", "stride_mode=s1"]
    for r, offset in zip(out, (0.0, 0.01)):
        vals = np.array([0.90, 0.93, 0.91]) + offset
        lo, hi = stats.t.interval(0.95, 2, loc=vals.mean(), scale=stats.sem(vals))
        assert r["n_seeds"] == 3 and r["tcnn_clean_accuracy_seeds_mean"] == pytest.approx(vals.mean())
        assert (
            r["tcnn_clean_accuracy_seeds_ci_low"],
            r["tcnn_clean_accuracy_seeds_ci_high"],
        ) == pytest.approx((lo, hi))
        assert r["control_mca_seeds_mean"] is None  # not in the rows: no number made up
    wide = with_seed_columns(rows, out, spec)
    assert len(wide) == 6 and wide[4]["tcnn_clean_accuracy_seeds_mean"] == pytest.approx(
        out[1]["tcnn_clean_accuracy_seeds_mean"]
    )
    # Each trial keeps its own bootstrap interval next to the seed aggregate (they once shared a name).
    assert [w["tcnn_minus_control_mca_ci_low"] for w in wide] == [
        r["tcnn_minus_control_mca_ci_low"] for r in rows
    ]
    assert seed_rows({"grid": {"reparam.stride_mode": ["exact"]}}, rows) == []


@pytest.mark.parametrize(
    ("f", "epochs", "want"), [(0.3, 3, 10), (0.7, 3, 4), (0.5, 3, 6), (1.0, 3, 3), (0.01, 1, 100)]
)
def test_epoch_plan_rounds_at_fractions_that_do_not_divide(f, epochs, want) -> None:
    assert scaled_epochs(epochs, f) == want
    p = Params().with_overrides(
        {
            "data.sample_fraction": f,
            "pretrain.epochs": epochs,
            "reparam.epoch": epochs,
            "finetune.epochs": epochs,
        }
    )
    planned = plan_epochs(p)
    assert (
        planned.pretrain.epochs == want and planned.finetune.epochs == want and planned.reparam.epoch == want
    )
    assert plan_epochs(planned) == planned  # planning twice changes nothing
    off = p.with_overrides({"data.fraction_scales_epochs": False})
    assert plan_epochs(off).pretrain.epochs == epochs


def test_interval_values_are_plain_floats() -> None:
    """Python floats, so tables (pyarrow) and JSON store numbers, not numpy scalars or their text."""
    ci = t_interval([0.1, 0.2, 0.4])
    assert all(type(ci[k]) is float for k in ("mean", "low", "high", "std"))
    d = difference(0.5, 0.6, np.array([0.5, 0.52]), np.array([0.55, 0.7]))
    assert all(type(d[k]) is float for k in ("diff", "low", "high"))
