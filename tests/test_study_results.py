"""The committed results of a study and the README section made from them (pipelines/studies/): the
selection re-derived from validation accuracy, the over-seed intervals recomputed, the README block in sync."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from pipelines.studies import render as R
from pipelines.studies import results as S
from pipelines.studies import study_cost as C
from pipelines.studies import study_tables as T

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "pipelines" / "studies" / "cifar10_lr"
LRS = (0.0001, 0.001, 0.01)


def _row(kind: str, seed: int, t_lr: float, c_lr: float, t_val: float, c_val: float, diff: float) -> dict:
    r = {k: 0.5 for k in S._columns()}
    r.update(row=kind, seed=seed, tcnn_value=t_lr, control_value=c_lr, tcnn_trial="a", control_trial="b",
             tcnn_selected=False, control_selected=False, tcnn_val_accuracy=t_val, control_val_accuracy=c_val,
             cnn_val_accuracy=0.8)  # fmt: skip
    for m in S.METRICS:
        r[f"{S.DIFF}_{m}"] = diff
        r[f"{S.DIFF}_{m}_ci_low"], r[f"{S.DIFF}_{m}_ci_high"] = diff - 0.01, diff + 0.01
    r["tcnn_clean_accuracy"], r["control_clean_accuracy"] = 0.9 + diff, 0.9
    return r


def _study(tmp: Path, diffs: tuple[float, ...] = (0.02, 0.025, 0.03)) -> Path:
    """Per seed, the validation-best lr differs from the test-best one on purpose (test accuracies are the
    same everywhere): the T-CNN chooses 1e-3, the control 1e-4."""
    rows = []
    for seed, d in enumerate(diffs):
        for lr in LRS:
            rows.append(
                _row("grid", seed, lr, lr, {0.001: 0.9}.get(lr, 0.8), {0.0001: 0.85}.get(lr, 0.8), d / 2)
            )
            rows[-1]["tcnn_selected"], rows[-1]["control_selected"] = lr == 0.001, lr == 0.0001
        rows.append(_row("selected", seed, 0.001, 0.0001, 0.9, 0.85, d))
    tmp.mkdir(parents=True, exist_ok=True)
    T.write_csv(tmp / "results.csv", rows, S._columns())
    T.write_csv(tmp / "history.csv", [{"seed": s, "arm": a, "value": lr, "epoch": e, "val_accuracy": 0.8 + e / 100}
                                       for s in range(3) for a in ("tcnn", "control") for lr in LRS for e in range(3)],
                 ["seed", "arm", "value", "epoch", "val_accuracy"])  # fmt: skip
    T.write_csv(tmp / "attention.csv", [{"seed": s, "epoch": e, "layer": "layer4.0.conv1", "head": h,
                                          "inv_alpha": 1.0, "gate": 0.73 - 0.35 * e * (h == 0), "nonlocality": 1.5}
                                         for s in range(3) for e in range(3) for h in range(9)],
                 ["seed", "epoch", "layer", "head", "inv_alpha", "gate", "nonlocality"])  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps({"sweep": "toy", "selected_key": "finetune.lr", "commit": "abc",
                                               "cpus": ["Toy CPU"], "compute_h": 1.25, "trials": 9}))  # fmt: skip
    return tmp


def test_the_table_reselects_on_validation_and_recomputes_the_seed_interval(tmp_path: Path) -> None:
    data = T.load(_study(tmp_path / "r"))
    assert R.reselect(data["rows"]) == {
        (s, a): lr for s in range(3) for a, lr in (("tcnn", 0.001), ("control", 0.0001))
    }
    head = R.headline(data["rows"])["clean_accuracy"]
    diffs = np.array([0.02, 0.025, 0.03])
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / np.sqrt(3)
    assert head["mean"] == pytest.approx(diffs.mean())
    assert (head["low"], head["high"]) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    text = R.markdown(data, "toy", "x")
    assert (
        f"**+{100 * diffs.mean():.2f} [+{100 * (diffs.mean() - half):.2f}, +{100 * (diffs.mean() + half):.2f}]**"
        in text
    )
    assert "the T-CNN is better" in text  # every seed's difference is positive and so is the interval
    assert "9 trials, 1.2 h of compute" in text and text.rstrip().endswith("on Toy CPU.")
    assert "seed 0: 3 of 9 heads" not in text and "seed 0: 1 of 9 heads" in text  # head 0: 0.73 -> 0.03


def test_a_selected_row_that_is_not_the_validation_argmax_is_refused(tmp_path: Path) -> None:
    d = _study(tmp_path / "r")
    with open(d / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        if r["row"] == "selected" and r["seed"] == "1":
            r["tcnn_value"] = "0.01"  # the test-best choice, not the validation one
    T.write_csv(d / "results.csv", rows, S._columns())
    with pytest.raises(T.StudyError, match="seed 1: the tcnn row chose 0.01, the validation argmax is 0.001"):
        R.selected(T.load(d)["rows"])


def test_a_flipped_selection_flag_or_a_row_cut_short_is_one_line(tmp_path: Path) -> None:
    """one flipped ``<arm>_selected`` flag changed a count the README prints; a results.csv cut
    mid-row was an AttributeError traceback. Both are refused with one line naming the place."""
    d = _study(tmp_path / "r")
    text = (d / "results.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    rows[1]["control_selected"] = "True"  # seed 0, lr 1e-3: not the control's validation argmax (1e-4)
    T.write_csv(d / "results.csv", rows, S._columns())
    with pytest.raises(T.StudyError, match=r"seed 0, control 0.001: control_selected is True, but the validation "
                                           r"argmax is 0.0001"):  # fmt: skip
        R.selected(T.load(d)["rows"])
    (d / "results.csv").write_text(text[: len(text) // 2].rsplit(",", 3)[0] + "\n")
    with pytest.raises(
        T.StudyError, match=r"results.csv: line \d+ has \d+ of \d+ fields \(cut short\?\)"
    ) as info:
        T.load(d)
    assert "\n" not in str(info.value)


def test_render_replaces_the_readme_block_and_check_says_when_it_is_stale(tmp_path: Path) -> None:
    d = _study(tmp_path / "r")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- study:toy:begin -->\nold\n<!-- study:toy:end -->\noutro\n")
    cli = [sys.executable, "-m", "pipelines.cli", "study", "render", str(d), "--readme", str(readme)]
    stale = subprocess.run([*cli, "--check"], capture_output=True, text=True, cwd=REPO)
    assert stale.returncode == 1 and "not up to date" in stale.stderr
    assert subprocess.run(cli, capture_output=True, text=True, cwd=REPO).returncode == 0
    text = readme.read_text()
    assert text.startswith("intro\n<!-- study:toy:begin -->\n| seed |") and text.endswith(
        "<!-- study:toy:end -->\noutro\n"
    )
    assert subprocess.run([*cli, "--check"], capture_output=True, text=True, cwd=REPO).returncode == 0
    for fig in S.FIGURES:
        assert (d / fig).stat().st_size > 10_000


#: Where the first CIFAR-10 study's block lives: docs/studies.md (the README carries the released ResNet-20's).
PAGE = REPO / "docs" / "studies.md"


def _readme_block(name: str) -> str:
    text = PAGE.read_text()
    return text.split(f"<!-- study:{name}:begin -->", 1)[1].split(f"<!-- study:{name}:end -->", 1)[0]


def test_the_readme_table_is_generated_from_the_committed_study_results() -> None:
    """Until the study's tables are committed the README block claims nothing (no number in it); once they are,
    it is exactly what `tcnn study render` makes of them."""
    if not (COMMITTED / "results.csv").exists():
        block = _readme_block("cifar10-lr")
        assert "not finished" in block and not any(ch.isdigit() for ch in block.replace("cifar10_lr", ""))
        assert not any((COMMITTED / f).exists() for f in S.FILES)  # all the tables or none
        return
    section, same = R.render(COMMITTED, PAGE, check=True)
    assert same, "docs/studies.md's study block differs from `tcnn study render pipelines/studies/cifar10_lr`"
    rows = T.load(COMMITTED)["rows"]
    assert len({r["seed"] for r in rows}) >= 3
    assert len({r["tcnn_value"] for r in rows if r["row"] == "grid"}) >= 3
    for fig in S.FIGURES:
        assert (COMMITTED / fig).is_file()


#: The toy sweep of :func:`_sweep`: trial -> (seed, gate lr, pretraining key, control key). t000 and t001 share
#: seed 0's pretraining and one control (the grid key is the T-CNN's own); t002 has its own; all three share
#: the corrupted sets x0.
TRIALS = {"t000": (0, 0.1, "p0", "c0"), "t001": (0, 1.0, "p0", "c0"), "t002": (1, 0.1, "p1", "c1")}
#: Shared runs: their training epochs' times, the stage's own wall_s, the trial that ran them and the sweep's
#: record of that execution (started, finished).
SHARED = {("pretrain", "p0"): ([100.0, 110.0], 250.0, "t000", (0.0, 260.0)),
          ("pretrain", "p1"): ([120.0, 130.0], 280.0, "t002", (0.0, 290.0)),
          ("control", "c0"): ([30.0, 31.0], 70.0, "t000", (300.0, 380.0)),
          ("control", "c1"): ([33.0, 34.0], 75.0, "t002", (300.0, 385.0))}  # fmt: skip


#: The corrupted sets x0, as the driver checked them twice (a resumed driver; the second found them made):
#: (started, finished, the stage's own wall_s).
CORRUPT = ((0.0, 30.0, 29.0), (500.0, 502.0, 1.5))
#: The pretrained CNN's evaluation each trial's evaluate had (stages.cnn_evaluation's note): seed 0's made by
#: t000 into the store and read by t001, seed 1's made by t002. Its recorded time, and the store's record.
CNN_EVAL = {"t000": {"key": "e0", "source": "computed", "seconds": 7.0},
            "t001": {"key": "e0", "source": "shared", "seconds": 0.0},
            "t002": {"key": "e1", "source": "computed", "seconds": 8.0}}  # fmt: skip
CNN_RECORDS = {"e0": {"seconds": 7.0, "cpu": "CPU S"}, "e1": {"seconds": 8.0, "cpu": "CPU S"}}


def _finetune_times(i: int) -> list[float]:
    return [60.0 + i, 61.5 + i]


def _epochs(times: list[float], start: bool) -> list[dict]:
    """A training history: with ``start``, the fine-tuning stages' epoch 0 first (the state before training,
    no training time)."""
    head = [{"finetune_epoch": 0, "step": 0, "val_acc": 0.5, "val_loss": 1.5}] if start else []
    return head + [{"finetune_epoch": e, "epoch": e, "lr": 1e-3, "train_loss": 1.0 / e, "train_acc": 0.6,
                    "val_loss": 1.0, "val_acc": 0.6 + e / 100, "images_per_s": 5000.0 / t, "train_time_s": t}
                   for e, t in enumerate(times, 1)]  # fmt: skip


def _sweep(tmp: Path) -> tuple[Path, dict]:
    """A finished toy sweep laid out as the sweep leaves it (pipelines/sweep/trial.py, shared.py): shared
    runs in ``<storage>/<stage>/<key>/`` with their executions.jsonl, linked from the trials' ``runs/<stage>``,
    this sweep's ``<stage>_runs.jsonl``, each trial's own stages in its directory with its stages.jsonl. Another
    sweep's execution sits in the same storage."""
    from pipelines.sweep.shared import EXECUTIONS, link_pretraining, runs_log
    from stages.harness import chain

    storage = tmp / "sweeps"
    sweep = storage / "toy"
    for (stage, key), (times, wall, tid, (t0, t1)) in SHARED.items():
        d = storage / stage / key
        (d / chain.run_dir(stage)).mkdir(parents=True)
        (d / chain.output(stage, "history.json")).write_text(json.dumps(_epochs(times, stage == "control")))
        (d / chain.metrics_file(stage)).write_text(json.dumps({"wall_s": wall, "train_time_s": sum(times)}))
        record = {"sweep": "toy", "trial": tid, "key": key, "cpu": "CPU S", "started": t0, "finished": t1}
        (d / EXECUTIONS).write_text(json.dumps(record) + "\n")
        sweep.mkdir(parents=True, exist_ok=True)
        with open(sweep / runs_log(stage), "a") as fh:
            fh.write(json.dumps(record) + "\n")
    (storage / "corrupt" / "x0").mkdir(parents=True)
    for t0, t1, wall in CORRUPT:
        record = {
            "sweep": "toy",
            "key": "x0",
            "cpu": "CPU D",
            "started": t0,
            "finished": t1,
            "stage_wall_s": wall,
        }
        for path in (storage / "corrupt" / "x0" / EXECUTIONS, sweep / runs_log("corrupt")):
            with open(path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
    for key, record in CNN_RECORDS.items():
        (storage / "cnn_evaluation" / key).mkdir(parents=True)
        (storage / "cnn_evaluation" / key / "record.json").write_text(json.dumps(record))
    (storage / "pretrain" / "p9").mkdir()
    (storage / "pretrain" / "p9" / EXECUTIONS).write_text(
        json.dumps({"sweep": "other", "cpu": "CPU 9"}) + "\n"
    )
    trials = {}
    for i, (tid, (seed, lr, pkey, ckey)) in enumerate(TRIALS.items()):
        root = sweep / "trials" / tid
        for stage, key in (("pretrain", pkey), ("control", ckey)):
            link_pretraining(root, storage / stage / key, stage)
        path = root / chain.output("finetune", "history.json")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_epochs(_finetune_times(i), True)))
        (root / chain.metrics_file("finetune")).write_text(json.dumps({"wall_s": 150.0 + i}))
        evaluated = {"tcnn": {"clean_accuracy": 0.9}, "cnn_evaluation": CNN_EVAL[tid], "wall_s": 19.0 + i}
        for stage, metrics in (("reparam", {"wall_s": 4.0}), ("evaluate", evaluated)):
            (root / chain.metrics_file(stage)).parent.mkdir(parents=True)
            (root / chain.metrics_file(stage)).write_text(json.dumps(metrics))
        log = (
            [{"stage": "pretrain", "shared": pkey, "finished": 260.0}]
            if SHARED[("pretrain", pkey)][2] == tid
            else []
        )
        log += [{"stage": "reparam", "started": 10.0, "finished": 15.0, "cpu": f"CPU {i}"},
                {"stage": "finetune", "started": 20.0, "finished": 200.0, "cpu": f"CPU {i}"},  # its history counts
                *([{"stage": "control", "shared": ckey, "finished": 380.0}] if SHARED[("control", ckey)][2] == tid else []),
                {"stage": "evaluate", "started": 400.0, "finished": 420.0 + i, "cpu": f"CPU {i}"}]  # fmt: skip
        (root / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        (root / "done.json").write_text("{}")
        trials[tid] = {"params": {"seed": seed, "robustness": {"bootstrap": 10}},
                       "overrides": {"finetune.gate_lr": lr}, "pretrain_key": pkey, "control_key": ckey,
                       "corrupt_key": "x0"}  # fmt: skip
    spec = {
        "name": "toy",
        "share_pretraining": True,
        "select": {"over": ["finetune.gate_lr"]},
        "trials": trials,
    }
    (sweep / "sweep.json").write_text(json.dumps(spec))
    return sweep, spec


def _hand_hours() -> float:
    """The toy sweep's compute by hand: each shared run's epochs once, each trial's fine-tuning epochs, its
    reparam (5 s) and evaluate (20 + i s, the CNN evaluation it made inside) as its stages.jsonl times them, and
    the driver's two checks of the corrupted sets (30 s + 2 s)."""
    seconds = sum(sum(times) for times, *_ in SHARED.values())
    seconds += sum(sum(_finetune_times(i)) + 5.0 + 20.0 + i for i in range(len(TRIALS)))
    seconds += 30.0 + 2.0
    return round(seconds / 3600, 2)


def test_compute_hours_and_cpus_come_from_the_trials_records(tmp_path: Path) -> None:
    """Compute = the kept training epochs of every history (a shared pretraining or control once) plus the other
    recorded stages; the CPUs are those the sweep's own records name (another sweep's executions are not)."""
    sweep, spec = _sweep(tmp_path)
    assert S.compute_hours(sweep, spec) == _hand_hours()
    assert S._cpus(sweep, "toy") == ["CPU 0", "CPU 1", "CPU 2", "CPU D", "CPU S"]


def _export(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, dict]:
    """``tcnn study export`` of the toy sweep (its per-image bootstrap left out: the trials have no tables)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.sweep.driver_legs import end_leg, wall_metrics

    monkeypatch.setattr("pipelines.sweep.selection.pair_metrics", lambda *a, **k: {})
    sweep, spec = _sweep(tmp)
    chosen = [{"seed": 0, "tcnn_trial": "t001", "control_trial": "t000", "tcnn_finetune.gate_lr": 1.0,
               "control_finetune.gate_lr": 0.1},
              {"seed": 1, "tcnn_trial": "t002", "control_trial": "t002", "tcnn_finetune.gate_lr": 0.1,
               "control_finetune.gate_lr": 0.1}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(chosen), sweep / "selected.parquet")
    # the driver's wall time: a leg stopped after 100 s, a resumed one finished after 50 s (legs.jsonl)
    end_leg(sweep, time.monotonic() - 100.0, "stopped")
    (sweep / "metrics.json").write_text(json.dumps(wall_metrics(sweep, time.monotonic() - 50.0)))
    out = tmp / "study"
    assert [p.name for p in S.export(sweep, out)] == list(S.FILES)
    return sweep, out, spec


def test_history_csv_carries_each_epochs_training_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fine-tuning epoch's train_time_s (and images_per_s) as the histories recorded them; epoch 0, the
    state before fine-tuning, has none."""
    _, out, _ = _export(tmp_path, monkeypatch)
    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[-2:] == ["train_time_s", "images_per_s"]
    want = {}
    for i, (seed, lr, _, ckey) in enumerate(TRIALS.values()):
        for arm, times in (("tcnn", _finetune_times(i)), ("control", SHARED[("control", ckey)][0])):
            want[(str(seed), arm, f"{lr:g}", "0")] = ("", "")
            want |= {(str(seed), arm, f"{lr:g}", str(e)): (f"{t:.3f}", f"{5000.0 / t:.6g}")
                     for e, t in enumerate(times, 1)}  # fmt: skip
    got = {
        (r["seed"], r["arm"], r["value"], r["epoch"]): (r["train_time_s"], r["images_per_s"]) for r in rows
    }
    assert got == want


def test_cost_csv_has_a_row_per_trial_and_stage_and_recomputes_compute_hours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row per (trial, stage) in the chain's order with the stage's sweep role, and after evaluate the row of
    the pretrained CNN's evaluation; a shared run carries the same key in every trial that used it and its
    recorded numbers; the trial's own stages their own; evaluate's times leave out the CNN evaluation it made,
    which its row carries once per key; the corrupted sets their driver's records."""
    from stages.harness import chain

    sweep, out, spec = _export(tmp_path, monkeypatch)
    rows = T.load(out)["cost"]
    stages = ["pretrain", "reparam", "finetune", "control", "corrupt", "evaluate", "cnn_evaluation"]
    assert [(r["trial"], r["stage"]) for r in rows] == [(t, s) for t in TRIALS for s in stages]
    roles = {s: chain.sweep_role(s) for s in stages[:-1]} | {"cnn_evaluation": "group"}
    assert {(r["stage"], r["role"]) for r in rows} == set(roles.items())
    for i, (tid, (seed, lr, pkey, ckey)) in enumerate(TRIALS.items()):
        by = {r["stage"]: r for r in rows if r["trial"] == tid}
        ekey = CNN_EVAL[tid]["key"]
        assert {s: by[s]["shared_key"] for s in stages} == {"pretrain": pkey, "reparam": None, "finetune": None,
                                                            "control": ckey, "corrupt": "x0", "evaluate": None,
                                                            "cnn_evaluation": ekey}  # fmt: skip
        assert all((r["seed"], r["value"]) == (seed, lr) for r in by.values())
        for stage, key in (("pretrain", pkey), ("control", ckey)):
            times, wall, _, (t0, t1) = SHARED[(stage, key)]
            r = by[stage]
            assert (r["wall_s"], r["stage_wall_s"], r["epochs"], r["cpu"]) == (t1 - t0, wall, 2, "CPU S")
            assert r["train_time_s"] == pytest.approx(sum(times))
        assert (by["finetune"]["wall_s"], by["finetune"]["stage_wall_s"]) == (180.0, 150.0 + i)
        assert (by["finetune"]["train_time_s"], by["finetune"]["epochs"]) == (sum(_finetune_times(i)), 2)
        assert (by["reparam"]["wall_s"], by["reparam"]["stage_wall_s"], by["reparam"]["epochs"]) == (
            5.0,
            4.0,
            None,
        )
        spent = CNN_EVAL[tid]["seconds"]  # the CNN evaluation this trial made: in its own row, not evaluate's
        assert (by["evaluate"]["wall_s"], by["evaluate"]["stage_wall_s"]) == (
            20.0 + i - spent,
            19.0 + i - spent,
        )
        assert by["evaluate"]["cpu"] == f"CPU {i}" and by["evaluate"]["train_time_s"] is None
        made = CNN_RECORDS[ekey][
            "seconds"
        ]  # made by one trial of this sweep, the same in every trial reading it
        cnn = by["cnn_evaluation"]
        assert (cnn["wall_s"], cnn["stage_wall_s"], cnn["cpu"], cnn["train_time_s"]) == (
            made,
            made,
            "CPU S",
            None,
        )
        corrupt = by["corrupt"]
        assert (corrupt["wall_s"], corrupt["stage_wall_s"], corrupt["cpu"]) == (32.0, 30.5, "CPU D")
        assert corrupt["train_time_s"] is None
    assert C.cost_hours(rows) == S.compute_hours(sweep, spec) == _hand_hours()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["compute_h"] == C.cost_hours(rows)
    legs = [json.loads(line)["wall_s"] for line in (sweep / "legs.jsonl").read_text().splitlines()]
    assert len(legs) == meta["legs"] == 2 and meta["wall_s_all_legs"] == pytest.approx(sum(legs))
    assert meta["wall_s_all_legs"] == pytest.approx(150.0, abs=5.0)  # both legs, not the last one's 50 s


def test_the_readme_block_says_which_images_play_which_role_as_the_study_configures_them() -> None:
    """Issue 48: the block prints the data roles. The committed study's trials recorded no data_roles, so they
    come from its preset (pipelines/studies/cifar10_lr.yaml), read here independently of the renderer."""
    import yaml

    from core.robustness.suite import CORRUPTIONS, SEVERITIES

    raw = yaml.safe_load((COMMITTED.parent / "cifar10_lr.yaml").read_text())
    assert "data_roles" not in T.load(COMMITTED)["meta"] and raw["data"].get("val_from", "train") == "train"
    line = next(x for x in _readme_block("cifar10-lr").splitlines() if x.startswith("**Images**"))
    assert f"validation (each arm's lr): {raw['data']['val_size']:,} training images" in line
    assert "carved from the training split; test: the whole test split" in line
    sets = f"{len(CORRUPTIONS)} corruptions x {len(SEVERITIES)} severities = {len(CORRUPTIONS) * len(SEVERITIES)}"
    assert f"{sets} sets of {raw['robustness']['n_images']:,} of those test images each" in line


def test_the_images_paragraph_follows_the_params_and_the_recorded_roles(tmp_path: Path) -> None:
    """Other params give other words (nothing in the paragraph is fixed text about CIFAR-10), and roles the
    trials recorded (core.data.split_roles) win over the params, printed by core.data.roles_text."""
    from core.data import plan_splits, roles_text, split_roles, training_text

    d = _study(tmp_path / "toy")
    (tmp_path / "toy.yaml").write_text("data: {val_size: 1234}\nrobustness: {n_images: 300, corruptions: [fog, "
                                       "snow], severities: [2, 4, 5]}\n")  # fmt: skip
    section, _ = R.render(d)
    line = next(x for x in section.splitlines() if x.startswith("**Images**"))
    assert (
        "1,234 training images (`data.val_size`)" in line
        and "2 corruptions x 3 severities = 6 sets of 300" in line
    )
    assert (
        R.images_paragraph({}, None) == "Which images played which role was not recorded with these tables."
    )

    train, test = np.repeat(np.arange(10), 50), np.repeat(np.arange(10), 20)
    roles = split_roles(
        plan_splits(train, test, val_from="test_half", val_size=0, fraction=1.0, seed=0), train, test
    )
    meta = {"data": {"val_from": "test_half", "val_size": 0, "limit": None}, "data_roles": roles,
            "robustness": {"n_images": 5000, "corruptions": ["fog"], "severities": [1, 2, 3, 4, 5]}}  # fmt: skip
    text = R.images_paragraph(meta, tmp_path / "toy.yaml")
    assert text.startswith("**Images**, as the trials' fine-tuning recorded them (`data_roles`")
    assert f"{training_text(roles)}; {roles_text(roles)}" in text and training_text(roles).startswith(
        "training: 500 training images (50 per class, every training image)"
    )
    assert (
        "1 corruptions x 5 severities = 5 sets of 100 of those test images each" in text
    )  # the 100-image half


def test_export_records_the_trials_data_params_and_roles_and_refuses_trials_that_differ(
    tmp_path: Path,
) -> None:
    from stages.harness import chain

    params = {"data": {"val_from": "test_half", "val_size": 0, "limit": None, "name": "x"},
              "robustness": {"n_images": 100, "corruptions": ["fog"], "severities": [1], "bootstrap": 10}}  # fmt: skip
    spec = {"trials": {"t0": {"params": params}, "t1": {"params": params}}}
    roles = {"val_from": "test_half", "val": {"images": 5}}
    for tid in spec["trials"]:
        path = tmp_path / "trials" / tid / chain.metrics_file("finetune")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"data_roles": roles}))
    got = S.images(tmp_path, spec)
    assert (
        got["data"] == {"val_from": "test_half", "val_size": 0, "limit": None} and got["data_roles"] == roles
    )
    assert got["robustness"] == {"n_images": 100, "corruptions": ["fog"], "severities": [1]}
    (tmp_path / "trials" / "t1" / chain.metrics_file("finetune")).write_text(json.dumps({"data_roles": {}}))
    with pytest.raises(T.StudyError, match="differ in data_roles"):
        S.images(tmp_path, spec)


def test_compute_hours_of_a_search_counts_its_arm_trials_and_a_shared_control_once(tmp_path: Path) -> None:
    """A search's trials are its arm trials (trials/p<k>-<arm>), not the spec's base trial; a control shared by
    two points is counted once, without the epochs it held before this search first used it."""
    from pipelines.sweep.shared import link_pretraining
    from stages.harness import chain

    sweep, storage = tmp_path / "sweeps" / "s", tmp_path / "sweeps"
    tcnn = sweep / "trials" / "p000-tcnn" / chain.output("finetune", "history.json")
    tcnn.parent.mkdir(parents=True)
    tcnn.write_text(
        json.dumps([{"finetune_epoch": e, "train_time_s": t} for e, t in enumerate((1e3, 2e3, 3e3))])
    )
    shared = storage / "control" / "k1" / chain.output("control", "history.json")
    shared.parent.mkdir(parents=True)
    shared.write_text(json.dumps([{"finetune_epoch": e, "train_time_s": 100.0 * (e + 1)} for e in range(4)]))
    for tid, before in (("p000-control", 1), ("p001-control", 3)):
        link_pretraining(sweep / "trials" / tid, storage / "control" / "k1", "control")
        (sweep / "trials" / tid / "trial.json").write_text(json.dumps({"control_epochs_before": before}))
    spec = {"name": "s", "trials": {"t000-abc": {}}}
    assert S.compute_hours(sweep, spec) == round((6000 + 200 + 300 + 400) / 3600, 2)
