"""`tcnn sweep` planning and input checks (quick), and simultaneous shared pretraining (slow, no Ray).

The Ray / MLflow / SLURM runs are in tests/test_sweep_ray.py and tests/test_sweep_slurm.py; they use the
helpers here to lay out a tiny project (a Fashion-MNIST slice prepared by core's own writer + params.yaml).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _train_helpers import tiny_params, write_dataset

from core.config import plan_epochs
from pipelines.cli import main as tcnn_main
from pipelines.sweep.plan import SweepError, expand_grid, make_plan
from pipelines.sweep.sweep_params import SweepParams, load_sweep_params

REPO = Path(__file__).resolve().parents[1]
TCNN = str(Path(sys.executable).with_name("tcnn"))


def make_project(root: Path, grid: dict[str, list[Any]], *, n_train: int = 400, **sections: Any) -> Path:
    """A tiny project in ``root``: data/ (prepared Fashion-MNIST slice) and params.yaml (relative paths)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "data" / "manifest.json").exists():
        write_dataset(root / "data", n_train, 100)
    raw = tiny_params(
        Path("data"),
        pretrain={
            "epochs": 2,
            "batch_size": 50,
            "lr": 0.05,
            "warmup_epochs": 0.5,
            "checkpoint_every_steps": 0,
        },
        finetune={"epochs": 1, "batch_size": 50, "lr": 0.004, "warmup_epochs": 0.5},
        robustness={
            "n_images": 50,
            "corruptions": ["gaussian_noise", "contrast"],
            "severities": [1],
            "dir": "data-c",
            "workers": 1,
        },
        sweep={"grid": grid, "cpus_per_trial": 1, "max_failures": 1, "storage": "sweeps"},
        tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "sweeps"},
    )
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def sweep_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "TCNN_TRACKING": "1",
            "TCNN_QUIET": "1",
            "OMP_NUM_THREADS": "1",
            "TCNN_DEVICE": "cpu",
            "PYTHONHASHSEED": "0",
        }
    )
    env.update(extra)
    return env


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---------------------------------------------------------------------------------------------- plan


def test_expand_grid_is_the_cartesian_product_first_key_slowest() -> None:
    combos = expand_grid({"reparam.epoch": [1, 2], "reparam.alpha_init": [0.5, 1.0, 2.0]})
    assert combos == [{"reparam.epoch": e, "reparam.alpha_init": a} for e in (1, 2) for a in (0.5, 1.0, 2.0)]
    with pytest.raises(SweepError, match="sweep.grid.seed: expected a non-empty list"):
        expand_grid({"seed": []})


def test_plan_groups_trials_by_pretraining_inputs(tmp_path: Path) -> None:
    path = make_project(tmp_path, {"reparam.epoch": [1, 2], "reparam.alpha_init": [0.5, 2.0]})
    plan = make_plan(load_sweep_params(path), cwd=tmp_path)
    assert len(plan.trials) == 4
    assert [(t.params.reparam.epoch, t.params.reparam.alpha_init) for t in plan.trials] == [
        (1, 0.5), (1, 2.0), (2, 0.5), (2, 2.0)
    ]  # fmt: skip
    assert len(plan.groups) == 1  # t1 and alpha do not change pretraining
    (group,) = plan.groups.values()
    assert group.epochs == [1, 2] and group.params.pretrain.checkpoint_epochs == [1, 2]
    assert len({t.tid for t in plan.trials}) == 4
    t = plan.trials[0]
    assert t.params.data.dir == (tmp_path / "data").resolve()  # absolute: trials run in their own dirs
    assert t.params.sweep.grid == {}
    assert t.params.robustness.dir == tmp_path.resolve() / "sweeps" / "corrupt" / t.corrupt_key
    assert len({t.corrupt_key for t in plan.trials}) == 1


def test_plan_makes_a_relative_data_source_absolute(tmp_path: Path, monkeypatch) -> None:
    """Trials run in Ray workers with another working directory: a relative data.source (the CIFAR-10
    archive at ../shared/...) must reach them resolved against the directory `tcnn sweep` runs in."""
    path = make_project(tmp_path, {"seed": [0, 1]})
    (tmp_path / "raw").mkdir()
    monkeypatch.chdir(tmp_path)
    base = load_sweep_params(path).with_overrides({"data.source": "raw"})
    monkeypatch.chdir("/")
    plan = make_plan(base, cwd=tmp_path)
    assert {t.params.data.source for t in plan.trials} == {(tmp_path / "raw").resolve()}


def test_plan_separates_what_changes_pretraining(tmp_path: Path) -> None:
    path = make_project(tmp_path, {"seed": [0, 1], "model.kind": ["cnn", "tcnn"]})
    plan = make_plan(load_sweep_params(path), cwd=tmp_path)
    # Two seeds -> two pretraining runs; kinds cnn and tcnn pretrain the same CNN.
    assert len(plan.groups) == 2
    for g in plan.groups.values():
        assert {plan.trial(tid).params.seed for tid in g.trials} == {g.params.seed}
        assert {plan.trial(tid).params.model.kind for tid in g.trials} == {"cnn", "tcnn"}
    assert len({t.corrupt_key for t in plan.trials}) == 2  # corrupted sets are seeded
    base = load_sweep_params(path)
    lr = make_plan(base.with_overrides({"pretrain.lr": 0.01}), cwd=tmp_path)
    ft = make_plan(base.with_overrides({"finetune.lr": 0.01}), cwd=tmp_path)
    assert set(lr.groups).isdisjoint(plan.groups)
    assert set(ft.groups) == set(plan.groups)


def test_fraction_scaling_keeps_images_seen_and_t1_in_place(tmp_path: Path) -> None:
    path = make_project(
        tmp_path,
        {"data.sample_fraction": [0.25, 1.0], "reparam.epoch": [1, 2]},
        pretrain={"warmup_epochs": 0.5},
    )
    plan = make_plan(load_sweep_params(path), cwd=tmp_path)
    by = {(t.overrides["data.sample_fraction"], t.overrides["reparam.epoch"]): t.params for t in plan.trials}
    # f = 0.25: E = 2 -> 8 epochs, t1 1 -> 4 and 2 -> 8, warmup 0.5 -> 2 epochs, fine-tuning 1 -> 4 epochs.
    assert by[(0.25, 1)].pretrain.epochs == 8 and by[(0.25, 1)].reparam.epoch == 4
    assert by[(0.25, 2)].reparam.epoch == 8
    assert by[(0.25, 1)].pretrain.warmup_epochs == pytest.approx(2.0)
    assert by[(0.25, 1)].finetune.epochs == 4
    assert by[(1.0, 1)].pretrain.epochs == 2 and by[(1.0, 2)].reparam.epoch == 2
    assert len(plan.groups) == 2
    assert sorted(g.epochs for g in plan.groups.values()) == [[1, 2], [4, 8]]
    off = load_sweep_params(path).with_overrides(
        {"data.fraction_scales_epochs": False, "data.sample_fraction": 0.25}
    )
    assert plan_epochs(off) == off
    # The DVC path plans with the same function: a trial's params are the stage's planned params.
    on = load_sweep_params(path).with_overrides({"data.sample_fraction": 0.25, "reparam.epoch": 1})
    planned = plan_epochs(on)
    assert by[(0.25, 1)].pretrain == planned.pretrain and by[(0.25, 1)].finetune == planned.finetune


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-S", "sweep.grid.reparam.nope=[1]"], "sweep.grid.reparam.nope"),
        (["-S", "sweep.grid.seed=[]"], "sweep.grid.seed: expected a non-empty list"),
        (["-S", "sweep.grid.reparam.alpha_init=[-1.0]"], "sweep.grid.reparam.alpha_init"),
        (["--address", "not an address"], "--address 'not an address'"),
        (["--resume"], "--resume: no sweep"),
        (["--name", "../x"], "--name '../x'"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    args: list[str],
    message: str,
) -> None:
    path = make_project(tmp_path, {"reparam.epoch": [1, 2]})
    before = listing(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TCNN_TRACKING", "1")
    rc = tcnn_main(["sweep", "--params", str(path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("tcnn sweep: error:") and message in err[0], err
    assert listing(tmp_path) == before


def test_existing_sweep_needs_resume_and_same_params(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    path = make_project(tmp_path, {"reparam.epoch": [1, 2]})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps" / "s").mkdir(parents=True)
    from pipelines.sweep.sweep_spec import build_spec

    spec = build_spec(load_sweep_params(path), name="s", params_file=path)
    (tmp_path / "sweeps" / "s" / "sweep.json").write_text(json.dumps(spec))
    before = listing(tmp_path)
    assert tcnn_main(["sweep", "--params", str(path), "--name", "s"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert (
        tcnn_main(["sweep", "--params", str(path), "--name", "s", "--resume", "-S", "finetune.lr=0.5"]) == 2
    )
    err = capsys.readouterr().err
    assert "params differ" in err and "finetune.lr" in err
    assert listing(tmp_path) == before


def test_multinode_needs_an_mlflow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    path = make_project(tmp_path, {"reparam.epoch": [1, 2]})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TCNN_TRACKING", "1")
    before = listing(tmp_path)
    assert tcnn_main(["sweep", "--params", str(path), "--slurm", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs an MLflow server" in err and "sqlite:///" in err
    assert listing(tmp_path) == before


# -------------------------------------------------------------------- simultaneous shared pretraining


def _ensure(spec: dict, key: str, trial: str, barrier: Any, log: str) -> None:
    import torch

    torch.set_num_threads(1)
    with open(log, "w") as fh:
        os.dup2(fh.fileno(), 2)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        from pipelines.sweep.shared import ensure_pretraining

        barrier.wait()
        _, executed, _ = ensure_pretraining(spec, key, trial=trial)
        print(f"EXECUTED {executed}", file=sys.stderr, flush=True)


@pytest.mark.slow
def test_simultaneous_trials_pretrain_once(tmp_path: Path) -> None:
    """Two processes (as two trials started at the same moment) need the same pretraining: one trains, the
    other waits on the group's lock and reuses it. Counted by the pretrain stage's own epoch lines."""
    from pipelines.sweep.sweep_spec import build_spec

    path = make_project(tmp_path, {"reparam.alpha_init": [0.5, 2.0]}, n_train=600)
    spec = build_spec(load_sweep_params(path), name="s", params_file=path, cwd=tmp_path)
    (key,) = spec["groups"]
    Path(spec["sweep_dir"]).mkdir(parents=True)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    logs = [str(tmp_path / f"p{i}.log") for i in range(2)]
    procs = [
        ctx.Process(target=_ensure, args=(spec, key, f"trial{i}", barrier, logs[i]), daemon=True)
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    texts = [Path(f).read_text() for f in logs]
    assert sorted(t.count("EXECUTED True") for t in texts) == [0, 1]
    assert sum(t.count("pretrain epoch 1/2") for t in texts) == 1  # the stage ran once
    waiter = texts[[t.count("EXECUTED False") for t in texts].index(1)]
    assert "waiting for another process" in waiter  # it started while the other was pretraining
    group = tmp_path / "sweeps" / "pretrain" / key
    lines = (group / "executions.jsonl").read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["cpu"]  # the CPU it ran on, for the study's records
    assert [f"ckpt-epoch-{e:03d}.pt" for e in (1, 2)] == sorted(
        p.name for p in (group / "runs/pretrain/ckpt").iterdir()
    )


def test_tcnn_sweep_help_lists_the_options() -> None:
    out = subprocess.run([TCNN, "sweep", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for opt in (
        "--params",
        "--address",
        "--resume",
        "--name",
        "--slurm",
        "--nodes",
        "--gpus-per-node",
        "--sbatch",
        "--time",
        "--worker-placement",
    ):
        assert opt in out.stdout


def test_plots_only_for_what_the_grid_varies(tmp_path: Path) -> None:
    from pipelines.sweep.summary import make_plots
    from pipelines.sweep.tables import write_table

    grid = {
        "reparam.alpha_init": [0.5, 2.0],
        "reparam.lambda_init": [0.0, 3.0],
        "data.sample_fraction": [0.5, 1.0],
    }
    spec = {"name": "s", "grid": grid, "base": {"data": {"fraction_scales_epochs": True}}}
    rows = []
    for i, (a, lam, f) in enumerate(itertools.product(*grid.values())):
        rows.append(
            {
                "trial": f"t{i}",
                "reparam.alpha_init": a,
                "reparam.lambda_init": lam,
                "data.sample_fraction": f,
                "status": "finished",
                "cnn_clean_accuracy": 0.5 + f / 10,
                "tcnn_clean_accuracy": 0.6 + a / 100 + lam / 1000,
                "tcnn_mca": 0.4,
                "tcnn_mce": 0.9,
            }
        )
    written = sorted(p.name for p in make_plots(spec, rows, tmp_path / "plots"))
    assert written == ["accuracy_vs_fraction.png", "alpha_lambda_heatmap.png"]  # t1 and kind do not vary
    table = write_table(rows, tmp_path / "summary.parquet")
    import pyarrow.parquet as pq

    back = pq.read_table(table).to_pylist()
    assert back == rows


def test_sweep_share_pretraining_key(tmp_path: Path) -> None:
    from core.config import ConfigError

    assert SweepParams().sweep.share_pretraining is True
    path = make_project(tmp_path, {"seed": [0]})
    assert load_sweep_params(path, ["sweep.share_pretraining=false"]).sweep.share_pretraining is False
    with pytest.raises(ConfigError, match="sweep.share_pretraining"):
        load_sweep_params(path, ["sweep.share_pretraining=[1]"])


def test_t1_plot_with_equal_values_per_point(tmp_path: Path) -> None:
    """Nine equal accuracies per t1 (as in the benchmark grid): their float mean exceeds them by an ulp;
    the error bars must not go negative (matplotlib refuses them)."""
    from pipelines.sweep.summary import make_plots

    spec = {"name": "s", "grid": {"reparam.epoch": [2, 4]}, "base": {"sweep": {}}}
    acc = 0.41
    assert sum([acc] * 9) / 9 > acc
    rows = [
        {"trial": f"t{i}", "reparam.epoch": e, "status": "finished", "tcnn_clean_accuracy": acc,
         "tcnn_mca": acc, "cnn_clean_accuracy": acc}
        for i, e in enumerate([2] * 9 + [4] * 9)
    ]  # fmt: skip
    assert [p.name for p in make_plots(spec, rows, tmp_path)] == ["accuracy_vs_t1.png"]


def test_kind_table_uses_one_common_baseline(tmp_path: Path) -> None:
    """mCE of every kind against the pretrained CNN of the cnn trial, checked against the formula by hand:
    CE_c = sum_s E(f, s, c) / sum_s E(cnn, s, c), mCE = mean_c CE_c (a ConViT trial's own baseline is its own
    pretrained ConViT, which must not be used)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from core.robustness.eval_table import table_from_errors
    from pipelines.sweep.summary import kind_rows, kinds_markdown, make_plots, write_kinds

    cnn_pre = {"gaussian_noise": [0.2, 0.4], "contrast": [0.1, 0.3]}  # severities 1, 2
    finals = {
        "cnn": {"gaussian_noise": [0.2, 0.3], "contrast": [0.1, 0.2]},
        "convit": {"gaussian_noise": [0.3, 0.6], "contrast": [0.2, 0.2]},
    }
    own_pre = {"cnn": cnn_pre, "convit": {"gaussian_noise": [0.9, 0.9], "contrast": [0.9, 0.9]}}
    spec: dict[str, Any] = {"name": "k", "grid": {"model": [{}, {}]}, "trials": {}}
    rows = []
    for i, kind in enumerate(["cnn", "convit"]):
        d = tmp_path / f"t{i}"
        (d / "results").mkdir(parents=True)
        table = pa.concat_tables(
            [table_from_errors("cnn", 0.1, own_pre[kind]), table_from_errors("tcnn", 0.05, finals[kind])]
        )
        pq.write_table(table, d / "results" / "robustness.parquet")
        spec["trials"][f"t{i}"] = {"params": {"model": {"arch": f"arch{i}"}}}
        rows.append({"trial": f"t{i}", "model_kind": kind, "status": "finished", "trial_dir": str(d)})
    krows = kind_rows(spec, rows)
    assert [k["kind"] for k in krows] == ["cnn (pretrained, baseline)", "cnn", "convit"]
    base_sum = {c: sum(v) for c, v in cnn_pre.items()}
    for k, kind in zip(krows, [None, "cnn", "convit"]):
        errs = cnn_pre if kind is None else finals[kind]
        want = sum(sum(errs[c]) / base_sum[c] for c in errs) / len(errs)
        assert k["mce"] == pytest.approx(want, rel=1e-12)
        assert k["clean_accuracy"] == pytest.approx(0.9 if kind is None else 0.95)
    assert krows[2]["mce"] == pytest.approx((0.9 / 0.6 + 0.4 / 0.4) / 2)
    md = kinds_markdown(krows)
    assert "| convit | arch1 | 95.00 |" in md and "125.00" in md
    files = write_kinds(krows, tmp_path)
    assert pq.read_table(files[0]).num_rows == 3 and files[1].read_text() == md
    plots = make_plots(spec, rows, tmp_path / "plots")
    assert [p.name for p in plots] == ["accuracy_by_kind.png"]
    assert kind_rows(spec, rows[:1]) == []  # one kind: no comparison

    from pipelines.sweep.sweep_report import write_report

    page = write_report(spec, rows, krows, plots, tmp_path).read_text()
    assert "<td>convit</td>" in page and "<td>125.00</td>" in page and "pretrained CNN of t0" in page
    assert page.count("data:image/png;base64,") == 1 and page.count("<tr") == 1 + 3 + 1 + 2  # heads + rows


def test_a_stage_published_before_a_kill_is_not_trained_again(tmp_path: Path) -> None:
    """A kill between a training stage's publication (outputs, metrics.json last, then its work dir removed) and
    the trial's done-mark: the next attempt records the published stage instead of training it again from
    scratch (there is no partial state left to resume from). While the work dir exists, it trains (resumes)."""
    from pipelines.sweep.sweep_spec import build_spec
    from pipelines.sweep.trial import TrialRunner
    from pipelines.sweep.trial_files import STAGE_LOG

    path = make_project(tmp_path, {"reparam.alpha_init": [0.5]})
    spec = build_spec(load_sweep_params(path), name="s", params_file=path, cwd=tmp_path)
    (tid,) = spec["trials"]
    runner = TrialRunner(spec, tid, report=False)
    runner.marks.mkdir(parents=True)
    partial, out = runner.root / "runs" / ".partial" / "finetune", runner.root / "runs" / "finetune"
    partial.mkdir(parents=True)
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"test_acc": 0.25}))
    trained: list[str] = []

    def train() -> dict:
        trained.append("finetune")
        return {"test_acc": 0.5}

    assert runner.stage("finetune", train, training=True) == ({"test_acc": 0.5}, True)  # mid-run: trains
    (runner.marks / "finetune.json").unlink()
    partial.rmdir()  # published, then killed before the mark
    assert runner.stage("finetune", train, training=True) == ({"test_acc": 0.25}, False)
    assert trained == ["finetune"]
    lines = [json.loads(ln) for ln in (runner.root / STAGE_LOG).read_text().splitlines()]
    assert [ln.get("recovered", False) for ln in lines] == [False, True]
    from core.utils.machine import cpu_model

    assert {ln["cpu"] for ln in lines} == {cpu_model()} and cpu_model()  # which CPU the stage ran on
    assert runner.stage("finetune", train, training=True) == ({"test_acc": 0.25}, False)  # the mark now


def test_a_sweep_saved_before_the_package_still_unpickles() -> None:
    """Ray Tune's tuner.pkl and submitit's job file name these objects by their old module paths (before
    pipelines/sweep/ was a package): pickle finds each under its old name, and it is the current object."""
    import pickle

    from pipelines.sweep import driver, progress, tuner

    old = {
        b"pipelines.sweep\n_trial_dirname": tuner._trial_dirname,
        b"pipelines.sweep\nslurm_driver": driver.slurm_driver,
        b"pipelines.sweep_progress\nSweepProgress": progress.SweepProgress,
    }
    for ref, current in old.items():
        assert pickle.loads(b"c" + ref + b"\n.") is current, ref
