"""The committed results of a study and the README section made from them (pipelines/study_results.py): the
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

from pipelines import study_results as S

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
    S._write_csv(tmp / "results.csv", rows, S._columns())
    S._write_csv(tmp / "history.csv", [{"seed": s, "arm": a, "value": lr, "epoch": e, "val_accuracy": 0.8 + e / 100}
                                       for s in range(3) for a in ("tcnn", "control") for lr in LRS for e in range(3)],
                 ["seed", "arm", "value", "epoch", "val_accuracy"])  # fmt: skip
    S._write_csv(tmp / "attention.csv", [{"seed": s, "epoch": e, "layer": "layer4.0.conv1", "head": h,
                                          "inv_alpha": 1.0, "gate": 0.73 - 0.35 * e * (h == 0), "nonlocality": 1.5}
                                         for s in range(3) for e in range(3) for h in range(9)],
                 ["seed", "epoch", "layer", "head", "inv_alpha", "gate", "nonlocality"])  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps({"sweep": "toy", "selected_key": "finetune.lr", "commit": "abc",
                                               "cpus": ["Toy CPU"], "compute_h": 1.25, "trials": 9}))  # fmt: skip
    return tmp


def test_the_table_reselects_on_validation_and_recomputes_the_seed_interval(tmp_path: Path) -> None:
    data = S.load(_study(tmp_path / "r"))
    assert S.reselect(data["rows"]) == {
        (s, a): lr for s in range(3) for a, lr in (("tcnn", 0.001), ("control", 0.0001))
    }
    head = S.headline(data["rows"])["clean_accuracy"]
    diffs = np.array([0.02, 0.025, 0.03])
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / np.sqrt(3)
    assert head["mean"] == pytest.approx(diffs.mean())
    assert (head["low"], head["high"]) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    text = S.markdown(data, "toy", "x")
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
    S._write_csv(d / "results.csv", rows, S._columns())
    with pytest.raises(S.StudyError, match="seed 1: the tcnn row chose 0.01, the validation argmax is 0.001"):
        S.selected(S.load(d)["rows"])


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


def _readme_block(name: str) -> str:
    text = (REPO / "README.md").read_text()
    return text.split(f"<!-- study:{name}:begin -->", 1)[1].split(f"<!-- study:{name}:end -->", 1)[0]


def test_the_readme_table_is_generated_from_the_committed_study_results() -> None:
    """Until the study's tables are committed the README block claims nothing (no number in it); once they are,
    it is exactly what `tcnn study render` makes of them."""
    if not (COMMITTED / "results.csv").exists():
        block = _readme_block("cifar10-lr")
        assert "not finished" in block and not any(ch.isdigit() for ch in block.replace("cifar10_lr", ""))
        assert not any((COMMITTED / f).exists() for f in S.FILES)  # all the tables or none
        return
    section, same = S.render(COMMITTED, REPO / "README.md", check=True)
    assert same, "README.md's study block differs from `tcnn study render pipelines/studies/cifar10_lr`"
    rows = S.load(COMMITTED)["rows"]
    assert len({r["seed"] for r in rows}) >= 3
    assert len({r["tcnn_value"] for r in rows if r["row"] == "grid"}) >= 3
    for fig in S.FIGURES:
        assert (COMMITTED / fig).is_file()


def test_compute_hours_and_cpus_come_from_the_trials_records(tmp_path: Path) -> None:
    """Compute = the kept training epochs of every history (a seed's shared pretraining once) plus the other
    recorded stages; the CPUs are those the sweep's own records name (another sweep's executions are not)."""
    from stages import chain

    sweep = tmp_path / "sweeps" / "toy"
    pre = [{"epoch": e, "train_time_s": 100.0} for e in range(3)]  # 300 s, shared by both trials
    for i, tid in enumerate(("t000", "t001")):
        root = sweep / "trials" / tid
        for stage, hist in (("pretrain", pre), ("finetune", [{"train_time_s": 0}, {"train_time_s": 60.0 + i}]),
                            ("control", [{"train_time_s": 30.0 + 2 * i}])):  # fmt: skip
            path = root / chain.output(stage, "history.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(hist))
        log = [{"stage": "reparam", "started": 10.0, "finished": 15.0, "cpu": f"CPU {i}"},
               {"stage": "finetune", "started": 0.0, "finished": 999.0},  # counted by its history, not here
               {"stage": "control", "shared": "k", "finished": 5.0},
               {"stage": "evaluate", "started": 20.0, "finished": 40.0}]  # fmt: skip
        (root / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    for name, cpu in (("toy", "CPU 2"), ("other", "CPU 9")):
        d = tmp_path / "sweeps" / "pretrain" / name
        d.mkdir(parents=True)
        (d / "executions.jsonl").write_text(json.dumps({"sweep": name, "cpu": cpu}) + "\n")
    spec = {"name": "toy", "trials": {"t000": {}, "t001": {}}}
    seconds = 300 + (60 + 30 + 5 + 20) + (61 + 32 + 5 + 20)
    assert S.compute_hours(sweep, spec) == round(seconds / 3600, 2)
    assert S._cpus(sweep, "toy") == ["CPU 0", "CPU 1", "CPU 2"]
