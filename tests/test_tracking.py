"""The tracking adapter against a real MLflow sqlite store in tmp_path (and with tracking disabled)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.config import Params
from stages.harness.stage_run import stage_run
from stages.tracking.names import (
    ATTEMPT_TAG,
    CHAIN_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    KIND_TAG,
    PARAMS_HASH_TAG,
    PARENT_TAG,
    STAGE_TAG,
    flatten_params,
    params_hash,
    resolve_uri,
    run_label,
)
from stages.tracking.tracker import Tracker, TrackingError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated MLflow sqlite store (creating one costs seconds; copying it is instant)."""
    db = tmp_path_factory.mktemp("mlflow-template") / "mlruns.db"
    Tracker(uri=f"sqlite:///{db}", experiment="template")
    return db


@pytest.fixture
def store(template_db: Path, tmp_path: Path) -> str:
    db = tmp_path / "mlruns.db"
    shutil.copy(template_db, db)
    return f"sqlite:///{db}"


def _all_runs(tracker: Tracker) -> list:
    return list(tracker.client.search_runs([tracker.experiment_id], max_results=1000))


# --------------------------------------------------------------------------------------------- no MLflow


def test_flatten_params_stable_names() -> None:
    params = Params().with_overrides(
        {
            "reparam.alpha_init": 2.0,
            "reparam.lambda_init": 3.0,
            "reparam.epoch": 1,
            "data.sample_fraction": 0.5,
        }
    )
    flat = flatten_params(params)
    assert flat["alpha_init"] == "2.0"
    assert flat["lambda_init"] == "3.0"
    assert flat["reparam_epoch"] == "1"
    assert flat["sample_fraction"] == "0.5"
    for dotted in ("reparam.alpha_init", "reparam.lambda_init", "reparam.epoch", "data.sample_fraction"):
        assert dotted not in flat
    assert flat["augment.hflip"] == "True" and flat["pretrain.augment"] == "None"  # the shared policy
    assert flat["finetune.lr"] == str(params.finetune.lr)
    assert json.loads(flat["robustness.severities"]) == params.robustness.severities
    assert flat["model.options"] == "{}"  # empty mappings keep their name so every run has the same keys
    # Every leaf of the config appears exactly once, so runs with other values have the same names.
    leaves = _count_leaves(params.model_dump(mode="json"))
    assert len(flat) == leaves
    other = flatten_params(Params().with_overrides({"seed": 7, "finetune.mode": "continue"}))
    assert set(other) == set(flat)


def _count_leaves(node: object) -> int:
    if isinstance(node, dict) and node:
        return sum(_count_leaves(v) for v in node.values())
    return 1


def test_resolve_uri(tmp_path: Path) -> None:
    assert resolve_uri("sqlite:///mlruns.db", tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlruns.db"
    assert resolve_uri("sqlite:////abs/x.db", tmp_path) == "sqlite:////abs/x.db"
    assert resolve_uri("http://127.0.0.1:5000", tmp_path) == "http://127.0.0.1:5000"


def test_disabled_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "art.txt").write_text("x")
    tracker = Tracker(enabled=False, uri="sqlite:///mlruns.db")
    assert tracker.mode == "disabled" and not tracker.enabled
    assert tracker.start_parent("p", {"a": 1}) is None
    assert tracker.start_child("train", params=Params()) is None
    tracker.log_params(Params())
    tracker.log_metrics({"acc": 1.0}, step=3)
    tracker.log_artifact(tmp_path / "does-not-matter")
    tracker.log_dict({"a": 1}, "a.json")
    tracker.set_tags({"t": 1})
    tracker.log_dataset("d", "digest", "src")
    with tracker.activate() as mlflow:
        assert mlflow is None
    tracker.end()
    tracker.end_parent()
    params = Params().with_overrides({"tracking.enabled": False})
    with stage_run(params, "train", root=tmp_path) as t2:
        t2.log_metrics({"x": 1.0}, step=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art.txt"]


def test_http_uri_without_server_is_one_clear_error() -> None:
    with pytest.raises(TrackingError, match=r"tracking.uri http://127.0.0.1:9/: no MLflow server answers"):
        Tracker(uri="http://127.0.0.1:9/")


# ------------------------------------------------------------------------------------------ sqlite store


def test_parent_child_params_metrics_artifacts(store: str, tmp_path: Path) -> None:
    tracker = Tracker(uri=store, experiment="nesting")
    params = Params().with_overrides({"reparam.alpha_init": 2.0})
    parent = tracker.start_parent("pipeline", {"dvc_lock": "abc"})
    children = {}
    for stage in ("pretrain", "finetune"):
        with tracker.stage(stage, params=params) as t:
            children[stage] = t.run_id
            for epoch in range(3):
                t.log_metrics({"val_acc": 0.5 + 0.1 * epoch, "loss": 1.0 / (epoch + 1)}, step=epoch)
            report = tmp_path / f"{stage}.json"
            report.write_text(json.dumps({"stage": stage}))
            t.log_artifact(report, "reports")
            t.log_dict({"epochs": [0, 1, 2]}, "curves/epochs.json")
            t.log_dataset("fashion_mnist", "0123456789abcdef", "data/fashion_mnist")
    tracker.log_metrics({"clean_acc": 0.9})  # on the parent once no child is open
    tracker.end_parent()

    client = tracker.client
    runs = _all_runs(tracker)
    assert len(runs) == 3
    assert {r.info.status for r in runs} == {"FINISHED"}
    p = client.get_run(parent)
    assert p.data.tags[KIND_TAG] == "parent" and p.data.tags["dvc_lock"] == "abc"
    assert p.data.metrics["clean_acc"] == pytest.approx(0.9)
    for stage, run_id in children.items():
        run = client.get_run(run_id)
        assert run.data.tags[PARENT_TAG] == parent  # the UI nests by this tag
        assert run.data.tags[STAGE_TAG] == stage
        assert run.info.run_name == stage
        assert run.data.params["alpha_init"] == "2.0" and run.data.params["reparam_epoch"] == "2"
        assert run.data.params == flatten_params(params)
        history = client.get_metric_history(run_id, "val_acc")
        assert [(m.step, round(m.value, 6)) for m in history] == [(0, 0.5), (1, 0.6), (2, 0.7)]
        names = {a.path for a in client.list_artifacts(run_id)}
        assert names == {"reports", "curves"}
        local = client.download_artifacts(run_id, f"reports/{stage}.json", str(tmp_path / f"dl-{stage}"))
        assert json.loads(Path(local).read_text()) == {"stage": stage}
        inputs = run.inputs.dataset_inputs
        assert [d.dataset.name for d in inputs] == ["fashion_mnist"]
    # Artifacts live next to the database, not in the working directory.
    assert (tmp_path / "mlartifacts").is_dir()


def test_stage_failure_marks_failed(store: str) -> None:
    tracker = Tracker(uri=store, experiment="failing")
    tracker.start_parent("pipeline")
    with pytest.raises(RuntimeError, match="boom"), tracker.stage("evaluate"):
        raise RuntimeError("boom")
    (run,) = tracker.find_child("evaluate")
    assert run.info.status == "FAILED"
    assert tracker.client.get_run(tracker.parent_run_id).info.status == "RUNNING"


def test_leftover_running_child_is_resumed_or_failed(store: str) -> None:
    """A RUNNING child left by a dead process: resumed by default, FAILED with on_stale='fail' or new params."""
    first = Tracker(uri=store, experiment="stale")
    parent = first.start_parent("pipeline", key="ws")
    params = Params()
    stale = first.start_child("reparam", params=params)
    first.log_metrics({"loss": 2.0}, step=0)  # ... and the process "dies" here

    second = Tracker(uri=store, experiment="stale")
    assert second.start_parent("pipeline", key="ws") == parent  # the same RUNNING parent of this workspace
    assert second.start_child("reparam", params=params) == stale
    assert second.client.get_run(stale).data.tags[ATTEMPT_TAG] == "2"
    second.log_metrics({"loss": 1.0}, step=1)
    second.end()
    history = second.client.get_metric_history(stale, "loss")
    assert [m.step for m in history] == [0, 1]

    # A leftover with different params cannot be resumed (params are write-once): FAILED + a new run.
    third = Tracker(uri=store, experiment="stale")
    third.start_parent(key="ws")
    leftover = third.start_child("finetune", params=params)
    fourth = Tracker(uri=store, experiment="stale")
    fourth.start_parent(key="ws")
    new = fourth.start_child("finetune", params=params.with_overrides({"reparam.lambda_init": 3.0}))
    assert new != leftover
    assert fourth.client.get_run(leftover).info.status == "FAILED"
    fourth.end()

    # on_stale="fail": the leftover is closed FAILED, the rerun gets a fresh run.
    fifth = Tracker(uri=store, experiment="stale")
    fifth.start_parent(key="ws")
    leftover2 = fifth.start_child("evaluate")
    sixth = Tracker(uri=store, experiment="stale")
    sixth.start_parent(key="ws")
    new2 = sixth.start_child("evaluate", on_stale="fail")
    assert new2 != leftover2
    assert sixth.client.get_run(leftover2).info.status == "FAILED"
    sixth.end()
    sixth.end_parent()
    runs = _all_runs(sixth)
    assert [r.info.run_id for r in runs if r.info.status == "RUNNING"] == []
    assert len([r for r in runs if r.data.tags.get(KIND_TAG) == "parent"]) == 1


def test_resume_parent_by_id_and_key(store: str) -> None:
    a = Tracker(uri=store, experiment="env")
    parent = a.start_parent("pipeline", key="host:/work/repo")
    assert a.client.get_run(parent).data.tags["mlflow.source.type"] == "LOCAL"  # MLflow's context tags
    b = Tracker(uri=store, experiment="env")  # the next stage's process under `dvc repro`
    assert b.start_parent("ignored-name", key="host:/work/repo") == parent
    assert Tracker(uri=store, experiment="env").start_parent("sweep") != parent  # nothing adopts a sweep
    c = Tracker(uri=store, experiment="env")
    assert c.start_parent(run_id=parent) == parent
    with pytest.raises(TrackingError, match="does not exist"):
        c.start_parent(run_id="0" * 32)


def test_reopen_child_by_id(store: str) -> None:
    """A Ray trial keeps its run id in its checkpoint and reattaches to exactly that run after a restore."""
    first = Tracker(uri=store, experiment="by-id")
    parent = first.start_parent("sweep")
    trial = first.start_child("trial_0001", params={"seed": 3})
    first.log_metrics({"acc": 0.5}, step=0)
    first.end("KILLED")
    second = Tracker(uri=store, experiment="by-id")
    second.start_parent(run_id=parent)
    assert second.start_child("trial_0001", params={"seed": 3}, run_id=trial) == trial
    second.log_metrics({"acc": 0.7}, step=1)
    second.end()
    run = second.client.get_run(trial)
    assert run.info.status == "FINISHED" and run.data.tags[ATTEMPT_TAG] == "2"
    assert [m.step for m in second.client.get_metric_history(trial, "acc")] == [0, 1]
    assert len(_all_runs(second)) == 2
    with pytest.raises(TrackingError, match="does not exist"):
        second.start_child("trial_0002", run_id="f" * 32)


def test_activate_for_fluent_calls_keeps_run_open(store: str) -> None:
    tracker = Tracker(uri=store, experiment="fluent")
    tracker.start_parent()
    run_id = tracker.start_child("report")
    with tracker.activate() as mlflow:
        mlflow.log_metric("fluent_metric", 3.0)
    run = tracker.client.get_run(run_id)
    assert run.data.metrics["fluent_metric"] == 3.0
    assert run.info.status == "RUNNING"  # leaving the fluent context must not end the stage's run
    tracker.end()
    assert tracker.client.get_run(run_id).info.status == "FINISHED"


# ------------------------------------------------------------------------------------- kill and re-run

_STAGE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stages.tracking.tracker import Tracker
    uri, mode, on_stale = sys.argv[1], sys.argv[2], sys.argv[3]
    t = Tracker(uri=uri, experiment="killed")
    parent = t.start_parent("pipeline", key="workspace")
    child = t.start_child("pretrain", params={"reparam": {"alpha_init": 1.0}}, on_stale=on_stale)
    t.log_metrics({"loss": 1.0}, step=0)
    print("READY", parent, child, flush=True)
    if mode == "hang":
        time.sleep(600)
    t.log_metrics({"loss": 0.5}, step=1)
    t.end()
    t.end_parent()
    print("DONE", parent, child, flush=True)
    """
)


def _run_stage(uri: str, mode: str, on_stale: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _STAGE_SCRIPT, uri, mode, on_stale],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )


@pytest.mark.slow
@pytest.mark.parametrize("on_stale", ["resume", "fail"])
def test_sigkilled_stage_rerun_leaves_no_duplicate_or_running_runs(store: str, on_stale: str) -> None:
    env = dict(os.environ)
    proc = _run_stage(store, "hang", on_stale, env)
    try:
        # the store is a copy of a template: the tracker may first say it moved its artifact locations
        line = proc.stdout.readline().split()
        while line and line[0] == "tracking:":
            line = proc.stdout.readline().split()
        assert line and line[0] == "READY", line
        _, parent1, child1 = line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    check = Tracker(uri=store, experiment="killed")
    assert check.client.get_run(child1).info.status == "RUNNING"  # what a SIGKILL leaves behind

    proc = _run_stage(store, "finish", on_stale, env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    done = [ln.split() for ln in out.splitlines() if ln.startswith("DONE")]
    ((_, parent2, child2),) = done
    assert parent2 == parent1  # re-attached to the pipeline's parent run
    runs = _all_runs(check)
    assert [r.info.run_id for r in runs if r.info.status == "RUNNING"] == []
    parents = [r for r in runs if r.data.tags.get(KIND_TAG) == "parent"]
    children = [r for r in runs if r.data.tags.get(STAGE_TAG) == "pretrain"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    if on_stale == "resume":
        assert child2 == child1
        assert len(children) == 1 and children[0].info.status == "FINISHED"
        assert children[0].data.tags[ATTEMPT_TAG] == "2"
    else:
        assert child2 != child1
        status = {r.info.run_id: r.info.status for r in children}
        assert status == {child1: "FAILED", child2: "FINISHED"}


def test_system_metrics_on_stage_run(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's own system metrics (``start_run(log_system_metrics=True)``), at MLflow's sampling variable."""
    import mlflow

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    tracker = Tracker(uri=store, experiment="sysmetrics")
    tracker.start_parent()
    run_id = tracker.start_child("pretrain", system_metrics=True)
    deadline = time.monotonic() + 20
    while not any(k.startswith("system/") for k in tracker.client.get_run(run_id).data.metrics):
        assert time.monotonic() < deadline, "no system metrics logged"
        time.sleep(0.25)
    with tracker.activate() as fluent:  # the stage's run is already MLflow's active run: used as it is
        assert fluent.active_run().info.run_id == run_id
    tracker.end("KILLED")
    assert mlflow.active_run() is None
    assert tracker.client.get_run(run_id).info.status == "KILLED"
    metrics = tracker.client.get_run(run_id).data.metrics
    assert 0.0 <= metrics["system/cpu_utilization_percentage"] <= 100.0 * (os.cpu_count() or 1)
    assert metrics["system/system_memory_usage_megabytes"] > 0


@pytest.mark.slow
def test_log_torch_model_roundtrip(store: str) -> None:
    import mlflow
    import mlflow.pytorch
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    x = torch.randn(5, 4)
    tracker = Tracker(uri=store, experiment="models")
    tracker.start_parent()
    run_id = tracker.start_child("finetune")
    tracker.log_torch_model(model, name="tcnn")
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    tracker.end()
    (logged,) = tracker.client.search_logged_models(experiment_ids=[tracker.experiment_id])
    assert logged.name == "tcnn" and logged.source_run_id == run_id
    loaded = mlflow.pytorch.load_model(logged.artifact_location)  # no global tracking URI needed
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


# ------------------------------------------------------------------------------ stage_run: the DVC chain


def _chain_params(store: str, **overrides: object) -> Params:
    return Params().with_overrides({"tracking.uri": store, "tracking.experiment": "chain", **overrides})


@pytest.fixture
def chain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DVC_ROOT", "DVC_EXP_NAME", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"):
        monkeypatch.delenv(var, raising=False)


def test_stage_run_failure_fails_child_and_parent_and_the_rerun_continues(
    store: str, tmp_path: Path, chain_env: None
) -> None:
    from stages.report_inputs import read_run_ids

    params = _chain_params(store)
    with stage_run(params, "prepare", root=tmp_path) as t:
        parent = t.parent_run_id
    with pytest.raises(RuntimeError, match="boom"), stage_run(params, "pretrain", root=tmp_path):
        raise RuntimeError("boom")
    client = t.client
    assert client.get_run(parent).info.status == "FAILED"  # nothing left RUNNING after a failure
    assert client.get_run(parent).data.tags["tcnn.failed_stage"] == "pretrain"
    with stage_run(params, "pretrain", root=tmp_path) as t2:  # the next `dvc repro` continues the execution
        assert t2.parent_run_id == parent
        resumed = t2.run_id
    with stage_run(params, "report", root=tmp_path, end_parent=True):
        pass
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.tags["tcnn.resumes"] == "1"
    assert "tcnn.failed_stage" not in run.data.tags
    kids = [r for r in _all_runs(t2) if r.data.tags.get(PARENT_TAG) == parent]
    assert sorted((r.data.tags[STAGE_TAG], r.info.status) for r in kids) == [
        ("prepare", "FINISHED"), ("pretrain", "FAILED"), ("pretrain", "FINISHED"), ("report", "FINISHED"),
    ]  # fmt: skip
    ids, note = read_run_ids(tmp_path)
    assert note is None
    latest = {r.data.tags[STAGE_TAG]: r.info.run_id for r in kids if r.info.status == "FINISHED"}
    assert latest["pretrain"] == resumed
    assert ids == {"parent": parent, **latest}  # what the report shows
    assert run.data.params["alpha_init"] == "1.0"  # the parent carries the params


def test_stage_run_preempted_is_killed(store: str, tmp_path: Path, chain_env: None) -> None:
    class Preempted(
        Exception
    ):  # core.training.stop_signals.Preempted: a stop signal, the stage resumes when run again
        pass

    with pytest.raises(Preempted), stage_run(_chain_params(store), "finetune", root=tmp_path) as t:
        raise Preempted("SIGTERM")
    (child,) = [r for r in _all_runs(t) if r.data.tags.get(STAGE_TAG) == "finetune"]
    parent = t.client.get_run(child.data.tags[PARENT_TAG])
    assert (child.info.status, parent.info.status) == ("KILLED", "KILLED")


def test_stage_run_new_params_supersede_an_interrupted_parent(
    store: str, tmp_path: Path, chain_env: None
) -> None:
    with stage_run(_chain_params(store), "prepare", root=tmp_path) as t:
        first = t.parent_run_id
    with stage_run(_chain_params(store, **{"reparam.alpha_init": 2.0}), "prepare", root=tmp_path) as t2:
        second = t2.parent_run_id
    assert second != first
    old = t2.client.get_run(first)
    assert old.info.status == "FINISHED" and old.data.tags[CHAIN_TAG] == "superseded"
    assert t2.client.get_run(second).data.params["alpha_init"] == "2.0"
    ids = json.loads((tmp_path / "runs" / "mlflow_runs.json").read_text())
    assert ids["parent"] == second and list(ids["stages"]) == ["prepare"]


def test_stage_run_under_dvc_exp_run(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dvc exp run`: the experiment's name names the parent; a relative sqlite store resolves in $DVC_ROOT
    (the main repository, also when DVC runs the experiment in a temporary copy)."""
    main = tmp_path / "main"
    main.mkdir()
    monkeypatch.setenv("DVC_ROOT", str(main))
    monkeypatch.setenv("DVC_EXP_NAME", "brave-owl")
    params = Params().with_overrides({"tracking.uri": "sqlite:///mlruns.db", "tracking.experiment": "exp"})
    with stage_run(params, "reparam", root=tmp_path / "temp-copy") as t:
        parent = t.client.get_run(t.parent_run_id)
    assert t.uri == f"sqlite:///{main / 'mlruns.db'}"
    assert parent.info.run_name == "brave-owl" and parent.data.tags["tcnn.dvc_exp_name"] == "brave-owl"
    assert (tmp_path / "temp-copy" / "runs" / "mlflow_runs.json").is_file()


def test_every_stage_closes_its_parent_and_the_chain_reopens_it(
    store: str, tmp_path: Path, chain_env: None
) -> None:
    """A stage (under DVC or run by hand) leaves no run RUNNING; the chain's next stage reopens the same
    parent, and after the last stage the next execution gets a new one."""
    params = _chain_params(store, seed=3)
    with stage_run(params, "prepare", root=tmp_path) as t:
        parent = t.parent_run_id
        assert t.client.get_run(parent).info.status == "RUNNING"
    client = t.client
    run = client.get_run(parent)
    assert (run.info.status, run.data.tags[CHAIN_TAG]) == ("FINISHED", "open")
    assert (
        run.info.run_name
        == run_label(params)
        == "tcnn resnet10_cifar_os16 fashion_mnist t1=2 alpha=1 lambda=1 f=1 seed=3"
    )
    assert run.data.tags[PARAMS_HASH_TAG] == params_hash(params)
    with stage_run(params, "corrupt", root=tmp_path) as t2:  # `python -m stages.corrupt` by hand
        assert t2.parent_run_id == parent
    with stage_run(params, "report", root=tmp_path, end_parent=True) as t3:
        assert t3.parent_run_id == parent
    run = client.get_run(parent)
    assert (run.info.status, run.data.tags[CHAIN_TAG]) == ("FINISHED", "complete")
    assert "tcnn.resumes" not in run.data.tags  # reopened by the chain's stages, never after a failure
    with stage_run(params, "prepare", root=tmp_path) as t4:  # the next execution
        assert t4.parent_run_id != parent
    assert [r.info.run_id for r in _all_runs(t4) if r.info.status == "RUNNING"] == []


def test_parent_names_and_params_hash() -> None:
    base = Params()
    assert run_label(base) == "tcnn resnet10_cifar_os16 fashion_mnist t1=2 alpha=1 lambda=1 f=1 seed=0"
    other = base.with_overrides({"reparam.alpha_init": 0.5, "data.sample_fraction": 0.25, "seed": 2})
    assert run_label(other) == "tcnn resnet10_cifar_os16 fashion_mnist t1=2 alpha=0.5 lambda=1 f=0.25 seed=2"
    assert run_label(base.with_overrides({"model.kind": "psa"})).startswith(
        "psa resnet10_cifar_os16 fashion_mnist t1=2 alpha=1 f=1"
    )
    assert (
        run_label(base.with_overrides({"model.kind": "cnn"}))
        == "cnn resnet10_cifar_os16 fashion_mnist f=1 seed=0"
    )
    assert params_hash(base) != params_hash(other)
    # where runs are logged is not part of what they compute
    assert params_hash(base.with_overrides({"tracking.experiment": "elsewhere"})) == params_hash(base)


def test_experiment_opens_on_training_runs(store: str) -> None:
    """MLflow 3's UI opens a model-training experiment on its runs, not on the GenAI overview."""
    tracker = Tracker(uri=store, experiment="kind-new")
    assert tracker.client.get_experiment(tracker.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    legacy = tracker.client.create_experiment("kind-old")  # made before tcnn tagged its experiments
    Tracker(uri=store, experiment="kind-old")
    assert tracker.client.get_experiment(legacy).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_a_copied_workspace_logs_its_artifacts_into_itself(tmp_path: Path, capsys) -> None:
    """`cp -a` of a workspace: the copy's store rewrites its artifact locations to the copy's folder,
    so its new runs' artifacts land in the copy's mlartifacts and its old runs read the copied files; the
    original store and its folder are untouched."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    first = Tracker(uri="sqlite:///mlruns.db", experiment="t", base_dir=a)
    (a / "note.txt").write_text("from a\n")
    old = first.client.create_run(first.experiment_id).info.run_id
    first.client.log_artifact(old, str(a / "note.txt"))
    first.client.set_terminated(old)
    before = sorted(p.relative_to(a) for p in (a / "mlartifacts").rglob("*"))
    shutil.copytree(a, b, symlinks=True)  # as cp -a does

    copy = Tracker(uri="sqlite:///mlruns.db", experiment="t", base_dir=b)
    assert f"was copied from {a.resolve()}" in capsys.readouterr().out
    exp = copy.client.get_experiment(copy.experiment_id)
    assert exp.artifact_location == (b.resolve() / "mlartifacts").as_uri()
    assert copy.client.get_run(old).info.artifact_uri.startswith((b.resolve() / "mlartifacts").as_uri() + "/")
    new = copy.client.create_run(copy.experiment_id).info.run_id
    (b / "new.txt").write_text("from b\n")
    copy.client.log_artifact(new, str(b / "new.txt"))
    assert (b / "mlartifacts" / new / "artifacts" / "new.txt").read_text() == "from b\n"
    assert sorted(p.relative_to(a) for p in (a / "mlartifacts").rglob("*")) == before  # nothing written in a
    again = Tracker(uri="sqlite:///mlruns.db", experiment="t", base_dir=a)
    assert "was copied" not in capsys.readouterr().out  # the original stays where it is
    assert again.client.get_run(old).info.artifact_uri.startswith(
        (a.resolve() / "mlartifacts").as_uri() + "/"
    )


_READER_SCRIPT = textwrap.dedent(
    """
    import sys
    import mlflow  # imported before READY: what follows READY is only the store's creation
    from stages.tracking.store import store_client
    print("READY", flush=True)
    client = store_client(sys.argv[1])
    print("EXPERIMENTS", len(client.search_experiments()), flush=True)
    """
)


def test_a_reader_does_not_create_a_store_a_writer_is_creating(tmp_path: Path) -> None:
    """A script reading a new sqlite store (a test polling a running sweep, a user's notebook) waits for the lock
    a Tracker holds while it creates the schema, instead of migrating it alongside (sqlite: 'database is
    locked', seen when a poll raced a sweep driver)."""
    from filelock import FileLock

    db = tmp_path / "mlruns.db"
    with FileLock(str(db) + ".lock"):  # what a Tracker holds while it creates the store
        reader = subprocess.Popen(
            [sys.executable, "-c", _READER_SCRIPT, f"sqlite:///{db}"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
        )  # fmt: skip
        assert reader.stdout is not None and reader.stdout.readline().strip() == "READY"
        time.sleep(2.0)
        assert reader.poll() is None and not db.exists(), "the reader opened the store past the creation lock"
    out, _ = reader.communicate(timeout=120)
    assert reader.returncode == 0 and out.split() == [
        "EXPERIMENTS",
        "1",
    ]  # it created the store after the lock


def test_git_dirty_ignores_what_the_pipeline_writes_and_sees_the_users_edits(tmp_path: Path) -> None:
    """A fresh clone's first `dvc repro` rewrites dvc.lock and the git-tracked metrics and plot tables: not
    dirty. An edited tracked file of the user's (params.yaml, a module), staged or not, is."""
    from stages.harness import chain
    from stages.harness.stage_run import git_dirty

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t.invalid", "-c",
           "commit.gpgsign=false"]  # fmt: skip
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    outs = ["dvc.lock", "runs/pretrain/metrics.json", "results/headline/tcnn.json", "runs/finetune/gpsa.csv"]
    assert {"runs/pretrain/metrics.json", "runs/finetune/gpsa.csv", "results/headline"} <= set(
        chain.all_outputs()
    )
    for rel in [*outs, "params.yaml", "core/x.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("committed\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    assert git_dirty(tmp_path) is False
    for rel in outs:  # what `dvc repro` writes
        (tmp_path / rel).write_text("rewritten by the pipeline\n")
    assert git_dirty(tmp_path) is False
    (tmp_path / "params.yaml").write_text("edited\n")
    assert git_dirty(tmp_path) is True
    subprocess.run([*git, "add", "params.yaml"], check=True)  # staged counts too
    assert git_dirty(tmp_path) is True
    subprocess.run([*git, "reset", "-q", "--hard"], check=True)
    (tmp_path / "core" / "x.py").unlink()  # a deleted module is a change
    assert git_dirty(tmp_path) is True


def test_an_environment_tracking_uri_that_differs_is_named_and_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`$MLFLOW_TRACKING_URI` naming another store: one line says it is not used and where runs go; the runs go
    to the params' store. The same store in both, or tracking off: nothing said."""
    params = Params().with_overrides({"tracking.uri": f"sqlite:///{tmp_path / 'params.db'}"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'env.db'}")
    tracker = Tracker.from_params(params)
    tracker.start_parent("p")
    (line,) = [
        ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tracking:")
    ]  # MLflow logs too
    assert line.startswith("tracking: $MLFLOW_TRACKING_URI (sqlite:///") and "env.db) is not used" in line
    assert f"runs go to tracking.uri sqlite:///{tmp_path / 'params.db'}" in line
    assert (tmp_path / "params.db").is_file() and not (tmp_path / "env.db").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'params.db'}")
    Tracker.from_params(params)
    Tracker.from_params(params.with_overrides({"tracking.enabled": False}))
    assert "tracking:" not in capsys.readouterr().err
