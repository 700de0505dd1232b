"""`tcnn study run` (issue 48, item 4): the pilot's pooled choice, the power arithmetic, the main seeds and the
answer's block, each checked against a recomputation (scipy's t quantiles and intervals, the sweeps' own
tables); the whole chain as a dry run on a tiny Fashion-MNIST project (real Ray, real MLflow)."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats
from test_sweep import TCNN, make_project, sweep_env

from pipelines.studies import run as study

LRS = [0.01, 0.1]


def _smallest_n(sd: float, target: float = 0.005) -> int:
    """The sizing rule from scipy alone: the smallest n >= 2 with t(0.975, n-1) sd / sqrt(n) <= target."""
    return next(n for n in range(2, 100_000) if stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= target)


def test_power_is_the_smallest_n_that_brings_the_half_width_to_half_a_point() -> None:
    diffs = [
        {"seed": s, "diff_clean_accuracy": d, "diff_mca": 2 * d} for s, d in enumerate([0.004, -0.003, 0.009])
    ]
    got = study.power(diffs, max_seeds=None)
    sd_clean = statistics.stdev([0.004, -0.003, 0.009])
    assert got["per_metric"]["clean_accuracy"]["n"] == _smallest_n(sd_clean)
    assert got["per_metric"]["mca"]["n"] == _smallest_n(2 * sd_clean)
    assert got["n"] == got["asked"] == _smallest_n(2 * sd_clean) and not got["capped"]
    capped = study.power(diffs, max_seeds=3)
    assert capped["n"] == 3 and capped["asked"] == got["asked"] and capped["capped"]
    with pytest.raises(study.StudyRunError, match="2 are needed"):
        study.power(diffs[:1], max_seeds=None)


def _summary(tmp_path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "summary.parquet")
    return tmp_path


def test_pilot_differences_take_each_arm_at_its_own_lr(tmp_path: Path) -> None:
    """T-CNN from the trial at the T-CNN's lr, control from the trial at the control's: a seed missing either
    is left out."""
    rows = []
    for seed in (0, 1, 2):
        for lr in (0.001, 0.01):
            if (seed, lr) == (2, 0.001):
                continue  # seed 2 lacks the control's lr
            rows.append({"seed": seed, "finetune.lr": lr, "status": "finished",
                         "tcnn_clean_accuracy": 0.5 + seed / 10 + lr, "control_clean_accuracy": 0.4 + seed / 10 + 2 * lr,
                         "tcnn_mca": 0.3 + lr, "control_mca": 0.2 + 3 * lr})  # fmt: skip
    got = study.pilot_differences(_summary(tmp_path, rows), {"tcnn": 0.01, "control": 0.001})
    assert [g["seed"] for g in got] == [0, 1]
    for g in got:
        assert g["diff_clean_accuracy"] == pytest.approx(
            (0.5 + g["seed"] / 10 + 0.01) - (0.4 + g["seed"] / 10 + 0.002)
        )
        assert g["diff_mca"] == pytest.approx((0.3 + 0.01) - (0.2 + 0.003))


@pytest.mark.parametrize(
    ("low", "high", "words"),
    [(-0.004, 0.003, "no difference resolved"), (0.002, 0.006, "above its control"), (-0.02, -0.01, "below")],
)
def test_the_sentence_claims_a_difference_only_where_the_interval_excludes_zero(low, high, words) -> None:
    res = {"name": "clean accuracy", "mean": (low + high) / 2, "low": low, "high": high,
           "half_width": (high - low) / 2, "resolved": (high - low) / 2 <= 0.005,
           "sign": "above" if low > 0 else "below" if high < 0 else "spans"}  # fmt: skip
    text = study.sentence(res, "seeds of one CNN")
    assert words in text and f"[{100 * low:+.2f}, {100 * high:+.2f}]" in text
    assert ("within" in text) == ((high - low) / 2 <= 0.005)


def test_the_block_replaces_its_own_markers_only(tmp_path: Path) -> None:
    readme = tmp_path / "R.md"
    readme.write_text("# head\n<!-- study:a:begin -->\nold\n<!-- study:a:end -->\ntail\n")
    study.insert_block(readme, "a", "new\n")
    study.insert_block(readme, "b", "other\n")
    assert readme.read_text() == (
        "# head\n<!-- study:a:begin -->\nnew\n<!-- study:a:end -->\ntail\n"
        "<!-- study:b:begin -->\nother\n<!-- study:b:end -->\n"
    )


PILOTS = [
    (
        {"seed": [0, 1], "finetune.lr": LRS, "reparam.alpha_init": [1.0]},
        {"over": ["finetune.lr"]},
        "nothing else",
    ),
    ({"seed": [0], "finetune.lr": LRS}, {"over": ["finetune.lr"]}, "seed (2 or more)"),
    ({"seed": [0, 1], "finetune.lr": LRS}, {"over": []}, "selects [finetune.lr]"),
]


@pytest.mark.parametrize(("grid", "select", "words"), PILOTS)
def test_a_pilot_it_cannot_run_is_refused(tmp_path: Path, grid, select, words) -> None:
    from core.config import load_params

    with pytest.raises(study.StudyRunError, match=re.escape(words)):
        study.check_pilot(load_params(make_project(tmp_path, grid, sweep={"select": select})))


def test_a_refused_pilot_is_one_line_exit_2_and_nothing_written(tmp_path: Path) -> None:
    grid, select, words = PILOTS[0]
    make_project(tmp_path, grid, sweep={"select": select})
    res = subprocess.run([TCNN, "study", "run", "params.yaml", "--name", "st", "--out", "out"], cwd=tmp_path,
                         env=sweep_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, (
        res.stderr
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "sweeps").exists()


def _run(root: Path) -> subprocess.CompletedProcess:
    cmd = [
        TCNN,
        "study",
        "run",
        "params.yaml",
        "--name",
        "st",
        "--out",
        "out",
        "--readme",
        "R.md",
        "--dry-run",
    ]
    return subprocess.run(cmd, cwd=root, env=sweep_env(), capture_output=True, text=True, timeout=1500)


@pytest.mark.slow
def test_a_dry_run_chains_pilot_power_main_and_block_and_a_rerun_changes_nothing(tmp_path: Path) -> None:
    # one CNN (pretrain.seed) trained enough to be above chance (35% here), so the arms can differ
    make_project(tmp_path, {"seed": [0, 1, 2], "finetune.lr": LRS}, n_train=300,
                 sweep={"select": {"over": ["finetune.lr"], "by": "val_accuracy"}},
                 pretrain={"seed": 0, "epochs": 6, "batch_size": 32}, reparam={"epoch": 6},
                 finetune={"batch_size": 32})  # fmt: skip
    res = _run(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "study.json").read_text())
    pilot, main = tmp_path / "sweeps" / "st-pilot", tmp_path / "sweeps" / "st-main"

    # 1-2. the pilot ran 2 seeds (the dry run's cap) x both lrs; each arm's lr is its best mean validation accuracy
    prow = [r for r in pq.read_table(pilot / "summary.parquet").to_pylist() if r["status"] == "finished"]
    assert sorted((r["seed"], r["finetune.lr"]) for r in prow) == [(s, lr) for s in (0, 1) for lr in LRS]
    lrs = {}
    for arm in ("tcnn", "control"):
        means = {
            lr: statistics.mean(r[f"{arm}_val_accuracy"] for r in prow if r["finetune.lr"] == lr)
            for lr in LRS
        }
        lrs[arm] = max(LRS, key=lambda lr: (means[lr], -LRS.index(lr)))  # ties: the first in grid order
        assert rec["pilot"]["choice"][arm]["lr"] == lrs[arm]
        assert rec["pilot"]["choice"][arm]["interior"] is False  # a 2-value grid has no interior

    # 3. the power arithmetic from the pilot's differences at those lrs, recomputed with scipy
    at = {(r["seed"], r["finetune.lr"]): r for r in prow}
    for metric in ("clean_accuracy", "mca"):
        diffs = [
            at[(s, lrs["tcnn"])][f"tcnn_{metric}"] - at[(s, lrs["control"])][f"control_{metric}"]
            for s in (0, 1)
        ]
        sd = statistics.stdev(diffs)
        assert rec["power"]["per_metric"][metric]["sd"] == pytest.approx(sd)
        assert rec["power"]["per_metric"][metric]["n"] == (_smallest_n(sd) if sd > 0 else 2)
    assert rec["power"]["n"] == 2 and rec["power"]["capped"] == (rec["power"]["asked"] > 2)

    # 4. the main phase: fresh seeds after the pilot's (0, 1 ran), each arm at its pilot lr, nothing selected
    spec = json.loads((main / "sweep.json").read_text())
    assert sorted(t["params"]["seed"] for t in spec["trials"].values()) == [2, 3]
    for t in spec["trials"].values():
        assert (
            t["params"]["finetune"]["lr"] == lrs["tcnn"]
            and t["params"]["finetune"]["control_lr"] == lrs["control"]
        )
    mrow = pq.read_table(main / "summary.parquet").to_pylist()
    for metric in ("clean_accuracy", "mca"):
        d = [r[f"tcnn_{metric}"] - r[f"control_{metric}"] for r in mrow]
        mean, sem = statistics.mean(d), stats.sem(d)
        lo, hi = stats.t.interval(0.95, len(d) - 1, loc=mean, scale=sem) if sem > 0 else (mean, mean)
        got = rec["answer"][metric]
        assert (got["mean"], got["low"], got["high"]) == pytest.approx((mean, lo, hi))
        for model in ("cnn", "control", "tcnn"):
            assert got["means"][model] == pytest.approx(statistics.mean(r[f"{model}_{metric}"] for r in mrow))
    assert rec["answer"]["unit"] == "seeds of one CNN"

    # 5. the block says the same numbers, in the README between its markers
    readme = (tmp_path / "R.md").read_text()
    block = readme.split("<!-- study:st:begin -->\n")[1].split("<!-- study:st:end -->")[0]
    assert block == (tmp_path / "out" / "study.md").read_text()
    assert "a dry run at smoke size" in block
    for metric in ("clean_accuracy", "mca"):
        got = rec["answer"][metric]
        cells = " | ".join(f"{100 * got['means'][m]:.2f}" for m in ("cnn", "control", "tcnn"))
        assert (
            f"| {got['name']} | {cells} | {100 * got['mean']:+.2f} | [{100 * got['low']:+.2f}, {100 * got['high']:+.2f}] |"
            in block
        )
        assert study.sentence(got, rec["answer"]["unit"]) in block
    assert f"lr {lrs['tcnn']:g}" in block and "at an edge of the grid" in block
    assert "1 corruptions x 1 severities (gaussian_noise; severities 1), up to 32 test images" in block

    # resumable: a second run trains nothing and writes the same record
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "sweeps").glob("st-*/trials/*/done.json")}
    assert len(done) == 6
    again = _run(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in done} == done
    assert json.loads((tmp_path / "out" / "study.json").read_text()) == rec
    assert (tmp_path / "R.md").read_text() == readme


def test_the_resnet20_study_is_a_pilot_the_command_runs_and_its_dry_run_is_smoke_sized(
    tmp_path: Path,
) -> None:
    """pipelines/studies/cifar10_resnet20.yaml (issue 48): the release imported, validation from the test half,
    a log lr grid over 3 seeds bracketed; --dry-run keeps the design and caps the size."""
    from core.config import load_params

    weights = tmp_path / "w.th"
    weights.write_bytes(b"stand-in: only its readability is checked here")
    path, at = Path("pipelines/studies/cifar10_resnet20.yaml"), [f"pretrain.source.weights={weights}"]
    params = load_params(path, at)
    study.check_pilot(params)
    assert params.data.val_from == "test_half" and params.data.val_size == 0
    assert params.sweep.grid == {"seed": [0, 1, 2], "finetune.lr": [0.0001, 0.001, 0.01]}
    assert params.sweep.select.bracket is not None and params.finetune.epochs == 12
    sets = [*study.DRY_RUN, *at]
    dry = load_params(path, [*sets, *study.pilot_overrides(load_params(path, sets), True)])
    study.check_pilot(dry)
    assert dry.sweep.grid == {"seed": [0, 1], "finetune.lr": [0.0001, 0.001, 0.01]}
    assert (
        dry.finetune.epochs == 1
        and dry.data.limit.train == 256
        and dry.robustness.corruptions == ["gaussian_noise"]
    )
    assert dry.data.val_from == "test_half" and dry.pretrain.source.sha256 == params.pretrain.source.sha256
