"""`sweep.search` and `sweep.scheduler` (issue 49): ranges validated in one line, the same points for both arms,
the scheduler's state across a restore, and a real search through `tcnn sweep` stopped by SIGTERM and resumed.

The truths: the points are those Optuna's seeded sampler gives for the space (computed here from Optuna itself),
each arm's choice is the best validation accuracy among its own trials that trained every epoch (recomputed
here from the trials' MLflow histories), and a resumed search has the same trials as the plan (no point twice,
no finished trial run again, one MLflow run per trial).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_sweep import TCNN, make_project, sweep_env

from core.config import ConfigError
from pipelines.sweep import from_search as fs
from pipelines.sweep.plan import SweepError
from pipelines.sweep.progress import SearchProgress
from pipelines.sweep.scheduling import ARM_KEY, ARMS, METRIC, TIME_ATTR, ArmwiseScheduler, asha
from pipelines.sweep.search import (
    POINT_KEY,
    PairedSearcher,
    first_points,
    inner_searcher,
    make_searcher,
    warnings_for,
)
from pipelines.sweep.settings import SearchConfig
from pipelines.sweep.sweep_params import load_sweep_params, validate_sweep_params
from stages.tracking.store import store_client

SPACE = {"finetune.lr": {"loguniform": [1e-4, 1e-1]}, "reparam.alpha_init": {"choice": [0.5, 1.0, 2.0]}}


def _raw(**sweep: Any) -> dict[str, Any]:
    raw = load_sweep_params(Path(__file__).parents[1] / "params.yaml").model_dump(mode="json")
    raw["sweep"].update(sweep)
    return raw


@pytest.mark.parametrize(
    ("sweep", "line"),
    [
        ({"search": {"space": {"finetune.lr": {"loguniform": [0, 0.1]}}}},
         "sweep.search.space: finetune.lr: loguniform needs [lo, hi] with 0 < lo < hi, got [0, 0.1]"),
        ({"search": {"space": {"finetune.lr": {"uniform": [0.1, 0.01]}}}},
         "sweep.search.space: finetune.lr: uniform needs [lo, hi] with lo < hi, got [0.1, 0.01]"),
        ({"search": {"space": {"pretrain.lr": {"uniform": [0.01, 0.1]}}}},
         "sweep.search.space: pretrain.lr: not a searchable key"),
        ({"search": {"space": {"finetune.lr": {"normal": [0.01, 0.1]}}}}, "expected one of {loguniform"),
        ({"search": {"space": {"reparam.alpha_init": {"choice": []}}}}, "choice needs a non-empty list"),
        ({"search": {"space": {"reparam.alpha_init": {"choice": [1.0, -2.0]}}}},
         "sweep.search.space.reparam.alpha_init: choice value -2.0 is invalid"),
        ({"search": {"space": {}}}, "name at least one key"),
        ({"search": {"space": SPACE, "algorithm": "bayes"}}, "sweep.search.algorithm"),
        ({"search": {"space": SPACE, "num_samples": 0}}, "sweep.search.num_samples"),
        ({"scheduler": {"kind": "asha"}}, "sweep.scheduler: early stopping acts on the trials of a search"),
        ({"search": {"space": SPACE}, "scheduler": {"grace_period": 99}}, "grace_period: 99 exceeds"),
        ({"search": {"space": SPACE}, "scheduler": {"grace_period": 4}},  # finetune.epochs: 4 (below)
         "sweep.scheduler.grace_period: 4 equals finetune.epochs, so no trial could be stopped"),
        ({"search": {"space": SPACE, "num_samples": 4, "min_finished": 1}, "scheduler": {"reduction_factor": 5}},
         "sweep.scheduler.reduction_factor: 5 points per arm make one rung, sweep.search.num_samples=4 is fewer"),
        ({"search": {"space": SPACE, "num_samples": 3}, "scheduler": {}},
         "sweep.search.min_finished: 3 of num_samples=3 trials per arm must train every epoch"),
        ({"search": {"space": SPACE, "num_samples": 2}}, "sweep.search.min_finished: 3 exceeds num_samples=2"),
        ({"search": {"space": SPACE, "min_finished": 0}}, "sweep.search.min_finished"),
        ({"search": {"space": SPACE, "n_startup_trials": 0}}, "sweep.search.n_startup_trials"),
        ({"search": {"space": SPACE}, "scheduler": {"reduction_factor": 1}}, "sweep.scheduler.reduction_factor"),
        ({"search": {"space": SPACE}, "grid": {"seed": [0, 1]}}, "sweep.grid must be empty"),
        ({"search": {"space": SPACE}, "select": {"over": ["finetune.lr"]}}, "sweep.select: a search chooses"),
    ],
)  # fmt: skip
def test_a_bad_search_is_one_line_naming_the_key(sweep: dict[str, Any], line: str) -> None:
    raw = _raw(**sweep)
    raw["finetune"]["epochs"] = 4  # room for a rung before the last epoch
    with pytest.raises(ConfigError) as err:
        validate_sweep_params(raw)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_search_refuses_a_fixed_control_lr_and_no_validation() -> None:
    raw = _raw(search={"space": SPACE})
    raw["finetune"]["control_lr"] = 0.01
    with pytest.raises(ConfigError, match="finetune.control_lr fixes its lr apart"):
        validate_sweep_params(raw)
    raw = _raw(search={"space": SPACE})
    raw["finetune"]["stop"] = {"patience": 2}
    with pytest.raises(ConfigError, match="a search stops its trials itself"):
        validate_sweep_params(raw)
    raw = _raw(search={"space": SPACE})
    raw["data"]["val_size"] = 0
    with pytest.raises(ConfigError, match="data.val_size is 0"):
        validate_sweep_params(raw)
    raw["data"]["val_from"] = "test_half"
    assert validate_sweep_params(raw).sweep.search is not None  # validation from the test split's other half


# ------------------------------------------------------------------------------------ same points


def _search(seed: int = 3, algorithm: str = "tpe") -> SearchConfig:
    return SearchConfig(space=SPACE, algorithm=algorithm, num_samples=6, seed=seed)


def _with(search: SearchConfig, **changes: Any) -> SearchConfig:
    """``search`` with ``changes``, validated as params.yaml's sweep.search is."""
    return SearchConfig.model_validate({**search.model_dump(), **changes})


def _drive(searcher: Any, n: int, score: Any, start: int = 0) -> list[dict[str, Any]]:
    """Ask ``n`` trials of ``searcher`` one at a time, completing each with ``score(config)``."""
    configs = []
    for i in range(start, start + n):
        config = searcher.suggest(f"trial{i}")
        configs.append(config)
        searcher.on_trial_complete(f"trial{i}", {METRIC: score(config)})
    return configs


def _points_by_arm(configs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {
        arm: [{k: v for k, v in c.items() if k != ARM_KEY} for c in configs if c[ARM_KEY] == arm]
        for arm in ARMS
    }


def _score(config: dict[str, Any]) -> float:
    """The control does best at high lrs, the T-CNN at low ones: arms that steered apart would diverge."""
    lr = config["finetune.lr"]
    return lr * 10 if config[ARM_KEY] == "control" else 1 - lr * 10


def test_both_arms_get_the_same_points_and_the_searcher_learns_their_mean() -> None:
    searcher = make_searcher(_search())
    configs = _drive(searcher, 28, _score)  # 14 points: past TPE's 10 random start-up points, it learns
    by_arm = _points_by_arm(configs)
    assert by_arm["tcnn"] == by_arm["control"] and len(by_arm["tcnn"]) == 14
    assert len({c[POINT_KEY] for c in configs}) == 14
    study = searcher.inner._ot_study  # Optuna's own record of what it learnt: the mean of the arms
    for t, pt in zip(study.trials, by_arm["tcnn"], strict=True):
        assert t.value == pytest.approx(
            (_score({**pt, ARM_KEY: "tcnn"}) + _score({**pt, ARM_KEY: "control"})) / 2
        )


def test_the_unfair_variant_one_searcher_per_arm_fails_the_same_check() -> None:
    """Each arm with its own TPE (same seed), learning its own accuracy: once TPE's random start-up (10 points)
    is over, the arms are searched at different points."""
    per_arm = {arm: inner_searcher(_search()) for arm in ARMS}
    configs = []
    for i in range(14):
        for arm in ARMS:
            config = {**per_arm[arm].suggest(f"p{i}"), POINT_KEY: i, ARM_KEY: arm}
            per_arm[arm].on_trial_complete(f"p{i}", {METRIC: _score(config)})
            configs.append(config)
    by_arm = _points_by_arm(configs)
    assert by_arm["tcnn"] != by_arm["control"]


def test_the_same_seed_gives_the_same_points_and_a_restore_samples_no_point_twice(tmp_path: Path) -> None:
    whole = _drive(make_searcher(_search()), 12, _score)
    assert _drive(make_searcher(_search()), 12, _score) == whole
    assert _drive(make_searcher(_search(seed=4)), 12, _score) != whole
    first = make_searcher(_search())
    part = _drive(first, 5, _score)  # stopped between a point's two arms
    first.save(str(tmp_path / "searcher.pkl"))
    restored = make_searcher(_search())
    restored.restore(str(tmp_path / "searcher.pkl"))
    assert part + _drive(restored, 7, _score, start=5) == whole


def test_the_searcher_ends_when_its_inner_one_does() -> None:
    class Two:
        def __init__(self) -> None:
            self.n = 0

        def suggest(self, trial_id: str) -> dict[str, Any] | str:
            self.n += 1
            return {"finetune.lr": 0.01 * self.n} if self.n <= 2 else PairedSearcher.FINISHED

        def on_trial_complete(self, *args: Any, **kw: Any) -> None:
            pass

    s = PairedSearcher(Two())  # type: ignore[arg-type]
    got = [s.suggest(f"t{i}") for i in range(6)]
    assert [g[ARM_KEY] for g in got[:4]] == ["tcnn", "control", "tcnn", "control"]
    assert got[4:] == [PairedSearcher.FINISHED] * 2


def _epochs(searcher: PairedSearcher, trial_id: str, curve: list[float]) -> None:
    """The trial reports ``curve`` (epochs 1, 2, ...), then ends with its last report."""
    for epoch, value in enumerate(curve, start=1):
        searcher.on_trial_result(trial_id, {TIME_ATTR: epoch, METRIC: value})
    searcher.on_trial_complete(trial_id, {TIME_ATTR: len(curve), METRIC: curve[-1]})


class _LastValues(PairedSearcher):
    """Unfair: each arm's last value, whatever epoch it reached."""

    @staticmethod
    def value(by_arm: dict[str, dict[int, float]]) -> float | None:
        return sum(h[max(h)] for h in by_arm.values()) / len(by_arm)


@pytest.mark.parametrize("cls", [PairedSearcher, _LastValues])
def test_the_sampler_learns_both_arms_at_the_epoch_both_reached(cls: type, tmp_path: Path) -> None:
    """The control stopped at epoch 1 (0.40), the T-CNN ran to 3 (0.30, 0.60, 0.80): the point's value is the
    mean at epoch 1, (0.30 + 0.40) / 2, not a mean of values at epochs 3 and 1. The searcher is saved and
    restored between the arms' reports (Tune pickles it with the experiment): the history survives."""
    searcher = cls(inner_searcher(_search()))
    tcnn, control = searcher.suggest("t0"), searcher.suggest("t1")
    assert (tcnn[ARM_KEY], control[ARM_KEY]) == ("tcnn", "control")
    searcher.on_trial_result("t0", {TIME_ATTR: 1, METRIC: 0.30})
    searcher.save(str(tmp_path / "searcher.pkl"))
    restored = cls(inner_searcher(_search()))
    restored.restore(str(tmp_path / "searcher.pkl"))
    _epochs(restored, "t1", [0.40])
    for epoch, value in ((2, 0.60), (3, 0.80)):
        restored.on_trial_result("t0", {TIME_ATTR: epoch, METRIC: value})
    restored.on_trial_complete("t0", {TIME_ATTR: 3, METRIC: 0.80})
    (told,) = restored.inner._ot_study.trials  # Optuna's own record of what it learnt
    fair = told.value == pytest.approx((0.30 + 0.40) / 2)
    assert fair if cls is PairedSearcher else not fair


@pytest.mark.parametrize("algorithm", ["random", "tpe"])
def test_a_choice_of_four_values_in_four_points_tries_each_once(algorithm: str) -> None:
    """Asked for all four points before any result (as Tune asks with trials running side by side)."""
    values = [0.25, 0.5, 1.0, 2.0]
    search = _with(
        _search(algorithm=algorithm), space={"reparam.alpha_init": {"choice": values}}, num_samples=4
    )
    for seed in (0, 1):
        searcher = make_searcher(_with(search, seed=seed))
        got = [searcher.suggest(f"t{i}")["reparam.alpha_init"] for i in range(8)][::2]
        assert sorted(got) == values, (seed, got)
    # the draw is the seed's: another seed, another order (fixed here, so the check can fail)
    orders = {
        tuple(c["reparam.alpha_init"] for c in first_points(_with(search, seed=seed))) for seed in range(4)
    }
    assert len(orders) > 1


def test_tpe_gets_its_start_up_from_params_and_says_when_that_is_every_point(capsys: Any) -> None:
    searcher = make_searcher(_with(_search(), num_samples=6, n_startup_trials=4))
    assert searcher.inner._ot_study.sampler._n_startup_trials == 4
    assert capsys.readouterr().out == ""
    make_searcher(_with(_search(), num_samples=4, n_startup_trials=4))
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("sweep: warning: sweep.search: tpe with num_samples=4 <= n_startup_trials=4")
    assert warnings_for(_with(_search(algorithm="random"), num_samples=4)) == []


def test_each_arms_choice_says_its_candidates_runner_up_margin_and_tie() -> None:
    """Finished trials of 3 epochs, 500 validation images; a stopped one (epoch 1) is no candidate. The T-CNN's
    best two tie at 0.81 (405 images each): the lower point index is kept, margin 0. The control's best is 0.80,
    its runner-up 0.79: 5 images."""
    from pipelines.sweep.search_report import CHOICE_KEYS, choices, chosen

    def row(point: int, arm: str, acc: float, epoch: int = 3) -> dict[str, Any]:
        status = "finished" if epoch == 3 else "stopped"
        return {"trial": f"p{point:03d}-{arm}", "point": point, "arm": arm, "finetune.lr": 0.01 * (point + 1),
                "status": status, TIME_ATTR: epoch, METRIC: acc, "val_images": 500}  # fmt: skip

    rows = [row(0, "tcnn", 0.70), row(0, "control", 0.79), row(1, "tcnn", 0.81), row(1, "control", 0.95, 1),
            row(2, "tcnn", 0.81), row(2, "control", 0.80), row(3, "tcnn", 0.99, 1), row(3, "control", 0.60)]  # fmt: skip
    picks = chosen(rows, 3)
    got = {arm: {k: picks[arm][k] for k in ("trial", *CHOICE_KEYS)} for arm in ARMS}
    assert got == {
        "tcnn": {"trial": "p001-tcnn", "candidates": 3, "finished_trials": 3, "configs": 4,
                 "runner_up": {"trial": "p002-tcnn", METRIC: 0.81}, "margin_images": 0, "tie": True},
        "control": {"trial": "p002-control", "candidates": 3, "finished_trials": 3, "configs": 4,
                    "runner_up": {"trial": "p000-control", METRIC: 0.79},
                    "margin_images": round((0.80 - 0.79) * 500), "tie": False},
    }  # fmt: skip
    assert got["control"]["margin_images"] == 5
    spec = {"search": {"space": {"finetune.lr": {"loguniform": [1e-3, 1]}}}}
    tcnn, control = choices(spec, picks)
    assert "among 3 candidates, tied with p002-tcnn (81.00%): the lower point index (sampled earlier)" in tcnn
    assert "ahead of the runner-up p000-control (79.00%) by 5 of 500 validation images" in control
    assert chosen([row(0, "tcnn", 0.7)], 3) == {"tcnn": {**row(0, "tcnn", 0.7), "candidates": 1, "finished_trials": 1,
                                                         "configs": 1, "runner_up": None, "margin_images": None,
                                                         "tie": False}, "control": None}  # fmt: skip


def test_a_control_shared_by_points_that_differ_in_reparam_is_one_candidate(tmp_path: Path) -> None:
    """Points 0-2 differ only in reparam.alpha_init, so their controls are one control (one ``config``: the
    shared control's key), trained once, with one accuracy; point 3 has another control. The control arm chose
    among 2 candidates, its runner-up the other control (not its own twin, tied), and says the 4 finished
    trials behind them; --from-search asks a search whose every point shares one control for that one
    candidate only, and still refuses an arm with fewer candidates than configurations and min_finished."""
    from pipelines.sweep.search_report import CHOICE_KEYS, choices, chosen

    def row(point: int, arm: str, acc: float, config: str) -> dict[str, Any]:
        return {"trial": f"p{point:03d}-{arm}", "point": point, "arm": arm, "reparam.alpha_init": 0.5 + point,
                "status": "finished", TIME_ATTR: 3, METRIC: acc, "val_images": 500, "config": config}  # fmt: skip

    rows = [row(0, "tcnn", 0.81, "point 0"), row(0, "control", 0.80, "K1"), row(1, "tcnn", 0.83, "point 1"),
            row(1, "control", 0.80, "K1"), row(2, "tcnn", 0.82, "point 2"), row(2, "control", 0.80, "K1"),
            row(3, "tcnn", 0.70, "point 3"), row(3, "control", 0.78, "K2")]  # fmt: skip
    picks = chosen(rows, 3)
    got = {arm: {k: picks[arm][k] for k in ("trial", *CHOICE_KEYS)} for arm in ARMS}
    assert got["control"] == {"trial": "p000-control", "candidates": 2, "finished_trials": 4, "configs": 2,
                              "runner_up": {"trial": "p003-control", METRIC: 0.78}, "margin_images": 10,
                              "tie": False}  # fmt: skip
    assert (got["tcnn"]["candidates"], got["tcnn"]["runner_up"]["trial"]) == (4, "p002-tcnn")
    spec = {"search": {"space": {"reparam.alpha_init": {"choice": [0.5, 1.5, 2.5, 3.5]}}}}
    assert (
        "among 2 candidates (4 finished trials: points that differ only in reparam.* share one control"
        in (choices(spec, picks)[1])
    )
    one = chosen([r for r in rows if r["point"] < 3], 3)["control"]
    assert (one["candidates"], one["finished_trials"], one["configs"], one["runner_up"]) == (1, 3, 1, None)
    search = {"name": "s", "search": {"space": spec["search"]["space"], "min_finished": 3}}
    assert fs.check_candidates(tmp_path, search, {"tcnn": picks["tcnn"], "control": one}, force=False) == {
        "tcnn": 4, "control": 1}  # fmt: skip
    with pytest.raises(SweepError, match=r"fewer than 3 trials that trained every epoch \(control 2\)"):
        fs.check_candidates(tmp_path, search, {"tcnn": picks["tcnn"], "control": {**one, "candidates": 2,
                                                                                  "configs": 4}}, force=False)  # fmt: skip


# ------------------------------------------------------------------------------- scheduler state


def _trial(tid: str, arm: str) -> Any:
    return SimpleNamespace(trial_id=tid, config={ARM_KEY: arm})


def test_the_scheduler_goes_on_from_its_saved_rungs_after_a_restore(tmp_path: Path) -> None:
    """ASHA (grace 1, reduction 2) within each arm: after the first trial of an arm reached rung 1 at 0.9, a
    second one at 0.1 is stopped there. A scheduler restored from the state file decides the same; a fresh one
    without it would let the second trial go on."""
    state = tmp_path / "state.pkl"
    make = asha(max_t=4, grace_period=1, reduction_factor=2)
    first = ArmwiseScheduler(make, state=str(state))
    a, b, c = _trial("a", "tcnn"), _trial("b", "tcnn"), _trial("c", "control")
    for t in (a, b, c):
        first.on_trial_add(None, t)
    assert first.on_trial_result(None, a, {TIME_ATTR: 1, METRIC: 0.9}) == "CONTINUE"
    restored = ArmwiseScheduler(make, state=str(state))
    assert restored.on_trial_result(None, b, {TIME_ATTR: 1, METRIC: 0.1}) == "STOP"
    assert restored.on_trial_result(None, c, {TIME_ATTR: 1, METRIC: 0.1}) == "CONTINUE"  # the other arm's own
    fresh = ArmwiseScheduler(make)
    fresh.on_trial_add(None, b)
    assert fresh.on_trial_result(None, b, {TIME_ATTR: 1, METRIC: 0.1}) == "CONTINUE"


def test_the_trials_an_arm_lost_are_kept_across_a_restore(tmp_path: Path) -> None:
    """3 points, min_finished 2: the T-CNN's second trial is stopped (2 stay able to finish); after a restore
    its third, as poor, is promoted to the end, since stopping it would leave 1."""
    state, make = tmp_path / "state.pkl", asha(max_t=4, grace_period=1, reduction_factor=2)
    first = ArmwiseScheduler(make, state=str(state), points=3, min_finished=2, max_t=4)
    a, b, c = _trial("a", "tcnn"), _trial("b", "tcnn"), _trial("c", "tcnn")
    for t in (a, b, c):
        first.on_trial_add(None, t)
    assert first.on_trial_result(None, a, {TIME_ATTR: 1, METRIC: 0.9}) == "CONTINUE"
    assert first.on_trial_result(None, b, {TIME_ATTR: 1, METRIC: 0.1}) == "STOP"
    restored = ArmwiseScheduler(make, state=str(state), points=3, min_finished=2, max_t=4)
    assert restored.on_trial_result(None, c, {TIME_ATTR: 1, METRIC: 0.1}) == "CONTINUE"
    assert restored.lost == {"tcnn": {"b"}, "control": set()} and restored.promoted["tcnn"] == {"c"}


def test_a_report_after_tune_ended_the_trial_raises_instead_of_passing_silently() -> None:
    """Outside a Tune session (as in a trial's process once Ray stopped it and shut its session down) Ray's
    report only warns and returns: an epoch trained after an ASHA stop was logged as if the trial went on (the
    flaky search test of issue 56). The trial's Reporter raises SystemExit instead, from then on."""
    from ray import tune

    from pipelines.sweep.tune_report import Reporter

    with warnings.catch_warnings():  # Ray warns once per process that it was called outside a session
        warnings.simplefilter("ignore")
        assert tune.report({"x": 1}) is None  # the cause: no error, no effect
    report = Reporter("p000-tcnn", None)
    with pytest.raises(SystemExit):
        report({"stage": "finetune", "finetune_epoch": 3})
    assert report.halted
    with pytest.raises(SystemExit):
        report({"stage": "done"})
    Reporter("p000-tcnn", None, enabled=False)({"stage": "done"})  # reporting off (no Tune): nothing raised


# ------------------------------------------------------------------------------------- end to end


def _start(root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", "s", *args],
                            cwd=root, env=sweep_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def _wait_for(where: Path, pattern: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while not list(where.glob(pattern)):
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        assert time.monotonic() - t0 < timeout
        time.sleep(1)


def _trial_runs(root: Path) -> list[Any]:
    client = store_client(f"sqlite:///{root / 'mlruns.db'}")
    exp = client.get_experiment_by_name("sweeps")
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("tcnn.kind") == "trial"]


@pytest.fixture(scope="module")
def stopped_search(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A search of 3 points with ASHA, stopped by SIGTERM once a trial finished, then resumed to its end (the
    finished search the tests below read; one run for the module)."""
    tmp_path = tmp_path_factory.mktemp("search")
    path = make_project(
        tmp_path, {}, finetune={"epochs": 3, "batch_size": 50, "lr": 0.004, "warmup_epochs": 0.5}
    )
    raw = yaml.safe_load(path.read_text())
    search = {"space": {"finetune.lr": {"loguniform": [1e-4, 0.1]}}, "algorithm": "random", "num_samples": 3,
              "seed": 0, "min_finished": 2}  # fmt: skip
    raw["sweep"] |= {"search": search, "scheduler": {"grace_period": 1, "reduction_factor": 2}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    sweep_dir = tmp_path / "sweeps" / "s"

    t0 = time.monotonic()
    proc = _start(tmp_path)
    _wait_for(sweep_dir, "trials/*/done.json", proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    first_leg_s = time.monotonic() - t0
    assert proc.returncode == 75, out[-3000:]
    done_before = {p.parent.name: p.stat().st_mtime_ns for p in sweep_dir.glob("trials/*/done.json")}
    res = subprocess.run([TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", "s", "--resume"],
                         cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return SimpleNamespace(root=tmp_path, sweep_dir=sweep_dir, search=search, stop_out=out, resumed=res,
                           done_before=done_before, first_leg_s=first_leg_s)  # fmt: skip


@pytest.mark.slow
def test_a_search_stopped_by_sigterm_resumes_and_each_arm_chooses_its_own_best(
    stopped_search: SimpleNamespace,
) -> None:
    tmp_path, sweep_dir, search = stopped_search.root, stopped_search.sweep_dir, stopped_search.search
    done_before = stopped_search.done_before
    assert "tcnn sweep: stopped by SIGTERM; run it again with --resume to continue" in stopped_search.stop_out

    # The points: Optuna's seeded sampler's, each run by both arms, none twice; finished trials not run again.
    expected = [
        c["finetune.lr"]
        for c in _drive(make_searcher(SearchConfig.model_validate(search)), 6, lambda c: 0.5)[::2]
    ]
    rows = pq.read_table(sweep_dir / "search.parquet").to_pylist()
    assert [(r["point"], r["arm"]) for r in rows] == [(p, a) for p in range(3) for a in ARMS]
    assert [r["finetune.lr"] for r in rows] == pytest.approx([lr for lr in expected for _ in ARMS])
    assert {p.parent.name: p.stat().st_mtime_ns for p in sweep_dir.glob("trials/*/done.json")
            if p.parent.name in done_before} == done_before  # fmt: skip

    # MLflow: one run per trial, none left open or failed; a stopped trial is tagged so, at its last epoch.
    runs = {r.info.run_name: r for r in _trial_runs(tmp_path)}
    assert sorted(runs) == sorted(r["trial"] for r in rows) and len(_trial_runs(tmp_path)) == len(rows)
    client = store_client(f"sqlite:///{tmp_path / 'mlruns.db'}")
    for r in rows:
        run = runs[r["trial"]]
        assert run.info.status == "FINISHED"
        assert (run.data.tags.get("tcnn.status") == "stopped") == (r["status"] == "stopped")
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "epoch/val_acc")
        )
        assert [s for s, _ in history] == list(range(r[TIME_ATTR] + 1))  # every epoch, once, from the start
        assert r[METRIC] == pytest.approx(history[-1][1])
        if r["status"] == "stopped":
            assert run.data.tags["tcnn.stopped_at_epoch"] == str(r[TIME_ATTR]) and r[TIME_ATTR] < 3

    # Each arm's choice: its best last validation accuracy among its trials that trained every epoch, at least
    # min_finished of them; the runner-up and the margin in the validation images its fine-tuning recorded.
    chosen = json.loads((sweep_dir / "chosen.json").read_text())
    metrics = json.loads((sweep_dir / "metrics.json").read_text())
    report = (sweep_dir / "search.md").read_text()
    for arm in ARMS:
        done = [r for r in rows if r["arm"] == arm and r["status"] == "finished"]
        assert all(r[TIME_ATTR] == 3 for r in done)
        assert len(done) >= search["min_finished"], (arm, done)
        best, second = sorted(done, key=lambda r: (-r[METRIC], r["point"]))[:2]
        assert chosen[arm]["trial"] == best["trial"] and chosen[arm][METRIC] == best[METRIC]
        stage = "finetune" if arm == "tcnn" else "control"
        roles = json.loads(
            (sweep_dir / "trials" / best["trial"] / "runs" / stage / "metrics.json").read_text()
        )
        n_val = roles["data_roles"]["val"]["images"]
        assert chosen[arm]["candidates"] == len(done) == metrics[f"chosen/{arm}/candidates"]
        assert chosen[arm]["runner_up"] == {"trial": second["trial"], METRIC: second[METRIC]}
        assert chosen[arm]["margin_images"] == round((best[METRIC] - second[METRIC]) * n_val)
        assert chosen[arm]["tie"] == (best[METRIC] == second[METRIC]) == bool(metrics[f"chosen/{arm}/tie"])
        assert f"among {len(done)} candidates" in report.split(f"- {arm}: ")[1].splitlines()[0]
    assert f"- tcnn: {chosen['tcnn']['trial']} finetune.lr=" in report
    html = (sweep_dir / "report.html").read_text()
    assert f"control: {chosen['control']['trial']} finetune.lr=" in html and "<img" in html
    trained = sum(r[TIME_ATTR] for r in rows)
    assert f"Compute: {trained} fine-tuning epochs trained of {3 * len(rows)}" in report
    assert metrics["pretrain_runs"] == 1  # the search's one pretraining, shared by every trial, not run again
    assert (
        metrics["search_epochs_trained"] == trained
        and metrics["chosen/control/val_acc"] == chosen["control"][METRIC]
    )
    assert (sweep_dir / "plots" / "search_curves.png").stat().st_size > 10_000

    # Progress: a line per trial event, each trial's end as its row says; no warning about pending trials.
    said = stopped_search.stop_out + stopped_search.resumed.stdout
    for r in rows:
        assert re.search(rf"^\[\d/6\] {r['trial']} .*: {'finetune' if r['arm'] == 'tcnn' else 'control'} "
                         rf"epoch 1 val_acc 0\.\d{{4}}$", said, re.M), r["trial"]  # fmt: skip
        end = (f"finished: 3 epochs, val_acc {r[METRIC]:.4f}" if r["status"] == "finished"
               else f"stopped by the scheduler at epoch {r[TIME_ATTR]} (its rung)")  # fmt: skip
        assert re.search(rf"^\[\d/6\] {r['trial']} .*: {re.escape(end)}$", said, re.M), (r["trial"], end)
    resumed = stopped_search.resumed.stdout + stopped_search.resumed.stderr
    assert "Failed to fetch metrics" not in resumed and "FileNotFoundError" not in resumed


# ------------------------------------------------------------------------------- shared controls


def _search_project(root: Path, space: dict[str, Any], epochs: int = 2) -> Path:
    path = make_project(
        root, {}, finetune={"epochs": epochs, "batch_size": 50, "lr": 0.004, "warmup_epochs": 0.5}
    )
    raw = yaml.safe_load(path.read_text())
    raw["sweep"] |= {"search": {"space": space, "algorithm": "random", "num_samples": 2, "seed": 0,
                                "min_finished": 2}}  # fmt: skip
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_search_points_control_is_the_grids_at_the_same_values(tmp_path: Path) -> None:
    """The control a search point trains is keyed as a grid's trial at the same values keys its shared control
    (the grid planner's own key, pipelines.sweep.plan.make_plan): the reparam values do not change it, the lr
    does."""
    from pipelines.sweep.arm_trial import arm_params, control_key
    from pipelines.sweep.sweep_spec import build_spec

    path = _search_project(tmp_path, {"finetune.lr": {"choice": [0.004, 0.01]},
                                      "reparam.alpha_init": {"choice": [0.5, 2.0]}})  # fmt: skip
    search = build_spec(load_sweep_params(path), name="s", params_file=path, cwd=tmp_path)
    raw = yaml.safe_load(path.read_text())
    del raw["sweep"]["search"]
    raw["sweep"]["grid"] = {"finetune.lr": [0.01], "reparam.alpha_init": [0.5, 2.0]}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    grid = build_spec(load_sweep_params(path), name="g", params_file=path, cwd=tmp_path)
    grid_keys = {t["overrides"]["reparam.alpha_init"]: t["control_key"] for t in grid["trials"].values()}
    assert len(set(grid_keys.values())) == 1  # the grid shares one control between its two alphas
    for alpha, want in grid_keys.items():
        assert (
            control_key(search, arm_params(search, {"finetune.lr": 0.01, "reparam.alpha_init": alpha}))[0]
            == want
        )
    other = control_key(search, arm_params(search, {"finetune.lr": 0.004, "reparam.alpha_init": 0.5}))[0]
    assert other != grid_keys[0.5]


def test_a_shared_control_counts_its_epochs_once() -> None:
    from pipelines.sweep.search_report import epochs_trained

    def row(arm: str, epochs: int, key: str | None = None, before: int = 0) -> dict[str, Any]:
        return {"arm": arm, TIME_ATTR: epochs, "control_key": key, "control_before": before if key else None}

    # two T-CNNs (3 + 1 epochs); one control shared by two points, one stopped at 1 while the other went on to 3
    # (3 epochs trained once); one control finished by an earlier search (3 held before: none trained here);
    # one an earlier search stopped at 1 and this one resumed to 3 (2 trained here)
    rows = [row("tcnn", 3), row("tcnn", 1), row("control", 1, "a"), row("control", 3, "a", before=1),
            row("control", 3, "b", before=3), row("control", 3, "b", before=3), row("control", 3, "c", before=1)]  # fmt: skip
    assert epochs_trained(rows) == (3 + 1) + 3 + 0 + 2


def _shared_control_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "sweeps" / "control").iterdir() if p.is_dir())


@pytest.mark.slow
def test_points_that_differ_in_reparam_and_a_later_search_train_the_control_once(tmp_path: Path) -> None:
    """Two points that differ only in reparam.alpha_init: one control trained, both control trials report its
    epochs (on Tune and their MLflow runs); a second search in the same storage trains no control again."""
    path = _search_project(tmp_path, {"reparam.alpha_init": {"choice": [0.5, 2.0]}})
    client = store_client(f"sqlite:///{tmp_path / 'mlruns.db'}")
    for name in ("s1", "s2"):
        res = subprocess.run([TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", name],
                             cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=900)  # fmt: skip
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        (shared,) = _shared_control_dirs(tmp_path)  # one control identity for both points
        executions = (shared / "executions.jsonl").read_text().splitlines()
        assert [json.loads(line)["sweep"] for line in executions] == ["s1"]  # once, by the first search
        sweep_dir = tmp_path / "sweeps" / name
        assert (sweep_dir / "control_runs.jsonl").exists() == (name == "s1")
        history = json.loads((shared / "runs" / "control" / "history.json").read_text())
        rows = pq.read_table(sweep_dir / "search.parquet").to_pylist()
        assert sorted(r["reparam.alpha_init"] for r in rows if r["arm"] == "control") == [0.5, 2.0]
        runs = {r.info.run_name: r for r in _trial_runs(tmp_path) if r.data.tags["tcnn.sweep"] == name}
        for r in rows:
            run_id = runs[r["trial"]].info.run_id
            logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "epoch/val_acc"))
            trial = sweep_dir / "trials" / r["trial"]
            if r["arm"] == "control":  # the shared run's epochs, each reported and logged
                assert (trial / "runs" / "control").resolve() == (shared / "runs" / "control").resolve()
                assert r["control_key"] == shared.name and r["status"] == "finished"
                assert logged == [(h["finetune_epoch"], pytest.approx(h["val_acc"])) for h in history]
                assert json.loads(r["epochs"]) == [h["finetune_epoch"] for h in history] and r[TIME_ATTR] == 2
                assert r[METRIC] == pytest.approx(history[-1]["val_acc"])
            else:  # the T-CNN's own fine-tuning, in its trial's directory
                assert not (trial / "runs" / "finetune").is_symlink()
                assert [s for s, _ in logged] == list(range(r[TIME_ATTR] + 1)) and r[TIME_ATTR] == 2
        # what the shared directory held when each control trial started: none for s1's first, all for s2's
        before = sorted(r["control_before"] for r in rows if r["arm"] == "control")
        assert before[0] == 0 if name == "s1" else before == [history[-1]["finetune_epoch"]] * 2
        report = (sweep_dir / "search.md").read_text()
        picks = json.loads((sweep_dir / "chosen.json").read_text())  # one control: one candidate, two trials
        assert [picks["control"][k] for k in ("candidates", "finished_trials", "configs", "runner_up")] == [
            1,
            2,
            1,
            None,
        ]
        assert picks["tcnn"]["candidates"] == picks["tcnn"]["configs"] == 2
        assert (
            "among 1 candidate (2 finished trials: points that differ only in reparam.* share one control"
            in report
        )
        control_trained = 2 if name == "s1" else 0
        assert (f"Compute: {4 + control_trained} fine-tuning epochs trained of 8 (every trial to the end); "
                f"{4 - control_trained} more epochs reported came from shared matched controls") in report  # fmt: skip

    # A grid at one searched point, at the search's seed: its T-CNN fine-tuning is the first search's trial's
    # (found by the finetune stage's identity, copied), its control the shared one; only evaluate is new.
    raw = yaml.safe_load(path.read_text())
    del raw["sweep"]["search"]
    raw["sweep"]["grid"] = {"reparam.alpha_init": [2.0]}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    res = subprocess.run([TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", "g"],
                         cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = pq.read_table(tmp_path / "sweeps" / "s1" / "search.parquet").to_pylist()
    (source,) = [tmp_path / "sweeps" / "s1" / "trials" / r["trial"] for r in rows
                 if r["arm"] == "tcnn" and r["reparam.alpha_init"] == 2.0]  # fmt: skip
    (trial,) = (tmp_path / "sweeps" / "g" / "trials").iterdir()
    lines = [json.loads(line) for line in (trial / "stages.jsonl").read_text().splitlines()]
    assert [(line["stage"], line.get("reused")) for line in lines if "shared" not in line] == [
        ("reparam", None),
        ("finetune", str(source)),
        ("evaluate", None),
    ]  # one line per stage, finetune reused
    history = json.loads((source / "runs" / "finetune" / "history.json").read_text())
    assert json.loads((trial / "runs" / "finetune" / "history.json").read_text()) == history
    assert (trial / "runs" / "finetune" / "metrics.json").read_bytes() == (
        source / "runs" / "finetune" / "metrics.json").read_bytes()  # fmt: skip
    assert not (tmp_path / "sweeps" / "g" / "control_runs.jsonl").exists()
    (shared,) = _shared_control_dirs(tmp_path)
    assert len((shared / "executions.jsonl").read_text().splitlines()) == 1
    (run,) = [r for r in _trial_runs(tmp_path) if r.data.tags["tcnn.sweep"] == "g"]
    logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "epoch/val_acc"))
    assert logged == [(h["finetune_epoch"], pytest.approx(h["val_acc"])) for h in history]
    assert (trial / "done.json").is_file()


_HOLDER = """
import json, sys
from pipelines.sweep.arm_trial import ArmTrial
spec = json.loads(open(sys.argv[1]).read())
ArmTrial(spec, json.loads(sys.argv[2]), report=False).run()
"""


@pytest.mark.slow
def test_a_stopped_holder_of_a_shared_control_leaves_it_to_the_trial_waiting_for_it(tmp_path: Path) -> None:
    """The rule for a control two points share: point 0's control trial trains it and is killed (as Ray ends a
    trial its scheduler stops) while point 1's waits on the lock; point 1 has reported each epoch point 0
    trained, takes the lock, resumes the stage's partial state (bitwise: tests/test_resume_kill.py) and
    finishes it, every epoch reported once, the control trained to the end once."""
    import os
    import sys
    import threading

    from pipelines.sweep.arm_trial import ArmTrial, arm_params, base_tid, control_key, shared_epochs
    from pipelines.sweep.replay import DONE
    from pipelines.sweep.shared import ENSURE
    from pipelines.sweep.sweep_spec import build_spec

    path = _search_project(tmp_path, {"reparam.alpha_init": {"choice": [0.5, 2.0]}}, epochs=4)
    spec = build_spec(load_sweep_params(path), name="s", params_file=path, cwd=tmp_path)
    spec["tracking"]["enabled"] = False
    Path(spec["sweep_dir"]).mkdir(parents=True)
    ENSURE["pretrain"](spec, spec["trials"][base_tid(spec)]["pretrain_key"], trial="test")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    configs = [{POINT_KEY: p, ARM_KEY: "control", "reparam.alpha_init": a} for p, a in ((0, 2.0), (1, 0.5))]
    key = control_key(spec, arm_params(spec, {"reparam.alpha_init": 2.0}))[0]
    assert key == control_key(spec, arm_params(spec, {"reparam.alpha_init": 0.5}))[0]
    shared = tmp_path / "sweeps" / "control" / key

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "spec.json"), json.dumps(configs[0])],
                              cwd=Path(__file__).parents[1], env=sweep_env())  # fmt: skip
    try:
        t0 = time.monotonic()
        while shared_epochs(shared) < 1:  # the holder finished its first epoch (its resume state says so)
            assert holder.poll() is None and time.monotonic() - t0 < 600
            time.sleep(0.05)
        os.kill(holder.pid, signal.SIGSTOP)  # frozen mid-training, holding the lock
        trained_by_holder = shared_epochs(shared)
        assert 1 <= trained_by_holder < 4

        class Waiting(ArmTrial):
            seen: list[int]

            def epoch_report(self, result: dict[str, Any]) -> dict[str, Any]:
                self.seen.append(int(result["finetune_epoch"]))
                return super().epoch_report(result)

        waiting = Waiting(spec, configs[1], report=False)
        waiting.seen = []
        thread = threading.Thread(target=waiting.run)
        thread.start()
        log = waiting.root / "trial.log"
        while trained_by_holder not in waiting.seen or "waiting for another process" not in (
            log.read_text() if log.exists() else ""
        ):
            assert thread.is_alive() and time.monotonic() - t0 < 600
            time.sleep(0.1)
        os.kill(holder.pid, signal.SIGKILL)  # the stop: the holder's process ends, the lock with it
        holder.wait()
        thread.join(timeout=600)
        assert not thread.is_alive()
    finally:
        holder.kill()  # not left stopped when an assertion fails
        holder.wait()

    history = json.loads((shared / "runs" / "control" / "history.json").read_text())
    epochs = [h["finetune_epoch"] for h in history]
    assert epochs == list(range(5)) and waiting.seen == epochs  # each epoch reported once, in order
    runs = [json.loads(line) for line in (shared / "executions.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in runs] == ["p001-control"]  # trained to the end once, by the trial that waited
    done = json.loads((waiting.root / DONE).read_text())
    assert done["epoch"] == 4 and done["val_acc"] == pytest.approx(history[-1]["val_acc"])
    assert not (Path(spec["sweep_dir"]) / "trials" / "p000-control" / DONE).exists()


def test_a_finished_fine_tuning_is_found_only_under_the_same_identity(tmp_path: Path) -> None:
    """pipelines.sweep.reuse: found for the same params from a byte-identical reparameterized checkpoint once
    its outputs are published; not for another checkpoint, another lr, or the trial itself; the index's
    directory is no sweep name."""
    from pipelines.sweep import reuse
    from pipelines.sweep.plan import SweepError, check_name

    params = validate_sweep_params(_raw())
    spec = {"storage": str(tmp_path / "sweeps"), "name": "s"}
    roots = {}
    for name, content in (("a", b"one"), ("b", b"two"), ("c", b"one")):
        roots[name] = tmp_path / name
        (roots[name] / "runs" / "reparam").mkdir(parents=True)
        (roots[name] / "runs" / "reparam" / "tcnn.pt").write_bytes(content)
    reuse.register(spec, params, roots["a"], "a")
    assert reuse.finished(spec, params, roots["c"]) is None  # registered, its outputs not published
    (roots["a"] / "runs" / "finetune").mkdir()
    (roots["a"] / "runs" / "finetune" / "metrics.json").write_text("{}")
    assert reuse.finished(spec, params, roots["c"]) == roots["a"]
    assert reuse.finished(spec, params, roots["b"]) is None  # another checkpoint
    assert reuse.finished(spec, params.with_overrides({"finetune.lr": 0.5}), roots["c"]) is None
    assert reuse.finished(spec, params, roots["a"]) is None  # itself
    with pytest.raises(SweepError):
        check_name(reuse.INDEX)


@pytest.mark.slow
def test_wall_s_counts_every_leg_of_the_driver(stopped_search: SimpleNamespace) -> None:
    legs = [json.loads(x) for x in (stopped_search.sweep_dir / "legs.jsonl").read_text().splitlines()]
    assert [x["ended"] for x in legs] == ["stopped", "finished"]
    assert 0 < legs[0]["wall_s"] < stopped_search.first_leg_s  # the driver's time within its process's
    metrics = json.loads((stopped_search.sweep_dir / "metrics.json").read_text())
    assert metrics["legs"] == 2 and metrics["wall_s"] == pytest.approx(legs[0]["wall_s"] + legs[1]["wall_s"])


@pytest.mark.slow
def test_a_fresh_machine_replays_the_recorded_trials_and_asha_stops_the_same_ones(
    stopped_search: SimpleNamespace, tmp_path: Path
) -> None:
    """Issue 57: the search's trials as records (pipelines.sweep.replay), the project copied elsewhere without its
    sweeps or MLflow store (a fresh machine), `tcnn sweep --records`: the same rows (statuses, curves, the epoch
    each stopped trial was stopped at), the same choice per arm, nothing trained."""
    from pipelines.sweep import replay
    from pipelines.sweep.arm_trial import config_params

    records = tmp_path / "records"
    written = replay.export(stopped_search.sweep_dir, records, config_params)
    rows = pq.read_table(stopped_search.sweep_dir / "search.parquet").to_pylist()
    states = {p.stem: json.loads(p.read_text())["state"] for p in written}
    assert states == {r["trial"]: r["status"] for r in rows} and "stopped" in states.values()
    assert replay.export(stopped_search.sweep_dir, records, config_params) == []  # unchanged: not rewritten
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(stopped_search.root, elsewhere, ignore=shutil.ignore_patterns("sweeps", "mlruns*"))
    cmd = [
        TCNN,
        "sweep",
        "--params",
        "params.yaml",
        "--num-cpus",
        "2",
        "--name",
        "s",
        "--records",
        str(records),
    ]
    res = subprocess.run(cmd, cwd=elsewhere, env=sweep_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    again = pq.read_table(elsewhere / "sweeps" / "s" / "search.parquet").to_pylist()
    keep = ("trial", "finetune.lr", "status", TIME_ATTR, METRIC, "test_acc", "epochs", "curve")
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in rows]
    chosen = [
        json.loads((d / "chosen.json").read_text())
        for d in (stopped_search.sweep_dir, elsewhere / "sweeps" / "s")
    ]
    assert {a: chosen[1][a]["trial"] for a in ARMS} == {a: chosen[0][a]["trial"] for a in ARMS}
    trials = sorted((elsewhere / "sweeps" / "s" / "trials").iterdir())
    assert len(trials) == len(rows) and not list((elsewhere / "sweeps" / "s" / "trials").glob("*/**/*.pt"))
    assert all("replay: " in (t / "trial.log").read_text() for t in trials)


@pytest.mark.slow
def test_a_stopped_record_the_scheduler_does_not_stop_is_trained_from_a_clean_directory(
    stopped_search: SimpleNamespace, tmp_path: Path
) -> None:
    """Outside Tune nothing stops a replay: a stopped trial's record is then not its outcome (its restored files
    are removed and the trial trains), a finished one's is (done.json restored, its MLflow run id kept as the
    recorded one's, none claimed on this machine); a record of other params is not replayed."""
    from pipelines.sweep import replay
    from pipelines.sweep.arm_trial import ArmTrial, config_params

    records = tmp_path / "records"
    replay.export(stopped_search.sweep_dir, records, config_params)
    spec = json.loads((stopped_search.sweep_dir / "sweep.json").read_text())
    spec |= {"sweep_dir": str(tmp_path / "s"), "records": str(records)}
    by_state = {}
    for p in sorted((records / "s").glob("*.json")):
        rec = json.loads(p.read_text())
        by_state.setdefault(rec["state"], rec)
    for state, rec in by_state.items():
        runner = ArmTrial(spec, rec["config"], report=False)
        runner.root.mkdir(parents=True)
        out = runner._replayed()
        if state == "stopped":
            assert out is None and sorted(x.name for x in runner.root.iterdir()) == []
        else:
            assert out["tid"] == rec["tid"] and out["mlflow_run_id"] is None
            assert (
                out["mlflow_run_id_recorded"]
                == json.loads(rec["files"]["done.json"]["text"])["mlflow_run_id"]
            )
            assert json.loads((runner.root / "done.json").read_text()) == out
    other = ArmTrial(
        spec | {"name": "s"}, {**by_state["finished"]["config"], "finetune.lr": 0.5}, report=False
    )
    assert (
        replay.lookup(other.spec, other.tid, replay.identity(spec, other.tid, other.config, other.params))
        is None
    )


def _doc_recipe() -> str:
    """The ResultGrid recipe docs/sweeps.md shows (the python block after its marker)."""
    text = (Path(__file__).parents[1] / "docs" / "sweeps.md").read_text()
    after = text[text.index("<!-- resultgrid-recipe") :]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_result_grid_recipe_in_the_docs_gives_each_arms_choice(stopped_search: SimpleNamespace) -> None:
    """The recipe, run as docs/sweeps.md shows it on this search, returns chosen.json's trial for each arm (among
    its ties), while Tune's get_best_config over the whole experiment ignores the arms."""
    code = _doc_recipe().replace('"sweeps/lr-search/tune"', repr(str(stopped_search.sweep_dir / "tune")))
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/sweeps.md", "exec"), scope)  # noqa: S102 - the documented recipe, run as shown
    chosen = json.loads((stopped_search.sweep_dir / "chosen.json").read_text())
    rows = pq.read_table(stopped_search.sweep_dir / "search.parquet").to_pylist()
    for arm in ARMS:
        got = [f"p{r.config[POINT_KEY]:03d}-{arm}" for r in scope["choices"][arm]]
        assert chosen[arm]["trial"] in got
        assert {r.metrics[METRIC] for r in scope["choices"][arm]} == {chosen[arm][METRIC]}
        finished = [r for r in rows if r["arm"] == arm and r["status"] == "finished"]  # the truth: the rows
        assert sorted(got) == sorted(r["trial"] for r in finished if r[METRIC] == chosen[arm][METRIC])


# ------------------------------------------------------------------------------------- from a search


def _a_search(storage: Path, *, candidates: int | None = 3, wd: tuple[float, float] | None = None) -> None:
    """A finished search's files as the driver writes them, by hand: sweep.json (its space, base params),
    chosen.json (each arm's trial, value and candidates), metrics.json and search.parquet."""
    d = storage / "s"
    d.mkdir(parents=True)
    space: dict[str, Any] = {
        "finetune.lr": {"loguniform": [1e-6, 0.1]},
        "reparam.alpha_init": {"choice": [0.5, 2.0]},
    }
    picks = {"tcnn": {"trial": "p002-tcnn", "val_acc": 0.81, "finetune.lr": 1e-05, "reparam.alpha_init": 0.5},
             "control": {"trial": "p000-control", "val_acc": 0.83, "finetune.lr": 0.02, "reparam.alpha_init": 2.0}}  # fmt: skip
    if wd is not None:
        space["finetune.weight_decay"] = {"uniform": [0.0, 0.1]}
        picks["tcnn"]["finetune.weight_decay"], picks["control"]["finetune.weight_decay"] = wd
    if candidates is not None:
        for p in picks.values():
            p["candidates"] = candidates
    base = _raw()
    (d / "sweep.json").write_text(
        json.dumps({"name": "s", "search": {"space": space, "num_samples": 4}, "base": base})
    )
    (d / "chosen.json").write_text(json.dumps(picks))
    (d / "metrics.json").write_text("{}")
    rows = [{"arm": a, "status": st} for a, st in [("tcnn", "finished"), ("tcnn", "stopped"), ("tcnn", "finished"),
                                                   ("control", "finished"), ("control", "stopped")]]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), d / "search.parquet")


def test_from_search_puts_each_arm_at_its_own_choice_and_keeps_the_seed_grid(tmp_path: Path) -> None:
    _a_search(tmp_path)
    user = ["sweep.grid.seed=[0, 1, 2]"]
    sets, record, spec = fs.origin(tmp_path, "s", user, force=False)
    params = load_sweep_params(Path(__file__).parents[1] / "params.yaml", [*sets, *user])
    assert (
        params.finetune.lr == 1e-05 and params.finetune.control_lr == 0.02
    )  # 1e-05 survives YAML as a number
    assert params.reparam.alpha_init == 0.5  # the T-CNN's: the control has no attention to initialise
    assert (
        params.sweep.search is None
        and params.sweep.scheduler is None
        and params.sweep.grid == {"seed": [0, 1, 2]}
    )
    assert record["trials"] == {"tcnn": "p002-tcnn", "control": "p000-control"} and not record["forced"]
    assert record["candidates"] == {"tcnn": 3, "control": 3} and spec["name"] == "s"
    assert "From search s" in fs.line(record) and "p002-tcnn among 3 candidates" in fs.line(record)


def test_from_search_counts_candidates_in_search_parquet_and_refuses_too_few_unless_forced(
    tmp_path: Path,
) -> None:
    _a_search(tmp_path, candidates=None)  # a search written before chosen.json said its candidates
    with pytest.raises(
        SweepError, match=r"fewer than 3 trials that trained every epoch \(tcnn 2, control 1\)"
    ):
        fs.origin(tmp_path, "s", [], force=False)
    _, record, _ = fs.origin(tmp_path, "s", [], force=True)
    assert record["forced"] and record["candidates"] == {"tcnn": 2, "control": 1}


@pytest.mark.parametrize(
    ("setup", "sets", "line"),
    [
        ("none", [], "--from-search s: no sweep 's' in"),
        ("grid", [], "is a grid, not a search"),
        (
            "unfinished",
            [],
            "the search has not finished (no chosen.json): run `tcnn sweep --name s --resume`",
        ),
        ("no-choice", [], "the control arm chose nothing"),
        ("ok", ["finetune.lr=0.1"], "-S finetune.lr: set by --from-search s"),
        ("wd", [], "finetune.weight_decay: the arms chose 0.01 (tcnn) and 0.05 (control)"),
    ],
)
def test_from_search_refuses_in_one_line(tmp_path: Path, setup: str, sets: list[str], line: str) -> None:
    if setup != "none":
        _a_search(tmp_path, wd=(0.01, 0.05) if setup == "wd" else None)
    d = tmp_path / "s"
    if setup == "grid":
        (d / "sweep.json").write_text(json.dumps({"name": "s", "search": None}))
    elif setup == "unfinished":
        (d / "chosen.json").unlink()
    elif setup == "no-choice":
        (d / "chosen.json").write_text(
            json.dumps({**json.loads((d / "chosen.json").read_text()), "control": None})
        )
    with pytest.raises(SweepError) as err:
        fs.origin(tmp_path, "s", sets, force=False)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_from_search_refuses_a_grid_of_another_problem() -> None:
    space = {"finetune.lr": {"loguniform": [1e-4, 0.1]}}
    search = {"name": "s", "search": {"space": space}, "base": _raw()}
    same = _raw()
    same["seed"], same["finetune"]["lr"], same["finetune"]["control_lr"] = (
        3,
        0.5,
        0.2,
    )  # free: seed, searched keys
    same["sweep"]["grid"] = {"seed": [0, 1]}
    fs.check_problem(search, {"base": same})
    other = _raw()
    other["finetune"]["epochs"] += 1
    with pytest.raises(SweepError, match=r"finetune.epochs is \d+ here and was \d+ in the search"):
        fs.check_problem(search, {"base": other})


def test_tcnn_sweep_from_a_missing_search_is_one_line_exit_2_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelines.cli import build_parser, main

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_raw()))
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--from-search", "nope", "-S", "sweep.grid.seed=[0,1]"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("tcnn sweep: error: --from-search nope: no sweep 'nope' in") and err.count("\n") == 1
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]
    help_text = " ".join(build_parser().format_help().split())
    assert "grid (sweep.grid) or search (sweep.search" in help_text


def test_a_search_prints_a_line_per_trial_event(capsys: pytest.CaptureFixture[str]) -> None:
    progress = SearchProgress(total=4)
    a = SimpleNamespace(config={POINT_KEY: 1, ARM_KEY: "tcnn", "finetune.lr": 0.01}, status="RUNNING",
                        last_result={}, path="/x")  # fmt: skip
    b = SimpleNamespace(config={POINT_KEY: 1, ARM_KEY: "control", "finetune.lr": 0.01}, status="RUNNING",
                        last_result={}, path="/y")  # fmt: skip
    trials = [a, b]
    progress.on_trial_result(0, trials, a, {"stage": "start", "attempt": 1})
    for t in (a, b):  # the shared pretraining's epoch, reported by both trials: said once
        progress.on_trial_result(
            0, trials, t, {"stage": "pretrain", "pretrain_epoch": 1, "pretrain_val_acc": 0.5}
        )
    progress.on_trial_result(
        0, trials, b, {"stage": "control", "finetune_epoch": 1, "val_acc": 0.61, TIME_ATTR: 1}
    )
    b.status, b.last_result = (
        "TERMINATED",
        {"stage": "control", "finetune_epoch": 1, TIME_ATTR: 1, METRIC: 0.61},
    )
    progress.on_trial_complete(0, trials, b)
    progress.on_trial_result(0, trials, a, {"stage": "finetune", "finetune_epoch": 3})  # the last: no metric
    a.status, a.last_result = "TERMINATED", {"stage": "done", TIME_ATTR: 3, METRIC: 0.825}
    progress.on_trial_complete(0, trials, a)
    assert capsys.readouterr().out.splitlines() == [
        "[0/4] p001-tcnn finetune.lr=0.01: started (attempt 1)",
        "[0/4] p001-tcnn finetune.lr=0.01: shared pretraining epoch 1 val_acc 0.5000",
        "[0/4] p001-control finetune.lr=0.01: control epoch 1 val_acc 0.6100",
        "[1/4] p001-control finetune.lr=0.01: stopped by the scheduler at epoch 1 (its rung)",
        "[1/4] p001-tcnn finetune.lr=0.01: finetune epoch 3 (the last: its val_acc on the finished line)",
        "[2/4] p001-tcnn finetune.lr=0.01: finished: 3 epochs, val_acc 0.8250",
    ]


@pytest.mark.slow
def test_from_search_runs_a_grid_at_each_arms_choice_and_names_the_search(
    stopped_search: SimpleNamespace,
) -> None:
    """``tcnn sweep --from-search s``: refused while an arm chose among too few trials (unless --force), then a
    one-seed grid (the smallest: the search's own seed, its pretraining reused) at each arm's choice."""
    root, chosen = stopped_search.root, json.loads((stopped_search.sweep_dir / "chosen.json").read_text())
    rows = pq.read_table(stopped_search.sweep_dir / "search.parquet").to_pylist()
    counts = {arm: sum(r["arm"] == arm and r["status"] == "finished" for r in rows) for arm in ARMS}
    counts = {arm: chosen[arm].get("candidates", n) for arm, n in counts.items()}
    cmd = [TCNN, "sweep", "--params", "params.yaml", "--num-cpus", "2", "--name", "g", "--from-search", "s",
           "-S", "sweep.grid.seed=[0]"]  # fmt: skip
    force, need = [], stopped_search.search["min_finished"]  # the search's own minimum, not the default 3
    if min(counts.values()) < need:
        res = subprocess.run(cmd, cwd=root, env=sweep_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and f"fewer than {need} trials that trained every epoch" in res.stderr
        assert res.stderr.count("\n") == 1 and not (root / "sweeps" / "g").exists()
        force = ["--force"]
    res = subprocess.run(
        [*cmd, *force], cwd=root, env=sweep_env(), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    spec = json.loads((root / "sweeps" / "g" / "sweep.json").read_text())
    assert spec["from_search"]["name"] == "s" and spec["from_search"]["forced"] == bool(force)
    assert spec["from_search"]["trials"] == {arm: chosen[arm]["trial"] for arm in ARMS}
    (trial,) = spec["trials"].values()
    ft = trial["params"]["finetune"]
    assert ft["lr"] == chosen["tcnn"]["finetune.lr"] and ft["control_lr"] == chosen["control"]["finetune.lr"]
    assert trial["params"]["sweep"]["search"] is None and trial["params"]["sweep"]["scheduler"] is None
    assert (
        "From search s (" in res.stdout
        and "From search s (" in (root / "sweeps" / "g" / "report.html").read_text()
    )
    client = store_client(f"sqlite:///{root / 'mlruns.db'}")
    exp = client.get_experiment_by_name("sweeps")
    (parent,) = [r for r in client.search_runs([exp.experiment_id], "tags.`tcnn.sweep` = 'g'")
                 if r.data.tags.get("tcnn.kind") == "parent"]  # fmt: skip
    assert parent.data.tags["tcnn.from_search"] == "s"
    assert (
        json.loads((root / "sweeps" / "g" / "metrics.json").read_text())["pretrain_runs"] == 0
    )  # the search's


def test_the_search_and_scheduler_reach_tune_as_the_typed_settings_they_were_validated_as(
    tmp_path: Path,
) -> None:
    """sweep.json stores the settings as JSON; read back (pipelines.sweep.settings.search_of / scheduler_of)
    they are the params' own typed objects, and Tune's ASHA gets the scheduler's grace period and factor."""
    from pipelines.sweep.settings import scheduler_of, search_of, select_of
    from pipelines.sweep.sweep_spec import build_spec
    from pipelines.sweep.tuner import scheduler

    path = _search_project(tmp_path, {"finetune.lr": {"loguniform": [1e-4, 1e-2]}}, epochs=3)
    params = load_sweep_params(path, ["sweep.search.num_samples=4", "sweep.scheduler={grace_period: 2}"])
    spec = json.loads(json.dumps(build_spec(params, name="s", params_file=path, cwd=tmp_path)))
    assert search_of(spec) == params.sweep.search and scheduler_of(spec) == params.sweep.scheduler
    assert select_of(spec) == params.sweep.select
    made = scheduler(spec)
    assert isinstance(made, ArmwiseScheduler) and set(made.by_arm) == set(ARMS)
    for asha_of_one_arm in made.by_arm.values():  # Ray's ASHAScheduler, as built from the typed setting
        assert asha_of_one_arm._reduction_factor == 2.0 and asha_of_one_arm._max_t == 3
        # ASHA's rungs sit at grace_period * factor**k short of max_t (Li et al. 2020): 2 only; grace 1: 2 and 1
        assert [rung for rung, _ in asha_of_one_arm._brackets[0]._rungs] == [2]
