"""`tcnn study run` (issues 48 and 57): each arm's lr from the search (chosen.json, its candidates), the main
seeds' sequential rule (scipy's t quantiles; its coverage by simulation against the fixed-n truth), the answer
(scipy's t interval) and the block's sentences; the whole chain as a dry run on a tiny Fashion-MNIST project
(real Ray, real MLflow), recomputed from the sweeps' own tables."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from scipy import stats
from test_sweep import TCNN, make_project, sweep_env

from pipelines.studies import run as study
from pipelines.studies import sequential, study_block
from pipelines.studies.snapshot import progress_block

SEARCH = {"space": {"finetune.lr": {"loguniform": [0.001, 0.1]}}, "algorithm": "random", "num_samples": 2,
          "seed": 0, "min_finished": 2}  # fmt: skip


def _hw(values: list[float]) -> float:
    """Student's 95% half-width from scipy alone."""
    return stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def test_the_rule_runs_three_seeds_then_one_at_a_time_until_every_half_width_is_half_a_point() -> None:
    tight, wide = [0.010, 0.011, 0.012], [0.0, 0.02, -0.01]
    assert sequential.decide({"a": [], "b": []})["run"] == 3
    assert sequential.decide({"a": tight[:2], "b": tight[:2]})["run"] == 1
    assert _hw(tight) <= 0.005 < _hw(wide)
    assert sequential.decide({"a": tight, "b": tight})["run"] == 0
    step = sequential.decide({"a": tight, "b": wide})  # every metric must be narrow
    assert step["run"] == 1 and step["half_width"]["b"] == pytest.approx(_hw(wide))
    capped = sequential.decide({"a": wide * 3 + [0.0], "b": tight * 3 + [0.0]}, cap=10)
    assert capped["run"] == 0 and "cap" in capped["reason"]
    with pytest.raises(ValueError, match="same seeds"):
        sequential.decide({"a": tight, "b": tight[:2]})


def test_the_simulated_coverage_is_the_t_intervals_where_the_rule_cannot_act() -> None:
    """With the cap at the first seeds the design is a fixed n = 3: coverage must be the t interval's exact
    95% (within 4 Monte-Carlo s.e.); with a target no SD misses, every replicate stops at 3. An early-stopping
    rule that stopped on the first narrow interval from n = 2 would not match the fixed-n truth."""
    fixed = sequential.simulate(0.004, first=3, cap=3, reps=20_000)
    assert fixed["mean_seeds"] == 3 and abs(fixed["coverage"] - 0.95) <= 4 * fixed["mc_se"]
    loose = sequential.simulate(0.004, target=1.0, reps=5_000)
    assert loose["mean_seeds"] == 3 and loose["at_cap"] == 0
    acting = sequential.simulate(0.004, reps=20_000)
    assert (
        3 < acting["mean_seeds"] < 10 and acting["coverage"] < 0.95
    )  # stopping on a small SD costs coverage


def _chosen(tmp_path: Path, candidates: dict[str, int]) -> Path:
    picks = {arm: {"trial": f"p000-{arm}", "finetune.lr": 0.01 if arm == "tcnn" else 0.001, "val_acc": 0.8,
                   "candidates": n, "runner_up": {"trial": f"p001-{arm}", "val_acc": 0.78}, "margin_images": 4,
                   "tie": False} for arm, n in candidates.items()}  # fmt: skip
    (tmp_path / "chosen.json").write_text(json.dumps(picks))
    return tmp_path


def test_each_arm_takes_its_own_choice_and_too_few_candidates_is_refused_unless_forced(
    tmp_path: Path,
) -> None:
    got = study.choice(_chosen(tmp_path, {"tcnn": 3, "control": 4}), 3)
    assert (got["tcnn"]["lr"], got["control"]["lr"]) == (0.01, 0.001)
    assert got["control"]["candidates"] == 4 and got["tcnn"]["margin_images"] == 4
    with pytest.raises(study.StudyRunError, match="control arm chose among 2 finished trial"):
        study.choice(_chosen(tmp_path, {"tcnn": 3, "control": 2}), 3)
    assert (
        study.choice(_chosen(tmp_path, {"tcnn": 3, "control": 2}), 3, force=True)["control"]["candidates"]
        == 2
    )


def test_the_answer_is_scipys_t_interval_over_the_main_seeds() -> None:
    rows = [{"seed": s, **{f"{a}_{m}": 0.5 + 0.01 * s + (0.02 if a == "tcnn" else 0.0)
                           for a in study.MODELS for m in ("clean_accuracy", "mca", "mce")},
             **{f"diff_{m}": d for m in ("clean_accuracy", "mca", "mce")}}
            for s, d in ((1, 0.004), (2, 0.009), (3, 0.001))]  # fmt: skip
    got = study.answer(rows, "seeds of one CNN")
    d = [0.004, 0.009, 0.001]
    lo, hi = stats.t.interval(0.95, 2, loc=statistics.mean(d), scale=stats.sem(d))
    for m in ("clean_accuracy", "mca", "mce"):
        assert (got[m]["low"], got[m]["high"]) == pytest.approx((lo, hi))
        assert got[m]["means"]["tcnn"] == pytest.approx(0.52 + 0.02)
    assert got["mce"]["lower_is_better"] and not got["mce"]["sized"]


@pytest.mark.parametrize(
    ("low", "high", "lower_better", "words"),
    [(-0.004, 0.003, False, "no difference resolved"), (0.002, 0.006, False, "above its control, better"),
     (-0.02, -0.01, False, "below its control, worse"), (-0.02, -0.01, True, "below its control, better")],
)  # fmt: skip
def test_the_sentence_claims_a_difference_only_where_the_interval_excludes_zero(
    low, high, lower_better, words
) -> None:
    res = {"name": "mCE" if lower_better else "clean accuracy", "mean": (low + high) / 2, "low": low,
           "high": high, "half_width": (high - low) / 2, "resolved": (high - low) / 2 <= 0.005,
           "sign": "above" if low > 0 else "below" if high < 0 else "spans", "lower_is_better": lower_better,
           "sized": not lower_better}  # fmt: skip
    text = study_block.sentence(res, "seeds of one CNN")
    assert words in text and f"[{100 * low:+.2f}, {100 * high:+.2f}]" in text
    assert ("within" in text) == (not lower_better and (high - low) / 2 <= 0.005)


def test_the_block_replaces_its_own_markers_only(tmp_path: Path) -> None:
    readme = tmp_path / "R.md"
    readme.write_text("# head\n<!-- study:a:begin -->\nold\n<!-- study:a:end -->\ntail\n")
    study_block.insert_block(readme, "a", "new\n")
    study_block.insert_block(readme, "b", "other\n")
    assert readme.read_text() == (
        "# head\n<!-- study:a:begin -->\nnew\n<!-- study:a:end -->\ntail\n"
        "<!-- study:b:begin -->\nother\n<!-- study:b:end -->\n"
    )


REFUSED = [
    (
        {"search": {**SEARCH, "space": {"finetune.gate_lr": {"loguniform": [0.01, 1.0]}}}},
        "over finetune.lr alone",
    ),
    ({}, "over finetune.lr alone"),
]


@pytest.mark.parametrize(("sweep", "words"), REFUSED)
def test_a_design_it_cannot_run_is_refused(tmp_path: Path, sweep, words) -> None:
    from pipelines.sweep.sweep_params import load_sweep_params

    params = load_sweep_params(
        make_project(tmp_path, {}, sweep=sweep)
    )  # a grid beside a search: core.config refuses
    with pytest.raises(study.StudyRunError, match=re.escape(words)):
        study.check_search(params)


def test_a_refused_design_is_one_line_exit_2_and_nothing_written(tmp_path: Path) -> None:
    make_project(tmp_path, {}, sweep={"search": SEARCH}, finetune={"control_lr": 0.01})
    res = subprocess.run([TCNN, "study", "run", "params.yaml", "--name", "st", "--out", "out"], cwd=tmp_path,
                         env=sweep_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2 and "control_lr" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "sweeps").exists()


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


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
def test_a_dry_run_chains_search_seeds_and_block_and_a_rerun_changes_nothing(tmp_path: Path) -> None:
    # one CNN (pretrain.seed) trained enough to be above chance, so the arms can differ
    make_project(tmp_path, {}, n_train=300, sweep={"search": SEARCH},
                 pretrain={"seed": 0, "epochs": 6, "batch_size": 32}, reparam={"epoch": 6},
                 finetune={"batch_size": 32})  # fmt: skip
    res = _run(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "study.json").read_text())
    search = tmp_path / "sweeps" / "st-search"

    # 1. each arm's lr: its best validation accuracy among its finished search trials (the search's own rows)
    rows = pq.read_table(search / "search.parquet").to_pylist()
    lrs = {}
    for arm in ("tcnn", "control"):
        done = [r for r in rows if r["arm"] == arm and r["status"] == "finished"]
        best = max(done, key=lambda r: r["val_acc"])
        lrs[arm] = best["finetune.lr"]
        got = rec["search"]["choice"][arm]
        assert got["lr"] == pytest.approx(lrs[arm]) and got["candidates"] == len(done) == 2
        assert got["val_accuracy"] == pytest.approx(best["val_acc"])

    # 2. the main seeds: fresh (the search ran seed 0), one sweep each, each arm at its chosen lr
    assert [s["seed"] for s in rec["main"]["seeds"]] == [1, 2]
    per_seed = []
    for s in (1, 2):
        spec = json.loads((tmp_path / "sweeps" / f"st-seed{s}" / "sweep.json").read_text())
        (trial,) = spec["trials"].values()
        ft = trial["params"]["finetune"]
        assert trial["params"]["seed"] == s
        assert ft["lr"] == pytest.approx(lrs["tcnn"]) and ft["control_lr"] == pytest.approx(lrs["control"])
        per_seed += pq.read_table(tmp_path / "sweeps" / f"st-seed{s}" / "summary.parquet").to_pylist()

    # 3. the answer: scipy's t interval over the main seeds; each model's mean
    for metric in ("clean_accuracy", "mca", "mce"):
        d = [r[f"tcnn_{metric}"] - r[f"control_{metric}"] for r in per_seed]
        mean, sem = statistics.mean(d), stats.sem(d)
        lo, hi = stats.t.interval(0.95, len(d) - 1, loc=mean, scale=sem) if sem > 0 else (mean, mean)
        got = rec["answer"][metric]
        assert (got["mean"], got["low"], got["high"]) == pytest.approx((mean, lo, hi))
        for model in ("cnn", "control", "tcnn"):
            assert got["means"][model] == pytest.approx(
                statistics.mean(r[f"{model}_{metric}"] for r in per_seed)
            )
    assert rec["answer"]["unit"] == "seeds of one CNN" and rec["state"].startswith("finished: 2 main seeds")

    # 4. the block says the same numbers, in the README between its markers; the CSVs hold the rows
    readme = (tmp_path / "R.md").read_text()
    block = readme.split("<!-- study:st:begin -->\n")[1].split("<!-- study:st:end -->")[0]
    assert block == (tmp_path / "out" / "study.md").read_text() and "a dry run at smoke size" in block
    for metric in ("clean_accuracy", "mca", "mce"):
        got = rec["answer"][metric]
        cells = " | ".join(f"{100 * got['means'][m]:.2f}" for m in ("cnn", "control", "tcnn"))
        assert f"| {got['name']} | {cells} | {100 * got['mean']:+.2f} |" in block
        assert study_block.sentence(got, rec["answer"]["unit"]) in block
    assert f"T-CNN: lr {lrs['tcnn']:.3g}" in block and "among 2 trials that trained every epoch" in block
    assert "1 corruptions x 1 severities (gaussian_noise; severities 1), up to 32 test images" in block
    assert len((tmp_path / "out" / "search.csv").read_text().splitlines()) == 1 + len(rows)
    assert len((tmp_path / "out" / "main.csv").read_text().splitlines()) == 3

    # the block again from the committed outputs alone (`tcnn study render OUT`): the same text, README up to date
    render = subprocess.run([TCNN, "study", "render", "out", "--readme", "R.md", "--check"], cwd=tmp_path,
                            env=sweep_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert render.returncode == 0, render.stderr

    # resumable: a second run trains nothing and writes the same record
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "sweeps").glob("st-*/trials/*/done.json")}
    assert len(done) == 4 + 2
    again = _run(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in done} == done
    assert json.loads((tmp_path / "out" / "study.json").read_text()) == rec
    assert (tmp_path / "R.md").read_text() == readme

    # a fresh machine (issue 57): only what was committed survives, the project and the snapshot's trial records;
    # run from another folder, the study replays every trial (no training, no checkpoint) to the same answer
    snap = subprocess.run([TCNN, "study", "snapshot", "--sweeps", "sweeps", "--name", "st", "--out", "out",
                           "--readme", "P.md", "--docs", "D.md"],
                          cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert snap.returncode == 0, snap.stderr
    for page, table in (
        ("P.md", False),
        ("D.md", True),
    ):  # the progress blocks: the README's lines, docs' table
        block = progress_block(tmp_path / "out", table=table)
        assert (
            tmp_path / page
        ).read_text() == f"<!-- study:st-progress:begin -->\n{block}<!-- study:st-progress:end -->\n"
    assert (
        "| p000-tcnn |" in (tmp_path / "D.md").read_text() and "| p0" not in (tmp_path / "P.md").read_text()
    )
    records = sorted((tmp_path / "out" / "trials").glob("st-*/*.json"))
    assert [f"{p.parent.name}/{p.stem}" for p in records] == sorted(
        f"{p.parents[2].name}/{p.parent.name}" for p in done
    )
    assert all(json.loads(p.read_text())["state"] == "finished" for p in records)
    assert not any(".pt" in name for p in records for name in json.loads(p.read_text())["files"])
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path, elsewhere, ignore=shutil.ignore_patterns("sweeps", "mlruns*", "elsewhere"))
    fresh = _run(elsewhere)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    moved = json.loads((elsewhere / "out" / "study.json").read_text())
    assert moved["search"]["choice"] == rec["search"]["choice"] and moved["answer"] == rec["answer"]
    assert moved["attention"] == rec["attention"] and moved["state"] == rec["state"]
    assert (elsewhere / "out" / "search.csv").read_text() == (tmp_path / "out" / "search.csv").read_text()
    seeds = [_csv(d / "out" / "main.csv") for d in (tmp_path, elsewhere)]  # compute: this machine's sets too
    assert [{k: v for k, v in r.items() if k != "compute_h"} for r in seeds[1]] == [
        {k: v for k, v in r.items() if k != "compute_h"} for r in seeds[0]
    ]
    trials = list((elsewhere / "sweeps").glob("st-*/trials/*"))
    assert len(trials) == len(done) and not list((elsewhere / "sweeps").glob("st-*/trials/*/**/*.pt"))
    assert all("replay: " in (t / "trial.log").read_text() for t in trials)
    said = fresh.stdout + fresh.stderr  # each seed's corrupted sets: not built where no trial evaluates
    assert (
        said.count("every trial is recorded (--records)") == 2
        and not (elsewhere / "sweeps" / "corrupt").exists()
    )
    assert (tmp_path / "sweeps" / "corrupt").is_dir()  # where the first run built them


def test_the_resnet20_study_is_a_search_the_command_runs_and_its_dry_run_is_smoke_sized(
    tmp_path: Path,
) -> None:
    """pipelines/studies/cifar10_resnet20.yaml (issue 57): the release imported, validation from the test half,
    each arm's lr searched on a range holding the paper's 1e-4 with >= 3 candidates; --dry-run keeps the design
    and caps the size."""
    from pipelines.sweep.sweep_params import load_sweep_params

    weights = tmp_path / "w.th"
    weights.write_bytes(b"stand-in: only its readability is checked here")
    path, at = Path("pipelines/studies/cifar10_resnet20.yaml"), [f"pretrain.source.weights={weights}"]
    params = load_sweep_params(path, at)
    study.check_search(params)
    assert params.data.val_from == "test_half" and params.data.val_size == 0
    (kind, (lo, hi)), = params.sweep.search.space["finetune.lr"].items()  # fmt: skip
    assert kind == "loguniform" and lo < 1e-4 < hi and params.sweep.search.min_finished >= 3
    assert params.sweep.scheduler is not None and params.finetune.stop is None
    dry = load_sweep_params(path, [*study.DRY_RUN, *at])
    study.check_search(dry)
    assert (
        dry.finetune.epochs == 1
        and dry.data.limit.train == 256
        and dry.robustness.corruptions == ["gaussian_noise"]
    )
    assert dry.sweep.search.num_samples == 2 and dry.sweep.scheduler is None
    assert dry.data.val_from == "test_half" and dry.pretrain.source.sha256 == params.pretrain.source.sha256


def _block(name: str) -> str:
    text = Path("docs/studies.md").read_text()
    return text.split(f"<!-- {name}:begin -->\n")[1].split(f"<!-- {name}:end -->")[0]


def test_the_docs_coverage_and_price_tables_are_the_ones_the_code_prints() -> None:
    """docs/studies.md's tables of issue 57's design: the rule's simulated coverage (pipelines.studies.sequential)
    and the design's price at the AVX2 EPYC's rates (benchmarks/trial_cost_resnet20.py --design-only)."""
    assert _block("sequential:coverage") == sequential.table()
    res = subprocess.run([".venv/bin/python", "benchmarks/trial_cost_resnet20.py", "--design-only"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert _block("design:price").strip() == res.stdout.strip()
