"""The headline comparison as computed and as shown, in seconds (the quick run guards it):

- one CE normaliser for every model (the pretrained CNN), not each model's own;
- T-CNN minus control, not the reverse;
- the control fine-tuned with the T-CNN's own lr, schedule and data order;
- the paired bootstrap redraws the CE baseline with every replicate;
- the sentence next to a worse mCE says worse;
- ``_ci_low`` / ``_ci_high`` land on the MLflow parent and in the sweep summary as the low and high ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from core.config import validate_params
from core.robustness.eval_table import PER_IMAGE_SCHEMA, TABLE_SCHEMA
from core.robustness.suite import BENCHMARK_CORRUPTIONS

ACC = {
    "cnn": 0.80,
    "control": 0.84,
    "tcnn": 0.88,
}  # clean accuracy; corrupted sets lose a model-specific share
DROP = {"cnn": 0.30, "control": 0.25, "tcnn": 0.15}


def _tables(n: int = 300, seed: int = 0) -> tuple[pa.Table, pa.Table]:
    """An evaluate-shaped (counts, per-image) pair: three models, clean + every benchmark corruption at
    severities 1 and 3, correctness drawn per image."""
    rng = np.random.default_rng(seed)
    rows, parts = [], []
    for model in ACC:
        sets = [("clean", 0, ACC[model])] + [
            (c, s, ACC[model] - DROP[model] * s / 3 - 0.01 * i) for i, c in enumerate(BENCHMARK_CORRUPTIONS) for s in (1, 3)
        ]  # fmt: skip
        for corr, sev, p in sets:
            ok = rng.random(n) < p
            rows.append({"model": model, "corruption": corr, "category": "x", "severity": sev, "n": n,
                         "correct": int(ok.sum()), "accuracy": ok.mean(), "error": 1 - ok.mean(), "meaningful": True})  # fmt: skip
            parts.append(pa.table({"model": [model] * n, "corruption": [corr] * n, "severity": [sev] * n,
                                   "index": np.arange(n, dtype=np.int32), "correct": ok}))  # fmt: skip
    return pa.Table.from_pylist(rows, schema=TABLE_SCHEMA), pa.concat_tables(parts).cast(PER_IMAGE_SCHEMA)


def _score() -> tuple[dict, pa.Table]:
    from stages.robustness_scores import score

    table, per_image = _tables()
    params = validate_params({"robustness": {"bootstrap": 60, "baseline": "cnn"}})
    return score(params, table, per_image, ["cnn", "control", "tcnn"]), table


def _errors(table: pa.Table, model: str) -> dict[tuple[str, int], float]:
    return {(r["corruption"], r["severity"]): r["error"] for r in table.to_pylist() if r["model"] == model}


def test_one_ce_normaliser_for_every_model_the_pretrained_cnn() -> None:
    """mCE of each model = mean over corruptions of sum_s E_model / sum_s E_cnn (Hendrycks & Dietterich 2019),
    computed here by hand: with each model's own normaliser every mCE would be 1."""
    out, table = _score()
    base = _errors(table, "cnn")
    for model in ("cnn", "control", "tcnn"):
        e = _errors(table, model)
        ces = [(e[(c, 1)] + e[(c, 3)]) / (base[(c, 1)] + base[(c, 3)]) for c in BENCHMARK_CORRUPTIONS]
        assert out["points"][model]["mce"] == pytest.approx(np.mean(ces), rel=1e-12)
    assert out["points"]["cnn"]["mce"] == pytest.approx(1.0)
    assert out["points"]["tcnn"]["mce"] < 0.95  # the T-CNN here loses less than the CNN


def test_differences_are_tcnn_minus_control() -> None:
    out, table = _score()
    clean = {m: 1 - _errors(table, m)[("clean", 0)] for m in ACC}
    d = out["comparisons"]["tcnn-control"]["clean_accuracy"]
    assert d["diff"] == pytest.approx(clean["tcnn"] - clean["control"])
    m = out["comparisons"]["tcnn-control"]["mce"]
    assert m["diff"] == pytest.approx(out["points"]["tcnn"]["mce"] - out["points"]["control"]["mce"])
    assert m["low"] <= m["diff"] <= m["high"]


def test_the_bootstrap_redraws_the_ce_baseline_with_every_replicate() -> None:
    """With the pretrained CNN as normaliser, every replicate recomputes the CNN's errors on the same draw:
    the CNN's mCE is exactly 1 in each replicate, so T-CNN - CNN's mCE interval is the T-CNN's own mCE
    interval shifted by 1 (a fixed baseline would make the CNN's mCE vary)."""
    out, _ = _score()
    cnn = out["samples"]["cnn"]["mce"]
    assert np.allclose(cnn, 1.0)
    tc = out["comparisons"]["tcnn-cnn"]["mce"]
    lo, hi = np.percentile(out["samples"]["tcnn"]["mce"] - 1.0, [2.5, 97.5])
    assert (tc["low"], tc["high"]) == pytest.approx((lo, hi))


def test_the_report_sentence_for_a_worse_mce_says_worse() -> None:
    from core.viz.report_html import verdict

    worse = {"diff": 0.03, "low": 0.01, "high": 0.05, "excludes_zero": True}
    assert "the T-CNN is worse" in verdict("mCE (T-CNN − control)", worse, higher_is_better=False)
    assert "the T-CNN is better" in verdict("mCA (T-CNN − control)", worse, higher_is_better=True)
    better = {"diff": -0.03, "low": -0.05, "high": -0.01, "excludes_zero": True}
    assert "the T-CNN is better" in verdict("mCE (T-CNN − control)", better, higher_is_better=False)
    unsure = {"diff": 0.01, "low": -0.01, "high": 0.03, "excludes_zero": False}
    assert "cannot tell" in verdict("mCE", unsure, higher_is_better=False)


def _results(root: Path) -> dict:
    comps = {"tcnn-control": {"mca": {"diff": 0.02, "low": 0.005, "high": 0.031, "excludes_zero": True},
                              "clean_accuracy": {"diff": -0.004, "low": -0.011, "high": 0.002, "excludes_zero": False}}}  # fmt: skip
    (root / "results").mkdir(parents=True)
    (root / "results" / "metrics.json").write_text(json.dumps({"comparisons": comps}))
    return comps


def test_interval_ends_reach_the_mlflow_parent_as_low_and_high(tmp_path: Path) -> None:
    from stages.harness.runner import _log_outputs
    from stages.tracking.tracker import Tracker

    comps = _results(tmp_path)
    tracker = Tracker(uri=f"sqlite:///{tmp_path / 'm.db'}", experiment="t")
    tracker.start_parent("p")
    tracker.start_child("report")
    parent = tracker.parent_run_id
    _log_outputs(tracker, validate_params({}), "report", {}, tmp_path)
    logged = tracker.client.get_run(parent).data.metrics
    for key in ("mca", "clean_accuracy"):
        d = comps["tcnn-control"][key]
        assert logged[f"tcnn_minus_control_{key}"] == pytest.approx(d["diff"])
        assert logged[f"tcnn_minus_control_{key}_ci_low"] == pytest.approx(d["low"])
        assert logged[f"tcnn_minus_control_{key}_ci_high"] == pytest.approx(d["high"])


def test_the_parent_description_and_the_saved_view_show_the_headline(tmp_path: Path) -> None:
    """The parent's description (MLflow's ``mlflow.note.content``, Markdown) carries T-CNN - control with its
    interval and the report's sentence; the experiment's saved view ticks the parent's interval-end columns."""
    from stages.harness.catalogue import SUMMARY_METRICS
    from stages.harness.runner import _log_outputs
    from stages.tracking.tracker import Tracker
    from stages.tracking.view import VIEW_METRICS

    _results(tmp_path)
    tracker = Tracker(uri=f"sqlite:///{tmp_path / 'm.db'}", experiment="t")
    tracker.start_parent("p")
    tracker.start_child("report")
    _log_outputs(tracker, validate_params({}), "report", {}, tmp_path)
    run = tracker.client.get_run(tracker.parent_run_id)
    note = run.data.tags["mlflow.note.content"]
    # mCA +2.00 pp [+0.50, +3.10]: excludes 0, higher is better; clean -0.40 [-1.10, +0.20]: includes 0
    assert (
        "| **T-CNN − control** (pp, 95% interval) | -0.40 [-1.10, +0.20] | +2.00 [+0.50, +3.10] | n/a |"
        in note
    )
    assert note.splitlines()[2] == ("**T-CNN − control** (pp, paired bootstrap 95% interval over test images): "
                                    "clean -0.40 [-1.10, +0.20] · mCA +2.00 [+0.50, +3.10] · mCE n/a")  # fmt: skip
    assert "- mCA: +2.00 pp, 95% interval [+0.50, +3.10] pp. The interval excludes 0" in note
    assert (
        "the T-CNN is better than the control" in note
        and "cannot tell the T-CNN and the control apart" in note
    )
    exp = tracker.client.get_experiment(run.info.experiment_id)
    view = json.loads(exp.tags["mlflow.sharedViewState.tcnn-headline"])
    cols = [c for c in view["selectedColumns"] if c.startswith("metrics.")]
    assert cols == [f"metrics.`{m}`" for m in VIEW_METRICS]
    assert cols[:3] == [f"metrics.`tcnn-control clean {e}`" for e in ("pp", "pp low", "pp high")]
    # issue 59 (12): the view's columns are the headline's numbers in its units (pp here, as `dvc metrics show`
    # prints them: 100 x the fractions above), next to the fractions of SUMMARY_METRICS
    logged = run.data.metrics
    assert {k: logged[k] for k in logged if k.startswith("tcnn-control")} == pytest.approx({
        "tcnn-control clean pp": -0.40, "tcnn-control clean pp low": -1.10, "tcnn-control clean pp high": 0.20,
        "tcnn-control mCA pp": 2.00, "tcnn-control mCA pp low": 0.50, "tcnn-control mCA pp high": 3.10,
    })  # fmt: skip
    assert (
        logged["tcnn_minus_control_mca"] == pytest.approx(0.02)
        and set(SUMMARY_METRICS) & set(VIEW_METRICS) == set()
    )
    # issue 59 (15): param columns after the headline's (which stay on screen), each a name the tracking logs
    from stages.tracking.names import flatten_params
    from stages.tracking.view import VIEW_PARAMS

    params = [c for c in view["selectedColumns"] if c.startswith("params.")]
    assert params == [f"params.`{p}`" for p in VIEW_PARAMS] == view["selectedColumns"][-len(VIEW_PARAMS) :]
    assert VIEW_PARAMS and set(VIEW_PARAMS) <= set(flatten_params(validate_params({})))


def test_the_dvc_headline_rows_are_the_scored_numbers() -> None:
    """results/headline/ (what `dvc metrics show` prints): each model's clean accuracy and mCA in % and T-CNN -
    control with its interval in pp, from the scores themselves; with the control off, T-CNN - CNN."""
    from core.robustness.headline import headline_rows

    out, _ = _score()
    metrics = {**out["points"], "comparisons": out["comparisons"]}
    rows = headline_rows(metrics)
    assert list(rows) == ["cnn", "control", "tcnn", "tcnn-control"]
    for m in ("cnn", "control", "tcnn"):
        assert rows[m] == {"clean": round(100 * out["points"][m]["clean_accuracy"], 2),
                           "mCA": round(100 * out["points"][m]["mca"], 2)}  # fmt: skip
    d = out["comparisons"]["tcnn-control"]["mca"]
    assert d["diff"] > 0  # the T-CNN loses less under corruption (DROP)
    assert (
        rows["tcnn-control"]["tcnn-control mCA"]
        == f"+{100 * d['diff']:.2f} [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"
    )
    # beside each string, its three numbers (pp, as the string rounds them): what `dvc metrics diff` subtracts
    for col, key in (("clean", "clean_accuracy"), ("mCA", "mca"), ("mCE", "mce")):
        e = out["comparisons"]["tcnn-control"][key]
        got = [rows["tcnn-control"][f"tcnn-control {col} pp{end}"] for end in ("", " low", " high")]
        assert got == [round(100 * e[k], 2) for k in ("diff", "low", "high")], (col, got)
        assert rows["tcnn-control"][f"tcnn-control {col}"] == "{:+.2f} [{:+.2f}, {:+.2f}]".format(*got)
    without = {k: v for k, v in metrics.items() if k != "control"}
    without["comparisons"] = {k: v for k, v in metrics["comparisons"].items() if "control" not in k}
    assert list(headline_rows(without)) == ["cnn", "tcnn", "tcnn-cnn"]
    # issue 59 (12): MLflow gets the same numbers, named as the DVC columns with the unit last
    from core.robustness.headline import headline_metrics

    logged = headline_metrics(metrics)
    assert len(logged) == 3 * 2 + 3 * 3 and logged["tcnn clean pct"] == rows["tcnn"]["clean"]
    assert logged["control mCA pct"] == rows["control"]["mCA"]
    assert all(logged[k] == rows["tcnn-control"][k] for k in logged if k.startswith("tcnn-control"))


def test_interval_ends_reach_the_sweep_summary_as_low_and_high(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from pipelines.sweep.summary import summary_rows
    from pipelines.sweep.tables import write_table

    comps = _results(tmp_path / "sw" / "trials" / "t0")
    root = tmp_path / "sw" / "trials" / "t0"
    from stages.harness.catalogue import summary_metrics

    (root / "done.json").write_text(json.dumps({"headline": summary_metrics(root)}))
    p = {
        "pretrain": {"epochs": 1},
        "reparam": {"epoch": 1},
        "finetune": {"epochs": 1},
        "model": {"kind": "tcnn"},
    }
    spec = {"sweep_dir": str(tmp_path / "sw"), "grid": {}, "trials": {"t0": {"overrides": {}, "params": p,
                                                                            "pretrain_key": "k"}}}  # fmt: skip
    path = write_table(summary_rows(spec), tmp_path / "summary.parquet")
    row = pq.read_table(path).to_pylist()[0]
    d = comps["tcnn-control"]["mca"]
    assert (row["tcnn_minus_control_mca_ci_low"], row["tcnn_minus_control_mca_ci_high"]) == pytest.approx(
        (d["low"], d["high"])
    )


def test_the_control_trains_with_the_tcnn_lr_schedule_and_data_order(tmp_path: Path, monkeypatch) -> None:
    """finetune and control call the training loop with the same non-gate lr, the same warmup + cosine schedule
    and the same batches (the first three compared image for image); only the network differs."""
    from _train_helpers import tiny_params, write_dataset

    from stages import control, finetune, pretrain, reparam
    from stages.harness import fine_tuning

    data = write_dataset(tmp_path / "data", n_train=300, n_test=50)
    params = validate_params(tiny_params(data, pretrain={"epochs": 1}, reparam={"epoch": 1},
                                         finetune={"epochs": 2, "lr": 0.004, "gate_lr": 0.5}))  # fmt: skip
    pretrain.run(params, root=tmp_path)
    reparam.run(params, root=tmp_path)
    seen: dict[str, dict] = {}

    class Seen(Exception):
        pass

    def spy(model, optimizer, scheduler, train_loader, **kw):
        gates = {id(p) for n, p in model.named_parameters() if "gating" in n}
        lrs = sorted(
            {g["lr"] for g in optimizer.param_groups if not any(id(p) in gates for p in g["params"])}
        )
        batches = [(x.clone(), y.clone()) for _, (x, y) in zip(range(3), train_loader.batches(0))]
        seen[kw["desc"].split("[")[0]] = {"lrs": lrs, "total": scheduler.total_steps,
                                          "warmup": scheduler.warmup_steps, "epochs": list(kw["epochs"]), "batches": batches}  # fmt: skip
        raise Seen

    monkeypatch.setattr(fine_tuning, "fit", spy)
    for stage in (finetune, control):
        with pytest.raises(Seen):
            stage.run(params, root=tmp_path)
    t, c = seen["finetune"], seen["control"]
    assert t["lrs"] == c["lrs"] and len(t["lrs"]) == 1
    assert (t["total"], t["warmup"], t["epochs"]) == (c["total"], c["warmup"], c["epochs"])
    for (xt, yt), (xc, yc) in zip(t["batches"], c["batches"], strict=True):
        assert torch_equal(xt, xc) and torch_equal(yt, yc)
    # finetune.control_lr (each arm's lr chosen apart): only the control's lr moves, and the T-CNN's identity stays
    apart = params.with_overrides({"finetune.control_lr": 0.008})
    with pytest.raises(Seen):
        control.run(apart, root=tmp_path)
    a = seen["control"]
    assert a["lrs"] == [pytest.approx(2 * t["lrs"][0])] and (a["total"], a["epochs"]) == (
        t["total"],
        t["epochs"],
    )
    assert finetune.identity(apart, {}, "cpu") == finetune.identity(params, {}, "cpu")
    assert finetune.identity(apart.for_control(), {}, "cpu", variant="control") == finetune.identity(
        params.with_overrides({"finetune.lr": 0.008}), {}, "cpu", variant="control"
    )


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
