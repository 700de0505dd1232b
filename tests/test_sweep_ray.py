"""`tcnn sweep` end to end: real Ray (local), real MLflow (sqlite under tmp_path), tiny Fashion-MNIST slice."""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from test_sweep import TCNN, make_project, sweep_env

from pipelines.sweep.sweep_params import load_sweep_params
from stages.tracking.names import flatten_params
from stages.tracking.store import store_client

pytestmark = pytest.mark.slow

GRID = {"reparam.epoch": [1, 2], "reparam.alpha_init": [0.5, 2.0]}


def mlflow_runs(root: Path, experiment: str = "sweeps") -> list[Any]:
    client = store_client(
        f"sqlite:///{root / 'mlruns.db'}"
    )  # under the store lock: the driver may be creating it
    exp = client.get_experiment_by_name(experiment)
    return list(client.search_runs([exp.experiment_id], max_results=1000)) if exp else []


def sweep_runs(root: Path, name: str) -> tuple[Any, list[Any]]:
    """The sweep's one parent run and its children (asserting there is exactly one parent)."""
    runs = mlflow_runs(root)
    parents = [
        r for r in runs if r.data.tags.get("tcnn.kind") == "parent" and r.data.tags.get("tcnn.sweep") == name
    ]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    pid = parents[0].info.run_id
    return parents[0], [r for r in runs if r.data.tags.get("mlflow.parentRunId") == pid]


def stage_counts(trial_dir: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    path = trial_dir / "stages.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        stage = json.loads(line)["stage"]
        counts[stage] = counts.get(stage, 0) + 1
    return counts


def pretrain_epoch_lines(sweep_dir: Path) -> int:
    """Epoch lines the pretrain stage itself printed into the trials' logs (one per pretraining run)."""
    return sum(p.read_text().count("pretrain epoch 1/") for p in sweep_dir.glob("trials/*/trial.log"))


def run_sweep(root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", *args],
        cwd=root, env=sweep_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_sweep_2x2_one_pretraining_mlflow_parent_children_and_reuse(tmp_path: Path) -> None:
    path = make_project(tmp_path, GRID)
    res = run_sweep(tmp_path, "--name", "a")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "a"

    # One pretraining run, keeping both t1 checkpoints; every trial links to it.
    assert pretrain_epoch_lines(sweep_dir) == 1
    (group,) = (tmp_path / "sweeps" / "pretrain").iterdir()
    assert len((group / "executions.jsonl").read_text().splitlines()) == 1
    assert sorted(p.name for p in (group / "runs/pretrain/ckpt").iterdir()) == [
        "ckpt-epoch-001.pt",
        "ckpt-epoch-002.pt",
    ]
    trials = sorted((sweep_dir / "trials").iterdir())
    assert len(trials) == 4
    # One matched control per t1 (alpha only changes the reparameterization), shared by its two trials.
    controls = sorted((tmp_path / "sweeps" / "control").iterdir())
    assert len(controls) == 2
    assert all(len((c / "executions.jsonl").read_text().splitlines()) == 1 for c in controls)
    assert all((t / "runs" / "control").is_symlink() for t in trials)
    for t in trials:
        assert (t / "runs" / "pretrain").resolve() == (group / "runs" / "pretrain").resolve()
        assert (
            stage_counts(t).get("reparam")
            == stage_counts(t).get("finetune")
            == stage_counts(t).get("evaluate")
            == 1
        )
    # One corrupted-set directory for the sweep, used by every trial; the driver's execution timed.
    (corrupted,) = (tmp_path / "sweeps" / "corrupt").iterdir()
    (run,) = [json.loads(line) for line in (sweep_dir / "corrupt_runs.jsonl").read_text().splitlines()]
    assert run["key"] == corrupted.name and run["finished"] > run["started"] and run["stage_wall_s"] > 0
    # One evaluation of the pretrained CNN (every trial's is the group's cnn-final.pt): made by one trial, read
    # by the three others, the same CNN numbers in all four.
    (evaluation,) = (tmp_path / "sweeps" / "cnn_evaluation").iterdir()
    evaluated = [json.loads((t / "results" / "metrics.json").read_text()) for t in trials]
    assert sorted(m["cnn_evaluation"]["source"] for m in evaluated) == [
        "computed",
        "shared",
        "shared",
        "shared",
    ]
    assert {m["cnn_evaluation"]["key"] for m in evaluated} == {evaluation.name}
    assert all(m["cnn"] == evaluated[0]["cnn"] for m in evaluated)

    # MLflow: one parent (trials=4, pretrain_runs=1) + 4 FINISHED children with the DVC path's param names.
    parent, children = sweep_runs(tmp_path, "a")
    assert parent.info.status == "FINISHED"
    # the last line links the parent's page in the UI's training workflow (core.utils.mlflow_ui)
    exp_id, run_id = parent.info.experiment_id, parent.info.run_id
    assert (
        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{run_id}?workflowType=machine_learning"
        in res.stdout
    )
    assert parent.data.metrics["trials"] == 4 and parent.data.metrics["pretrain_runs"] == 1
    assert json.loads(parent.data.params["grid.reparam.epoch"]) == [1, 2]
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}
    assert len({c.data.tags["tcnn.trial"] for c in children}) == 4
    for c in children:  # each trial's description: what it is, then its own T-CNN - control with the interval
        note = c.data.tags["mlflow.note.content"]
        assert f"trial {c.data.tags['tcnn.trial']} · dataset " in note and "both arms" in note, note
        assert "| **T-CNN − control** (pp, 95% interval) |" in note, note
    combos = {(int(c.data.params["reparam_epoch"]), float(c.data.params["alpha_init"])) for c in children}
    assert combos == set(itertools.product(GRID["reparam.epoch"], GRID["reparam.alpha_init"]))
    dvc_names = set(
        flatten_params(load_sweep_params(path).with_overrides({"sweep.grid": {}}))
    )  # as `dvc repro` logs
    for c in children:
        assert set(c.data.params) == dvc_names
        assert 0.0 <= c.data.metrics["tcnn_clean_accuracy"] <= 1.0
        assert "epoch/val_acc" in c.data.metrics  # per-epoch fine-tuning metrics, the DVC path's names
    artifacts = {a.path for a in _artifacts(tmp_path, parent.info.run_id)}
    assert {"summary.parquet", "plots"} <= artifacts

    # Summary table: one row per trial, the grid values and the headline numbers of each trial's own files.
    table = pq.read_table(sweep_dir / "summary.parquet").to_pylist()
    assert len(table) == 4
    for row in table:
        metrics = json.loads((Path(row["trial_dir"]) / "results/metrics.json").read_text())
        assert row["tcnn_clean_accuracy"] == pytest.approx(metrics["tcnn"]["clean_accuracy"])
        assert row["cnn_mce"] == pytest.approx(metrics["cnn"]["mce"])
        assert row["status"] == "finished"
    assert (sweep_dir / "plots" / "accuracy_vs_t1.png").is_file()
    assert not (sweep_dir / "plots" / "alpha_lambda_heatmap.png").exists()  # lambda does not vary
    assert not (sweep_dir / "plots" / "accuracy_vs_fraction.png").exists()

    # A second sweep over the same store: the pretraining is reused, none executed.
    res2 = run_sweep(tmp_path, "--name", "b")
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    parent_b, children_b = sweep_runs(tmp_path, "b")
    assert parent_b.data.metrics["pretrain_runs"] == 0 and parent_b.data.metrics["trials"] == 4
    assert len(children_b) == 4 and {c.info.status for c in children_b} == {"FINISHED"}
    assert pretrain_epoch_lines(tmp_path / "sweeps" / "b") == 0
    assert len((group / "executions.jsonl").read_text().splitlines()) == 1
    assert "pretraining reused" in res2.stdout
    assert res2.stdout.count("finetune reused (test acc") == 4 and "finetune trained" not in res2.stdout
    trials_b = sorted((tmp_path / "sweeps" / "b" / "trials").iterdir())
    notes = [json.loads((t / "results" / "metrics.json").read_text())["cnn_evaluation"] for t in trials_b]
    assert {(n["source"], n["key"]) for n in notes} == {("shared", evaluation.name)}  # the first sweep's
    # ... and each trial's T-CNN fine-tuning is the first sweep's same trial's (pipelines.sweep.reuse), not retrained
    for t in trials_b:
        lines = [json.loads(line) for line in (t / "stages.jsonl").read_text().splitlines()]
        assert [ln.get("reused") for ln in lines if ln["stage"] == "finetune"] == [
            str(sweep_dir / "trials" / t.name)
        ]
        assert (t / "runs/finetune/history.json").read_bytes() == (
            sweep_dir / "trials" / t.name / "runs/finetune/history.json"
        ).read_bytes()


def _artifacts(root: Path, run_id: str) -> list[Any]:
    return store_client(f"sqlite:///{root / 'mlruns.db'}").list_artifacts(run_id)


@contextlib.contextmanager
def background_driver(
    root: Path, name: str, ready: Callable[[], bool], what: str, poll_s: float
) -> Iterator[subprocess.Popen]:
    """`tcnn sweep --name NAME` in the background (output in ``root/driver1.log``), yielded once ``ready()``
    holds; a driver still running when the block ends is killed."""
    with open(root / "driver1.log", "w") as log:
        proc = subprocess.Popen(
            [TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", name],
            cwd=root, env=sweep_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while not ready():
                assert proc.poll() is None, (root / "driver1.log").read_text()[-3000:]
                assert time.monotonic() < deadline, what
                time.sleep(poll_s)
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_kill_driver_then_resume_finishes_each_trial_once(tmp_path: Path) -> None:
    make_project(tmp_path, GRID, finetune={"epochs": 2})
    sweep_dir = tmp_path / "sweeps" / "k"
    finished = lambda: any(sweep_dir.glob("trials/*/done.json"))  # noqa: E731
    with background_driver(tmp_path, "k", finished, "no trial finished", poll_s=0.2) as proc:
        proc.send_signal(signal.SIGKILL)  # the driver, mid-sweep
        proc.wait()
    done_before = {p.parent.name for p in sweep_dir.glob("trials/*/done.json")}
    assert 1 <= len(done_before) < 4, "the sweep was not interrupted mid-way"
    stages_before = {t: stage_counts(sweep_dir / "trials" / t) for t in done_before}
    runs_before = {
        t: json.loads((sweep_dir / "trials" / t / "done.json").read_text())["mlflow_run_id"]
        for t in done_before
    }
    _, children = sweep_runs(tmp_path, "k")
    assert len(children) <= 4

    res = run_sweep(tmp_path, "--name", "k", "--resume")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resuming from" in res.stdout
    parent, children = sweep_runs(tmp_path, "k")
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials"] == 4 and parent.data.metrics["pretrain_runs"] == 1
    assert len(children) == 4, [c.info.run_name for c in children]
    assert len({c.data.tags["tcnn.trial"] for c in children}) == 4  # none duplicated
    assert {c.info.status for c in children} == {"FINISHED"}
    for t in (sweep_dir / "trials").iterdir():
        counts = stage_counts(t)
        assert counts.get("reparam") == counts.get("finetune") == counts.get("evaluate") == 1, (
            t.name,
            counts,
        )
        if t.name in done_before:  # finished before the kill: not run again
            assert counts == stages_before[t.name]
            assert json.loads((t / "trial.json").read_text())["attempts"] == 1
            assert {c.data.tags["tcnn.trial"]: c.info.run_id for c in children}[t.name] == runs_before[t.name]
    assert pretrain_epoch_lines(sweep_dir) == 1


def _processes_in(root: Path) -> list[int]:
    """Pids of the processes whose working directory is inside ``root`` (the driver's Ray workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cwd = (proc / "cwd").resolve()
        except OSError:
            continue
        if proc.name.isdigit() and cwd.is_relative_to(root):
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize(
    ("sig", "status", "resume"),
    [(signal.SIGTERM, 75, True), (signal.SIGINT, 130, False)],
    ids=["SIGTERM-then-resume", "SIGINT"],
)
def test_a_stopped_driver_ends_its_trials_and_closes_its_runs(
    tmp_path: Path, sig: int, status: int, resume: bool
) -> None:
    """A stop signal to `tcnn sweep` mid-trial: the conventional status and one line, the parent and the trial
    runs KILLED (none left RUNNING), no Ray worker left behind; --auto-resume then finishes every trial in
    the same runs."""
    # two trials; 10 fine-tuning epochs per arm, so a trial whose first epoch is reported has 9 of its own and
    # its control's 10 ahead (the whole tiny sweep of 2 epochs took under 2 s on an idle AVX-512 EPYC: a stop
    # sent 2 s after a trial started found it finished; 20 epochs cost the resume ~55 s more on the AVX2 EPYC)
    make_project(
        tmp_path, {"reparam.alpha_init": [0.5, 2.0]}, finetune={"epochs": 10, "checkpoint_every_steps": 2}
    )
    log = tmp_path / "driver1.log"
    fine_tuning = lambda: "finetune epoch 1 val_acc" in log.read_text()  # noqa: E731
    with background_driver(tmp_path, "s", fine_tuning, "no trial fine-tuned an epoch", poll_s=0.1) as proc:
        assert set(_processes_in(tmp_path)) - {proc.pid}, "no Ray process runs in the project"
        assert "done:" not in log.read_text(), "a trial finished before the stop signal"
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
    out = (tmp_path / "driver1.log").read_text()
    assert code == status, out[-3000:]
    assert f"tcnn sweep: stopped by {signal.Signals(sig).name}; run it again with --resume to continue" in out
    assert "Traceback" not in out
    parent, children = sweep_runs(tmp_path, "s")
    assert parent.info.status == "KILLED"
    assert children and {c.info.status for c in children} == {"KILLED"}
    assert not (tmp_path / "sweeps/s/summary.parquet").exists()  # no summary of a half-run grid
    deadline = time.monotonic() + 30
    while _processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_in(tmp_path) == []
    if not resume:
        return

    res = run_sweep(tmp_path, "--name", "s", "--resume")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    parent, again = sweep_runs(tmp_path, "s")
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials"] == 2
    assert len(again) == 2 and {c.info.status for c in again} == {"FINISHED"}
    assert {c.info.run_id for c in children} <= {c.info.run_id for c in again}  # reopened, not duplicated
    assert len({c.data.tags["tcnn.trial"] for c in again}) == 2
    assert pretrain_epoch_lines(tmp_path / "sweeps/s") >= 1


@pytest.mark.parametrize("kinds", [["cnn", "tcnn"]])
def test_model_kind_grid(tmp_path: Path, kinds: list[str]) -> None:
    """A model.kind grid: cnn and tcnn share one pretraining; only tcnn converts."""
    make_project(tmp_path, {"model.kind": kinds})
    res = run_sweep(tmp_path, "--name", "kinds")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "kinds"
    rows = {r["model.kind"]: r for r in pq.read_table(sweep_dir / "summary.parquet").to_pylist()}
    assert set(rows) == set(kinds)
    for kind, row in rows.items():
        eq = json.loads((Path(row["trial_dir"]) / "runs/reparam/equivalence.json").read_text())
        assert eq["converted"] is (kind == "tcnn")
        assert row["tcnn_clean_accuracy"] is not None and row["tcnn_mce"] is not None
    assert pretrain_epoch_lines(sweep_dir) == 1
    assert (sweep_dir / "plots" / "accuracy_by_kind.png").is_file()
    kinds_md = (sweep_dir / "kinds.md").read_text()  # one row per kind + the common baseline row
    assert all(f"| {k} | resnet10_cifar |" in kinds_md for k in [*kinds, "cnn (pretrained, baseline)"])
    page = (sweep_dir / "report.html").read_text()
    assert "Model kinds" in page and "accuracy_by_kind" in page
    parent = json.loads((sweep_dir / "metrics.json").read_text())  # what the parent run logged
    for name in ("baseline", *kinds):
        assert 0.0 <= parent[f"kind_{name}_clean_accuracy"] <= 1.0 and parent[f"kind_{name}_mce"] > 0
    assert parent["kind_baseline_mce"] == pytest.approx(1.0)  # the baseline against itself
    assert parent["best_tcnn_clean_accuracy"] == pytest.approx(rows["tcnn"]["tcnn_clean_accuracy"])


def test_seed_grid_aggregates_each_configuration_over_seeds(tmp_path: Path) -> None:
    """A grid holding `seed`: per configuration, the mean over seeds with Student's t-interval in
    summary.parquet, seeds.parquet, the sweep report and the parent run."""
    import numpy as np
    from scipy import stats

    make_project(tmp_path, {"seed": [0, 1], "reparam.alpha_init": [0.5]})
    res = run_sweep(tmp_path, "--name", "s")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "s"
    rows = pq.read_table(sweep_dir / "summary.parquet").to_pylist()
    assert len(rows) == 2 and {r["seed"] for r in rows} == {0, 1}
    (agg,) = pq.read_table(sweep_dir / "seeds.parquet").to_pylist()
    assert agg["config"] == "alpha=0.5" and agg["n_seeds"] == 2
    for metric in ("tcnn_clean_accuracy", "tcnn_minus_control_clean_accuracy", "tcnn_minus_control_mca"):
        vals = np.array([r[metric] for r in rows])
        sem = stats.sem(vals)  # scipy gives nan for zero spread; the interval is then the point
        lo, hi = (
            stats.t.interval(0.95, 1, loc=vals.mean(), scale=sem) if sem > 0 else (vals.mean(), vals.mean())
        )
        assert agg[f"{metric}_seeds_mean"] == pytest.approx(vals.mean())
        assert (agg[f"{metric}_seeds_ci_low"], agg[f"{metric}_seeds_ci_high"]) == pytest.approx((lo, hi))
        assert all(
            r[f"{metric}_seeds_mean"] == pytest.approx(vals.mean()) for r in rows
        )  # in summary.parquet too
    parent, _ = sweep_runs(tmp_path, "s")
    key = "seeds/alpha_0.5/tcnn_minus_control_clean_accuracy_seeds_mean"  # MLflow names take no "="
    assert parent.data.metrics[key] == pytest.approx(agg["tcnn_minus_control_clean_accuracy_seeds_mean"])
    assert "Over seeds" in (sweep_dir / "report.html").read_text()
    assert "alpha=0.5" in (sweep_dir / "seeds.md").read_text()


def test_bracketing_grows_the_lr_grid_past_an_edge_choice(tmp_path: Path) -> None:
    """``sweep.select.bracket`` on a real sweep: with two lrs every choice is at an edge, so round 1 adds one
    step beyond each edge some arm chose (the selection's validation argmax, re-derived here from
    summary.parquet); the asked trials are not run again, and the bound (1 round) ends it, reported."""
    from pipelines.sweep.selection import choose

    key = "finetune.lr"
    sweep = {"select": {"over": [key], "bracket": {"max_rounds": 1}}}
    make_project(tmp_path, {key: [0.001, 0.01]}, n_train=200, sweep=sweep)
    res = run_sweep(tmp_path, "--name", "br")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "br"
    rows = pq.read_table(sweep_dir / "summary.parquet").to_pylist()
    first = [r for r in rows if r["bracket_round"] == 0]
    assert sorted(r[key] for r in first) == [0.001, 0.01]
    picks = {p[key] for p in choose(first, [key], [key])}
    want = sorted(({0.0001} if 0.001 in picks else set()) | ({0.1} if 0.01 in picks else set()))
    record = json.loads((sweep_dir / "bracket.json").read_text())
    assert [r["added"] for r in record["rounds"]] == [want]
    assert sorted(r[key] for r in rows if r["bracket_round"] == 1) == want
    assert all(r["status"] == "finished" for r in rows) and len(rows) == 2 + len(want)
    assert all(stage_counts(Path(r["trial_dir"])).get("finetune") == 1 for r in rows)  # none ran twice
    assert (sweep_dir / "tune-bracket1").is_dir()
    assert record["stop"].startswith((f"{key}: every arm's choice is interior after 1 round",
                                      f"{key}: still at the edge after 1 round (max_rounds 1)"))  # fmt: skip
    assert "Bracketing" in (sweep_dir / "selected.md").read_text() and record["stop"] in res.stdout
    parent, children = sweep_runs(tmp_path, "br")
    assert parent.info.status == "FINISHED" and len(children) == len(rows)
    assert parent.data.metrics["bracket_rounds"] == 1 and parent.data.metrics["trials"] == len(rows)
    assert json.loads(parent.data.params[f"grid.{key}"]) == [0.001, 0.01]  # the grid that was asked for
    assert parent.data.tags["tcnn.bracket.added"].startswith(f"round 1: {key}=")
    assert parent.data.tags["tcnn.bracket.stop"] == record["stop"]


def test_a_refused_grid_point_fails_once_with_its_line_and_is_not_rerun(tmp_path: Path) -> None:
    """A grid point a stage refuses (a reparam pattern that matches no conv: a StageError, deterministic) is
    not retried by Ray (sweep.max_failures covers faults), shows no Ray traceback, and ends as `refused` with
    the stage's one line in the summary, on its FAILED MLflow run and in the driver's output; the other point
    finishes; a resumed driver does not run the refused one again."""
    make_project(tmp_path, {"reparam.stages": [[-1], ["nomatch.*"]]}, sweep={"max_failures": 2})
    res = run_sweep(tmp_path, "--name", "r")
    said = res.stdout + res.stderr
    assert res.returncode == 1, said[-3000:]  # a trial did not finish: the sweep says so in its status
    assert "Traceback" not in said and "RayTaskError" not in said, said[-4000:]
    rows = {r["trial"]: r for r in pq.read_table(tmp_path / "sweeps" / "r" / "summary.parquet").to_pylist()}
    assert sorted(r["status"] for r in rows.values()) == ["finished", "refused"], rows
    (tid,) = [t for t, r in rows.items() if r["status"] == "refused"]
    line = rows[tid]["refused"]
    assert line.startswith("reparam: ") and "nomatch" in line and "\n" not in line, line
    assert f"trial {tid} refused: {line}" in res.stdout
    trial = tmp_path / "sweeps" / "r" / "trials" / tid
    assert json.loads((trial / "trial.json").read_text())["attempts"] == 1  # run once, with max_failures 2
    assert stage_counts(trial).get("reparam") is None  # the refused stage published nothing
    _, children = sweep_runs(tmp_path, "r")
    (run,) = [c for c in children if c.data.tags["tcnn.trial"] == tid]
    assert run.info.status == "FAILED" and run.data.tags["tcnn.refused"] == line
    again = run_sweep(tmp_path, "--name", "r", "--resume")
    assert f"trial {tid} refused: {line}" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((trial / "trial.json").read_text())["attempts"] == 1  # not run again
