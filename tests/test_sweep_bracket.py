"""Bracketing (``sweep.select.bracket``, pipelines/sweep/bracket.py): the rule on hand-made summary rows, and
the added trials planned into a real sweep spec (no Ray; the Ray run is in tests/test_sweep_ray.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sweep import make_project

from pipelines.sweep.bracket import Step, asked, decide, extend, round_of, round_trials
from pipelines.sweep.settings import BracketPlan, SelectConfig

KEY = "finetune.lr"
GRID_KEYS = ["seed", KEY]
SELECT = SelectConfig(over=[KEY], by="val_accuracy")


def settings(max_rounds: int = 3, ratio: float = 10.0) -> BracketPlan:
    return BracketPlan(key=KEY, ratio=ratio, max_rounds=max_rounds)


def row(
    seed: int, lr: float, t_val: float, c_val: float, *, t_test: float = 0.5, c_test: float = 0.5
) -> dict:
    return {"trial": f"s{seed}-{lr:g}", "seed": seed, KEY: lr, "status": "finished",
            "tcnn_val_accuracy": t_val, "control_val_accuracy": c_val,
            "tcnn_clean_accuracy": t_test, "control_clean_accuracy": c_test}  # fmt: skip


def study_rows() -> list[dict]:
    """Three seeds on [1e-4, 1e-3, 1e-2]: the T-CNN is best at the top (0.01) for seeds 0 and 2, at 1e-3 for
    seed 1; the control is best at 1e-3 for every seed (the CIFAR-10 lr study's pattern)."""
    return [
        row(0, 1e-4, 0.70, 0.80), row(0, 1e-3, 0.80, 0.85), row(0, 1e-2, 0.88, 0.84),
        row(1, 1e-4, 0.70, 0.80), row(1, 1e-3, 0.86, 0.85), row(1, 1e-2, 0.84, 0.84),
        row(2, 1e-4, 0.70, 0.80), row(2, 1e-3, 0.80, 0.85), row(2, 1e-2, 0.87, 0.84),
    ]  # fmt: skip


def test_a_choice_at_the_top_edge_adds_one_step_up() -> None:
    step = decide(study_rows(), GRID_KEYS, SELECT, settings(), rounds_done=0)
    assert step.add == [0.1] and step.stop is None
    assert step.reasons == ["finetune.lr=0.1 added: tcnn's choice 0.01 was the top edge for seeds 0, 2"]


def test_interior_choices_stop_after_the_added_round() -> None:
    rows = study_rows() + [row(s, 0.1, 0.60, 0.50) for s in (0, 1, 2)]  # 0.1 is worse for both arms
    step = decide(rows, GRID_KEYS, SELECT, settings(), rounds_done=1)
    assert step.add == [] and step.stop == (
        "finetune.lr: every arm's choice is interior after 1 round (tried 0.0001, 0.001, 0.01, 0.1)"
    )


def test_the_bound_stops_a_choice_still_at_the_edge_and_says_so() -> None:
    rows = study_rows() + [row(s, 0.1, 0.90 if s != 1 else 0.6, 0.5) for s in (0, 1, 2)]
    assert decide(rows, GRID_KEYS, SELECT, settings(max_rounds=2), rounds_done=1).add == [1.0]
    step = decide(rows, GRID_KEYS, SELECT, settings(max_rounds=1), rounds_done=1)
    assert step.add == [] and step.stop == (
        "finetune.lr: still at the edge after 1 round (max_rounds 1): "
        "tcnn's choice 0.1 was the top edge for seeds 0, 2"
    )


def test_a_choice_at_the_bottom_edge_adds_one_step_down() -> None:
    rows = study_rows()
    rows[3]["control_val_accuracy"] = 0.99  # seed 1's control: best at 1e-4
    step = decide(rows, GRID_KEYS, SELECT, settings(), rounds_done=0)
    assert step.add == [1e-5, 0.1]
    assert (
        step.reasons[0] == "finetune.lr=1e-05 added: control's choice 0.0001 was the bottom edge for seed 1"
    )


def test_the_rule_reads_validation_only() -> None:
    """Test-split numbers that put the best value at an edge change nothing; validation ones do."""
    rows = [row(0, 1e-4, 0.7, 0.7, t_test=0.99, c_test=0.99), row(0, 1e-3, 0.9, 0.9, t_test=0.1, c_test=0.1),
            row(0, 1e-2, 0.8, 0.8, t_test=0.98, c_test=0.98)]  # fmt: skip
    assert decide(rows, GRID_KEYS, SELECT, settings(), 0).stop.startswith("finetune.lr: every arm's choice")
    for r in rows:  # validation at the top edge, test in the middle
        r["tcnn_val_accuracy"], r["tcnn_clean_accuracy"] = r[KEY] * 10, 1 - r[KEY]
    assert decide(rows, GRID_KEYS, SELECT, settings(), 0).add == [0.1]


def test_unfinished_trials_do_not_choose_and_an_integer_grid_stays_integer() -> None:
    rows = study_rows()
    for r in rows:
        r["status"] = "error"
    assert decide(rows, GRID_KEYS, SELECT, settings(), 0).stop == (
        "finetune.lr: no finished trial to choose from; nothing added"
    )
    ints = [{**row(0, v, v, 0.0), KEY: v} for v in (1, 2, 4)]
    ints[2]["control_val_accuracy"] = 1.0  # control at the top: 8 is added; the T-CNN also at the top
    assert decide(ints, GRID_KEYS, SELECT, settings(ratio=2.0), 0).add == [8]
    ints[0]["tcnn_val_accuracy"], ints[0]["control_val_accuracy"] = 9.0, 9.0  # both at 1: 0.5 is no integer
    step = decide(ints, GRID_KEYS, SELECT, settings(ratio=2.0), 0)
    assert step.add == [] and "no integer finetune.lr one step beyond 1" in step.stop


# ------------------------------------------------------------------------------- planning the added trials


def _spec(tmp_path: Path, grid: dict, select: dict) -> dict:
    from pipelines.sweep.sweep_params import load_sweep_params
    from pipelines.sweep.sweep_spec import build_spec

    path = make_project(tmp_path, grid, sweep={"select": select})
    return build_spec(load_sweep_params(path), name="b", params_file=path, cwd=tmp_path)


def test_extend_plans_only_the_new_values_and_keeps_every_trial(tmp_path: Path) -> None:
    from pipelines.sweep.summary import summary_rows
    from pipelines.sweep.sweep_spec import SWEEP_JSON, reconcile

    grid = {"seed": [0, 1], KEY: [0.001, 0.01]}
    spec = _spec(tmp_path, grid, {"over": [KEY], "bracket": True})
    assert spec["bracket"] == {"key": KEY, "ratio": 10.0, "max_rounds": 3}
    out, added = extend(spec, Step(add=[0.1], reasons=["why"]))
    assert {tid: out["trials"][tid] for tid in spec["trials"]} == spec["trials"]  # untouched
    assert [out["trials"][t]["overrides"] for t in added] == [{"seed": 0, KEY: 0.1}, {"seed": 1, KEY: 0.1}]
    assert [out["trials"][t]["index"] for t in added] == [4, 5] and added == round_trials(out, 1)
    assert out["bracket_rounds"] == [{"round": 1, "key": KEY, "added": [0.1], "reasons": ["why"],
                                      "trials": added}]  # fmt: skip
    assert out["grid"] == grid  # the asked grid (the parent run's grid.* params) stays
    # Each seed's pretraining group gains its new trial; each new lr has its own matched control.
    for g in out["groups"].values():
        seed = out["trials"][g["trials"][0]]["params"]["seed"]
        assert [t for t in g["trials"] if t in added] == [
            t for t in added if out["trials"][t]["overrides"]["seed"] == seed
        ]
    new_controls = set(out["controls"]) - set(spec["controls"])
    assert len(new_controls) == 2 and all(len(out["controls"][c]["trials"]) == 1 for c in new_controls)
    assert out["trials"][added[0]]["params"]["finetune"]["lr"] == 0.1
    assert asked(out)["trials"] == spec["trials"]
    # A resumed driver with the same params accepts the saved, extended sweep and keeps its rounds.
    Path(out["sweep_dir"]).mkdir(parents=True)
    (Path(out["sweep_dir"]) / SWEEP_JSON).write_text(json.dumps(out))
    merged = reconcile(spec, "auto")
    assert list(merged["trials"]) == list(out["trials"]) and merged["bracket_rounds"] == out["bracket_rounds"]
    assert round_of(merged)[added[1]] == 1
    assert [r["bracket_round"] for r in summary_rows(merged)] == [0, 0, 0, 0, 1, 1]
    again, none = extend(out, Step(add=[0.1]))  # a value already planned: nothing new
    assert none == [] and list(again["trials"]) == list(out["trials"])


def test_an_added_value_that_is_no_valid_setting_is_refused(tmp_path: Path) -> None:
    from pipelines.sweep.plan import SweepError

    spec = _spec(tmp_path, {"data.sample_fraction": [0.5, 1.0]}, {"over": ["data.sample_fraction"],
                                                                  "bracket": {"max_rounds": 2}})  # fmt: skip
    with pytest.raises(SweepError, match="data.sample_fraction"):
        extend(spec, Step(add=[2.0]))


# ------------------------------------------------------------------------------------------ the driver loop


def _objective(lr: float, peak: float) -> float:
    import math

    return 0.9 - 0.05 * (math.log10(lr) - math.log10(peak)) ** 2


def _fake_fit(calls: list[int]):
    """In place of the Tune experiment of a round: each trial's done.json with a validation accuracy that
    peaks at lr 0.1 for the T-CNN and 1e-3 for the control; the test accuracy keeps rising with lr."""
    from pipelines.sweep.bracket import round_trials

    def fit(spec: dict, k: int) -> dict[str, str]:
        calls.append(k)
        for tid in round_trials(spec, k):
            lr = spec["trials"][tid]["overrides"][KEY]
            head = {"tcnn_val_accuracy": _objective(lr, 0.1), "control_val_accuracy": _objective(lr, 1e-3),
                    "tcnn_clean_accuracy": lr, "control_clean_accuracy": lr}  # fmt: skip
            root = Path(spec["sweep_dir"]) / "trials" / tid
            root.mkdir(parents=True, exist_ok=True)
            (root / "done.json").write_text(json.dumps({"headline": head}))
        return {tid: "terminated" for tid in round_trials(spec, k)}

    return fit


@pytest.mark.parametrize("max_rounds", [3, 1])
def test_the_driver_grows_the_grid_until_every_choice_is_interior(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_rounds: int
) -> None:
    from pipelines.sweep import driver
    from pipelines.sweep.sweep_spec import SWEEP_JSON, reconcile

    spec = _spec(tmp_path, {KEY: [1e-3, 1e-2]}, {"over": [KEY], "bracket": {"max_rounds": max_rounds}})
    calls: list[int] = []
    monkeypatch.setattr(driver, "_fit", _fake_fit(calls))
    monkeypatch.setattr(driver, "_ensure_corrupted", lambda spec, keys: None)
    Path(spec["sweep_dir"]).mkdir(parents=True)
    out, status = driver._run_rounds(spec)
    added = [r["added"] for r in out["bracket_rounds"]]
    saved = json.loads((Path(out["sweep_dir"]) / SWEEP_JSON).read_text())
    assert saved["bracket_rounds"] == out["bracket_rounds"] and len(status) == len(out["trials"])
    if max_rounds == 3:
        assert calls == [0, 1, 2] and added == [[1e-4, 0.1], [1.0]]
        assert out["bracket_rounds"][0]["reasons"] == [
            "finetune.lr=0.0001 added: control's choice 0.001 was the bottom edge",
            "finetune.lr=0.1 added: tcnn's choice 0.01 was the top edge",
        ]
        assert out["bracket_stop"] == (
            "finetune.lr: every arm's choice is interior after 2 rounds (tried 0.0001, 0.001, 0.01, 0.1, 1)"
        )
    else:
        assert calls == [0, 1] and added == [[1e-4, 0.1]]
        assert out["bracket_stop"] == (
            "finetune.lr: still at the edge after 1 round (max_rounds 1): tcnn's choice 0.1 was the top edge"
        )
    # A resumed driver runs the saved rounds again (Tune skips their finished trials) and adds nothing new.
    calls.clear()
    again, _ = driver._run_rounds(reconcile(spec, "auto"))
    assert calls == list(range(len(added) + 1)) and again["bracket_rounds"] == out["bracket_rounds"]
    assert again["bracket_stop"] == out["bracket_stop"]
