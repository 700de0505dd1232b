"""`tcnn sweep --slurm`: a 2 x 2 sweep through SLURM -> Ray -> MLflow on the local test cluster, with a
time-limit requeue mid-sweep (USR2, as SLURM sends it before the limit): every trial finishes exactly once."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, start_cluster
from test_sweep import TCNN, make_project, sweep_env
from test_sweep_ray import GRID, pretrain_epoch_lines, stage_counts, sweep_runs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    return start_cluster()


def test_sweep_via_slurm_survives_requeue(cluster: SlurmCluster, tmp_path: Path) -> None:
    make_project(tmp_path, GRID, finetune={"epochs": 2})
    sweep_dir = tmp_path / "sweeps" / "sl"
    cmd = [
        TCNN, "sweep", "--params", "params.yaml", "--name", "sl", "--slurm", "--cpus-per-node",
        str(min(2, cluster.cpus)), "--partition", cluster.partition, "--time", "30", "--object-store-mb", "200",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=sweep_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    job_id = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            m = re.search(r"submitted SLURM job (\d+)", line)
            if m:
                job_id = m.group(1)
                break
        assert job_id, "".join(out)
        reader.start()
        deadline = time.monotonic() + 600
        while not list(sweep_dir.glob("trials/*/done.json")):
            assert proc.poll() is None, "".join(out)[-3000:]
            assert time.monotonic() < deadline, "no trial finished in the SLURM job"
            time.sleep(0.5)
        done_before = {p.parent.name for p in sweep_dir.glob("trials/*/done.json")}
        assert len(done_before) < 4, "the sweep finished before the requeue"
        cluster.run("scancel", job_id, "--signal", "USR2")  # the time-limit warning: submitit requeues
        cluster.release_requeued(job_id, log_dir=sweep_dir / "slurm")
        rc = proc.wait(timeout=900)
    except BaseException:
        if job_id:
            cluster.run("scancel", job_id, check=False)
        proc.kill()
        raise
    reader.join(10)
    log = "".join(out)
    assert rc == 0, log[-3000:]
    assert int(cluster.job_field(job_id, "Restarts") or 0) >= 1  # it was requeued
    assert "results: " in log and "summary.parquet" in log

    parent, children = sweep_runs(tmp_path, "sl")
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials"] == 4 and parent.data.metrics["pretrain_runs"] == 1
    assert len(children) == 4 and len({c.data.tags["tcnn.trial"] for c in children}) == 4
    assert {c.info.status for c in children} == {"FINISHED"}
    for t in (sweep_dir / "trials").iterdir():
        counts = stage_counts(t)
        assert counts.get("reparam") == counts.get("finetune") == counts.get("evaluate") == 1, (
            t.name,
            counts,
        )
        if t.name in done_before:
            assert json.loads((t / "trial.json").read_text())["attempts"] == 1  # not run again
    assert pretrain_epoch_lines(sweep_dir) == 1
    heads = sorted(p.name for p in (sweep_dir / "slurm" / "ray-logs").glob("*-head.log"))
    assert heads == [f"{job_id}-0-head.log", f"{job_id}-1-head.log"]  # a fresh Ray cluster per run of the job


def test_a_search_with_asha_runs_through_slurm(cluster: SlurmCluster, tmp_path: Path) -> None:
    """`sweep.search` + `sweep.scheduler` in the SLURM job (the driver inside the allocation runs the search's
    Tune experiment): every point run by both arms, each arm's choice made, one MLflow run per trial."""
    import pyarrow.parquet as pq
    import yaml

    path = make_project(tmp_path, {}, finetune={"epochs": 2})
    raw = yaml.safe_load(path.read_text())
    raw["sweep"] |= {"search": {"space": {"finetune.lr": {"loguniform": [1e-3, 0.1]}}, "num_samples": 2,
                                "min_finished": 1},
                     "scheduler": {"grace_period": 1, "reduction_factor": 2}}  # fmt: skip
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cmd = [TCNN, "sweep", "--params", "params.yaml", "--name", "se", "--slurm", "--cpus-per-node",
           str(min(2, cluster.cpus)), "--partition", cluster.partition, "--time", "30", "--object-store-mb", "200"]  # fmt: skip
    res = subprocess.run(cmd, cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "se"
    rows = pq.read_table(sweep_dir / "search.parquet").to_pylist()
    assert [(r["point"], r["arm"]) for r in rows] == [(p, a) for p in range(2) for a in ("tcnn", "control")]
    assert (
        rows[0]["finetune.lr"] == rows[1]["finetune.lr"] and rows[2]["finetune.lr"] == rows[3]["finetune.lr"]
    )
    chosen = json.loads((sweep_dir / "chosen.json").read_text())
    assert chosen["tcnn"]["trial"].endswith("-tcnn") and chosen["control"]["trial"].endswith("-control")
    parent, children = sweep_runs(tmp_path, "se")
    assert parent.info.status == "FINISHED" and parent.data.metrics["search_points"] == 2
    assert sorted(c.info.run_name for c in children) == sorted(r["trial"] for r in rows)
    assert {c.info.status for c in children} == {"FINISHED"}
