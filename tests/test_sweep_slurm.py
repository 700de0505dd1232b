"""`tcnn sweep --slurm` on a one-node local test cluster: a search with ASHA through SLURM -> Ray -> MLflow.

A sweep through a time-limit requeue (USR2, as SLURM sends it before the limit) and a lost node is
tests/test_slurm_multinode.py's two-node sweep, the suite's one requeued sweep (a one-node copy of it cost
~160 s; its checks are the two-node one's, which now requeues by USR2 too)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, start_cluster
from test_sweep import TCNN, make_project, sweep_env
from test_sweep_ray import sweep_runs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    return start_cluster()


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
