"""Issue 59's sweep endings: a trial no node can hold is refused before any compute (locally, on a Ray cluster,
in a SLURM request), and a driver ended by a bug closes its MLflow parent FAILED and leaves no half sweep. Real
Ray (local, one CPU, started once) and real MLflow (sqlite under tmp_path); the bug is injected."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_sweep import make_project

from pipelines.sweep import driver
from pipelines.sweep.driver_lock import LOCK, driver_lock
from pipelines.sweep.plan import SweepError
from pipelines.sweep.sweep_params import load_sweep_params
from pipelines.sweep.sweep_spec import build_spec, check_resources
from stages.tracking.store import store_client

NODE = {"CPU": 4.0, "GPU": 1.0}


def _spec(root: Path, *sets: str, name: str = "s") -> dict:
    params = load_sweep_params(root / "params.yaml", list(sets))
    return build_spec(params, name=name, params_file=root / "params.yaml", cwd=root)


def test_check_resources_refuses_what_no_node_holds(tmp_path: Path) -> None:
    make_project(tmp_path, {"seed": [0, 1]})
    check_resources(_spec(tmp_path, "sweep.gpus_per_trial=1", "sweep.cpus_per_trial=4"), [NODE], "here")
    with pytest.raises(SweepError, match=r"^sweep\.gpus_per_trial: a trial needs 1 GPU on one node, and no node "
                       r"of here has that many \(nodes: 4 CPU / 0 GPU\)"):  # fmt: skip
        check_resources(_spec(tmp_path, "sweep.gpus_per_trial=1"), [{"CPU": 4.0}], "here")
    with pytest.raises(SweepError, match=r"^sweep\.cpus_per_trial: a trial needs 8 CPU on one node"):
        check_resources(_spec(tmp_path, "sweep.cpus_per_trial=8"), [NODE, NODE], "here")
    # two data-parallel workers of 1 GPU each: two 1-GPU nodes hold them, one does not
    two = _spec(tmp_path, "workers_per_trial=2", "sweep.gpus_per_trial=2", "sweep.cpus_per_trial=2")
    check_resources(two, [NODE, NODE], "here")
    with pytest.raises(SweepError, match=r"a trial asks for 2 GPU in all \(workers_per_trial=2\)"):
        check_resources(two, [NODE], "here")


def test_a_published_set_that_does_not_fit_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """Issue 59 (9): the sweep runs dvc.yaml's check stage's check (stages.published_check) while it plans,
    before Ray: a CIFAR-10-C copy with float labels never reaches a trial's evaluate."""
    import numpy as np

    make_project(tmp_path, {"seed": [0, 1]})
    (tmp_path / "pub").mkdir()
    for c in ("gaussian_noise", "contrast"):
        np.save(tmp_path / "pub" / f"{c}.npy", np.zeros((20, 28, 28, 1), np.uint8))
    np.save(tmp_path / "pub" / "labels.npy", np.arange(20) % 10 + 0.5)
    sets = ("data.name=cifar10", f"robustness.public={{kind: cifar10_c, dir: {tmp_path / 'pub'}, use: add}}")
    with pytest.raises(
        SweepError, match=r"^robustness\.public: .*pub/labels\.npy: labels must be integers, got float64$"
    ):
        _spec(tmp_path, *sets)
    np.save(tmp_path / "pub" / "labels.npy", np.arange(20) % 10)
    assert _spec(tmp_path, *sets)["trials"]  # fits: planned
    assert not (tmp_path / "sweeps").exists()


def test_a_slurm_request_without_the_gpus_a_trial_needs_is_refused_before_submitting(tmp_path: Path) -> None:
    make_project(tmp_path, {"seed": [0, 1]})
    p = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "sweep", "--slurm", "--name", "g", "-S", "sweep.gpus_per_trial=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "tcnn sweep: error: sweep.gpus_per_trial: a trial needs 1 GPU on one node, and no node of the SLURM job "
        "(1 node(s) x 1 CPUs, 0 GPUs: --cpus-per-node, --gpus-per-node) has that many (nodes: 1 CPU / 0 GPU); "
        "lower it or add such a node"
    ]
    assert not (tmp_path / "sweeps").exists()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import signal

    import ray

    # ray.init installs Ray's SIGTERM handler (sys.exit) in pytest's process and shutdown leaves it: put back
    # what was there at once, or a later test of this worker chaining to it (test_train_fit) exits instead
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    for s, handler in handlers.items():
        signal.signal(s, handler)
    yield
    ray.shutdown()


def _runs(root: Path) -> list:
    if not (root / "mlruns.db").exists():
        return []
    client = store_client(f"sqlite:///{root / 'mlruns.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(exps)) if exps else []


@pytest.mark.slow
def test_a_gpu_per_trial_on_a_cluster_without_one_is_refused_before_anything(
    tmp_path: Path, local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TCNN_TRACKING", "1")
    make_project(tmp_path, {"seed": [0, 1]})
    with pytest.raises(SweepError, match=r"^sweep\.gpus_per_trial: a trial needs 1 GPU on one node, and no node "
                       r"of the local Ray has that many \(nodes: 1 CPU / 0 GPU\)"):  # fmt: skip
        driver.run_sweep(_spec(tmp_path, "sweep.gpus_per_trial=1"))
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "data-c").exists() and _runs(tmp_path) == []


@pytest.mark.slow
def test_a_driver_ended_by_a_bug_closes_its_parent_failed_and_leaves_no_half_sweep(
    tmp_path: Path, local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug (injected where the driver builds the shared corrupted sets, after the parent opened and
    sweep.json was written) keeps its traceback; the parent ends FAILED, the directory and its lock are gone,
    and the same command then starts the sweep afresh (no "exists: pass --resume")."""
    monkeypatch.setenv("TCNN_TRACKING", "1")
    make_project(tmp_path, {"seed": [0, 1]})

    def bug(spec: dict, keys: list[str]) -> None:
        assert (Path(spec["sweep_dir"]) / "sweep.json").is_file() and (
            Path(spec["sweep_dir"]) / LOCK
        ).exists()
        raise RuntimeError("an injected bug")

    monkeypatch.setattr(driver, "_ensure_corrupted", bug)
    with pytest.raises(RuntimeError, match="an injected bug"):
        driver.run_sweep(_spec(tmp_path))
    runs = _runs(tmp_path)
    assert [(r.info.run_name, r.info.status) for r in runs] == [("sweep:s", "FAILED")]
    assert not (tmp_path / "sweeps" / "s").exists()
    monkeypatch.setattr(
        driver, "_ensure_corrupted", lambda spec, keys: (_ for _ in ()).throw(KeyError("again"))
    )
    with pytest.raises(KeyError):  # the same command runs again (not refused as an existing sweep)
        driver.run_sweep(_spec(tmp_path))
    assert sorted(r.info.status for r in _runs(tmp_path)) == ["FAILED", "FAILED"]


def test_the_driver_lock_refuses_a_second_driver_and_is_removed_after(tmp_path: Path) -> None:
    with driver_lock(tmp_path / "s"):
        assert (tmp_path / "s" / LOCK).exists()
        with (
            pytest.raises(SweepError, match="another driver is running it"),
            driver_lock(tmp_path / "s"),
        ):
            pass
        assert (tmp_path / "s" / LOCK).exists()  # the refused driver removed nothing
    assert list((tmp_path / "s").iterdir()) == []
