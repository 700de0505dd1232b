"""The study's design pieces: seeds that share a pretrained CNN (`pretrain.seed`: one pretraining,
one split, one set of corrupted images per CNN) with an analysis whose unit is the CNN; each choice's margin in
validation images; and the pooled choice a follow-up sweep fixes (pipelines/sweep/selection.py)."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from _train_helpers import tiny_params, write_dataset
from scipy import stats
from test_sweep import make_project

from core.config import Params
from pipelines.sweep.plan import make_plan
from pipelines.sweep.selection import choose, markdown, over_seeds, pooled
from pipelines.sweep.sweep_params import load_sweep_params
from stages import finetune, pretrain
from stages.harness import training as T

D = "tcnn_minus_control_clean_accuracy"


def _srow(seed: int, cnn: str, diff: float) -> dict:
    return {"config": "(base config)", "seed": seed, "cnn": cnn, D: diff,
            "tcnn_clean_accuracy": 0.9 + diff, "control_clean_accuracy": 0.9}  # fmt: skip


def _t(values: list[float]) -> tuple[float, float, float]:
    v = np.asarray(values)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return v.mean(), v.mean() - half, v.mean() + half


def test_seeds_sharing_a_cnn_are_averaged_and_the_interval_runs_over_cnns() -> None:
    """Three CNNs with 2, 2 and 1 fine-tuning seeds: the interval is Student's over the three CNN means
    (scipy), not over the five seeds, which would count replicates of one CNN as independent CNNs."""
    rows = [_srow(0, "A", 0.010), _srow(1, "A", 0.030), _srow(2, "B", -0.004), _srow(3, "B", 0.000),
            _srow(4, "C", 0.020)]  # fmt: skip
    (agg,) = over_seeds(rows)
    mean, low, high = _t([0.020, -0.002, 0.020])
    assert (agg["unit"], agg["n_cnns"], agg["n_seeds"]) == ("CNNs", 3, 5)
    assert agg[f"{D}_seeds_mean"] == pytest.approx(mean)
    assert (agg[f"{D}_seeds_ci_low"], agg[f"{D}_seeds_ci_high"]) == (pytest.approx(low), pytest.approx(high))
    naive = _t([r[D] for r in rows])
    assert naive[2] - naive[1] < high - low  # the five seeds as units would claim a narrower interval
    assert "| mean of 3 CNNs (5 seeds; t over CNNs) |" in markdown(rows, [agg], ["finetune.lr"])


def test_seeds_of_one_cnn_speak_for_that_cnn_and_own_cnns_are_seeds() -> None:
    one = [_srow(s, "A", d) for s, d in ((0, 0.01), (1, 0.02), (2, -0.01))]
    (agg,) = over_seeds(one)
    assert (agg["unit"], agg["n_cnns"]) == ("seeds of one CNN", 1)
    assert agg[f"{D}_seeds_ci_low"] == pytest.approx(_t([0.01, 0.02, -0.01])[1])
    assert "mean of 3 seeds of one CNN" in markdown(one, [agg], ["finetune.lr"])
    own = [_srow(s, f"k{s}", d) for s, d in ((0, 0.01), (1, 0.02), (2, -0.01))]
    (agg,) = over_seeds(own)
    assert (agg["unit"], agg["n_cnns"], agg["n_seeds"]) == ("seeds", 3, 3)
    assert agg[f"{D}_seeds_ci_high"] == pytest.approx(_t([0.01, 0.02, -0.01])[2])


def test_choose_treats_the_cnn_seed_as_a_replicate_not_a_configuration() -> None:
    rows = [{"trial": f"t{i}", "seed": s, "pretrain.seed": c, "finetune.lr": lr, "status": "finished",
             "tcnn_val_accuracy": v, "control_val_accuracy": 1 - v}
            for i, (s, c, lr, v) in enumerate([(0, 7, 1e-3, 0.5), (0, 7, 1e-2, 0.6), (0, 8, 1e-3, 0.7),
                                               (0, 8, 1e-2, 0.4)])]  # fmt: skip
    picks = choose(rows, ["seed", "pretrain.seed", "finetune.lr"], ["finetune.lr"])
    assert {p["config"] for p in picks} == {"(base config)"}
    got = {(p["pretrain.seed"], p["arm"]): p["finetune.lr"] for p in picks}
    assert got == {(7, "tcnn"): 1e-2, (7, "control"): 1e-3, (8, "tcnn"): 1e-3, (8, "control"): 1e-2}


def test_a_sweep_over_seeds_on_one_cnn_pretrains_and_corrupts_once(tmp_path: Path) -> None:
    """pretrain.seed fixed, seed gridded: one pretraining group and one corrupted-set directory for all seeds,
    one control per seed; without pretrain.seed every seed has its own CNN and sets."""
    shared = make_plan(load_sweep_params(make_project(tmp_path / "a", {"seed": [0, 1, 2]}, pretrain={"seed": 5})),
                       cwd=tmp_path / "a")  # fmt: skip
    assert len(shared.groups) == 1 and len({t.corrupt_key for t in shared.trials}) == 1
    assert len({t.control_key for t in shared.trials}) == 3
    own = make_plan(load_sweep_params(make_project(tmp_path / "b", {"seed": [0, 1, 2]})), cwd=tmp_path / "b")
    assert len(own.groups) == 3 and len({t.corrupt_key for t in own.trials}) == 3


def _params(tmp_path: Path, **pre: object) -> Params:
    raw = tiny_params(tmp_path / "data", pretrain={"epochs": 1, **pre})
    return Params.model_validate(raw)


def test_the_split_and_pretraining_follow_the_cnn_seed_and_old_identities_stay(tmp_path: Path) -> None:
    write_dataset(tmp_path / "data", 300, 50)
    base = _params(tmp_path)
    same = base.with_overrides({"pretrain.seed": base.seed})
    other = base.with_overrides({"seed": base.seed + 1, "pretrain.seed": base.seed})
    spec = {"arch": "x"}
    ident = pretrain.identity(base, spec, "fp", "cpu")
    assert pretrain.identity(same, spec, "fp", "cpu") == ident == pretrain.identity(other, spec, "fp", "cpu")
    assert pretrain.identity(base.with_overrides({"seed": 1}), spec, "fp", "cpu") != ident
    assert finetune.identity(same, {}, "cpu") == finetune.identity(base, {}, "cpu")
    assert finetune.identity(other, {}, "cpu") != finetune.identity(
        base.with_overrides({"seed": 1}), {}, "cpu"
    )
    ds0, ds1, own1 = (T.datasets(p) for p in (base, other, base.with_overrides({"seed": base.seed + 1})))
    assert np.array_equal(ds0.val_y, ds1.val_y) and np.array_equal(ds0.val_x, ds1.val_x)
    assert not np.array_equal(ds0.val_x, own1.val_x)


def _row(tid: str, seed: int, lr: float, t_val: float | None, c_val: float) -> dict:
    return {"trial": tid, "seed": seed, "finetune.lr": lr, "status": "finished",
            "tcnn_val_accuracy": t_val, "control_val_accuracy": c_val}  # fmt: skip


GRID = ["seed", "finetune.lr"]


def test_each_choice_carries_its_lead_over_the_runner_up() -> None:
    rows = [_row("a", 0, 1e-3, 0.800, 0.84), _row("b", 0, 1e-2, 0.8124, 0.80), _row("c", 0, 1e-1, 0.81, 0.70)]
    picks = {p["arm"]: p for p in choose(rows, GRID, ["finetune.lr"])}
    assert picks["tcnn"]["trial"] == "b" and picks["tcnn"]["margin"] == pytest.approx(0.0024)
    assert picks["control"]["trial"] == "a" and picks["control"]["margin"] == pytest.approx(0.04)
    assert choose(rows[:1], GRID, ["finetune.lr"])[0]["margin"] is None


def test_pooled_choice_takes_the_best_mean_over_seeds_that_finished_every_value() -> None:
    """Seed 0 alone would pick 1e-2 for the T-CNN, seed 1 alone 1e-1; their mean picks 1e-1. Seed 2 lacks a
    T-CNN score at 1e-1 (unfinished): it is left out of the T-CNN's means, not averaged over fewer values."""
    rows = [_row("a", 0, 1e-3, 0.80, 0.85), _row("b", 0, 1e-2, 0.83, 0.84), _row("c", 0, 1e-1, 0.82, 0.80),
            _row("d", 1, 1e-3, 0.79, 0.86), _row("e", 1, 1e-2, 0.80, 0.83), _row("f", 1, 1e-1, 0.84, 0.81),
            _row("g", 2, 1e-3, 0.99, 0.85), _row("h", 2, 1e-2, 0.99, 0.84), _row("i", 2, 1e-1, None, 0.80)]  # fmt: skip
    got = {p["arm"]: p for p in pooled(rows, GRID, ["finetune.lr"])}
    t, c = got["tcnn"], got["control"]
    assert (t["finetune.lr"], t["seeds"]) == (1e-1, 2)
    assert t["value"] == pytest.approx((0.82 + 0.84) / 2) and t["margin"] == pytest.approx(0.83 - 0.815)
    assert (c["finetune.lr"], c["seeds"]) == (1e-3, 3)
    assert c["value"] == pytest.approx(2.56 / 3) and c["margin"] == pytest.approx((2.56 - 2.51) / 3)
    text = markdown([], [], ["finetune.lr"], pool=list(got.values()))
    assert (
        "(base config), tcnn: finetune.lr=0.1 (mean 83.00% over 2 seeds, 1.50 pp ahead of the runner-up)"
        in text
    )


POWER = Path(__file__).resolve().parents[1] / "pipelines" / "studies" / "cifar10_power.yaml"


def test_the_power_study_preset_is_the_stated_design(tmp_path: Path) -> None:
    """pipelines/studies/cifar10_power.yaml: one CNN for every seed, 10,000 validation images, corrupted sets at
    CIFAR-10-C's size, early stopping for both arms, the lr bracketed; its phase-2 overrides (docs/studies.md)
    validate, give the control its own lr and select nothing."""
    p = load_sweep_params(POWER)
    assert p.pretrain.seed == 0 and p.sweep.grid["seed"] == [0, 1, 2] and "pretrain.seed" not in p.sweep.grid
    assert (p.data.val_size, p.robustness.n_images, p.precision) == (10_000, 10_000, "fp32")
    assert p.finetune.stop is not None and p.sweep.select.bracket is not None
    assert p.sweep.select.over == ["finetune.lr"] and p.finetune.control_lr is None
    phase2 = ["sweep.grid={seed: [3, 4, 5, 6, 7, 8, 9, 10]}", "sweep.select={over: []}",
              "finetune.lr=<T-CNN's pooled lr>", "finetune.control_lr=<control's pooled lr>"]  # fmt: skip
    text = POWER.read_text()
    assert all(f"-S '{a}'" in text or f"-S {a}" in text for a in phase2)  # the command the preset shows
    args = [
        a.replace("<T-CNN's pooled lr>", "0.01").replace("<control's pooled lr>", "0.001") for a in phase2
    ]
    main = load_sweep_params(POWER, overrides=args)
    assert main.sweep.grid == {"seed": [3, 4, 5, 6, 7, 8, 9, 10]} and main.sweep.select.over == []
    assert (main.finetune.lr, main.for_control().finetune.lr) == (0.01, 0.001)


REPO = Path(__file__).resolve().parents[1]


def test_sizing_is_students_t_and_the_docs_table_is_generated_from_the_first_study() -> None:
    from pipelines.studies import sizing as Z

    # 0.39 pp: t(0.975, 4) = 2.776 -> 2.776 x 0.39 / sqrt(5) = 0.484 pp; 4 seeds would give 0.62 pp
    assert Z.seeds_needed(0.0039) == 5 and Z.half_width(0.0039, 4) > 0.005 >= Z.half_width(0.0039, 5)
    assert Z.half_width(0.0073, 11) == pytest.approx(stats.t.ppf(0.975, 10) * 0.0073 / np.sqrt(11))
    assert Z.sd_upper(0.01, 3) == pytest.approx(0.01 * np.sqrt(2 / stats.chi2.ppf(0.2, 2)))
    rows = Z.sizing(REPO / "pipelines" / "studies" / "cifar10_lr")
    text = (REPO / "pipelines/studies/cifar10_lr/results.csv").read_text().splitlines()
    committed = [r for r in csv.DictReader(text) if r["row"] == "selected"]
    assert rows[1]["sd"] == pytest.approx(
        np.std([float(r["tcnn_minus_control_mca"]) for r in committed], ddof=1)
    )
    studies = (REPO / "docs" / "studies.md").read_text()
    block = studies.split("<!-- sizing:cifar10-lr:begin -->\n")[1].split("<!-- sizing:cifar10-lr:end -->")[0]
    assert block == Z.markdown(rows)
    assert Z.main([]) == 2


def test_the_docs_cost_table_is_the_committed_benchmark_run() -> None:
    run = (REPO / "benchmarks" / "results" / "trial_cost_epyc_avx2.txt").read_text()
    table = [line for line in run.splitlines() if line.startswith("|")]
    assert len(table) == 9 and "trial before / after" in run
    studies = (REPO / "docs" / "studies.md").read_text()
    assert "\n".join(table) in studies


def _cell(run: str, part: str, column: int) -> float:
    """The seconds of ``part`` in the cost table's ``column`` (0: the first case)."""
    row = next(line for line in run.splitlines() if line.startswith(f"| {part} |"))
    return float(row.split(" | ")[1 + column].split(" (")[0].replace(",", ""))


def test_the_committed_trial_cost_counts_every_corrupted_set_the_evaluate_stage_evaluates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 48: each model is evaluated on robustness.corruptions x robustness.severities sets (19 x 5 = 95 by
    default), not 19. The committed table is what ``--from-results`` prints from its own recorded rates, and
    its evaluation cells equal images / rate computed here from core.robustness.suite and the presets."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import trial_cost

    from core.robustness.suite import CORRUPTIONS, SEVERITIES

    path = REPO / "benchmarks" / "results" / "trial_cost_epyc_avx2.txt"
    run = path.read_text()
    trial_cost.main(["--from-results", str(path.relative_to(REPO))])
    assert capsys.readouterr().out == run  # reproducible from the rates it records
    for study in ("cifar10_lr", "cifar10_power"):  # neither preset narrows the default suite
        raw = yaml.safe_load((REPO / "pipelines" / "studies" / f"{study}.yaml").read_text())
        rob = raw["robustness"]  # dvc.yaml reads both keys: the preset spells out the defaults (issue 59)
        assert (rob.get("corruptions", list(CORRUPTIONS)), rob.get("severities", list(SEVERITIES))) == (
            list(CORRUPTIONS),
            list(SEVERITIES),
        )
    sets = len(CORRUPTIONS) * len(SEVERITIES)
    assert sets == 95 and trial_cost.corrupted_sets(REPO / "pipelines/studies/cifar10_power.yaml") == sets
    rate = {k: float(v) for k, v in re.findall(r"eval (T-CNN after|CNN) (\d+)", run)}
    for column, per_set in ((1, 2_000), (2, 10_000), (3, 10_000)):
        images = 10_000 + sets * per_set  # the clean test split and every corrupted set
        assert _cell(run, "evaluate T-CNN", column) == round(images / rate["T-CNN after"])
        assert _cell(run, "evaluate control", column) == round(images / rate["CNN"])
        assert _cell(run, "evaluate CNN", column) == round(images / rate["CNN"] / 3)  # one CNN per 3 trials


def test_the_sweep_summary_over_seeds_takes_the_cnn_as_its_unit_too() -> None:
    """summary.parquet's seed aggregate (every sweep whose grid varies seed): seeds sharing a pretraining key
    are averaged first, as in the selection; each seed with its own key is its own unit."""
    from pipelines.sweep.summary import seed_rows, seeds_markdown

    spec = {"grid": {"seed": [0, 1, 2, 3], "pretrain.seed": [7, 8]}}
    rows = [{"trial": f"t{i}", "status": "finished", "seed": s, "pretrain.seed": c, "pretrain_key": f"k{c}",
             D: d} for i, (s, c, d) in enumerate([(0, 7, 0.01), (1, 7, 0.03), (2, 8, 0.0), (3, 8, 0.02)])]  # fmt: skip
    (agg,) = seed_rows(spec, rows)
    mean, low, high = _t([0.02, 0.01])
    assert (agg["unit"], agg["n_cnns"], agg["n_seeds"], agg["config"]) == ("CNNs", 2, 4, "(base config)")
    assert (agg[f"{D}_seeds_mean"], agg[f"{D}_seeds_ci_low"]) == (pytest.approx(mean), pytest.approx(low))
    assert "| (base config) | 2 CNNs (4 seeds; t over CNNs) |" in seeds_markdown([agg])
    for r in rows:
        r["pretrain_key"] = f"own{r['seed']}"
    (agg,) = seed_rows(spec, rows)
    assert agg["unit"] == "seeds" and agg[f"{D}_seeds_ci_high"] == pytest.approx(
        _t([0.01, 0.03, 0.0, 0.02])[2]
    )
