"""The SLURM fixture's skip logic (no cluster needed): skip with a reason, or fail when TCNN_REQUIRE_SLURM=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import slurm_cluster


def _as_non_root_without_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(slurm_cluster, "STATE_DIR", tmp_path / "no-cluster-here")
    monkeypatch.setenv("TCNN_SLURM_DIR", str(tmp_path / "no-cluster-here"))


def test_skips_with_reason_when_it_cannot_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _as_non_root_without_cluster(monkeypatch, tmp_path)
    monkeypatch.delenv("TCNN_REQUIRE_SLURM", raising=False)
    with pytest.raises(pytest.skip.Exception) as info:
        slurm_cluster.start_cluster()
    reason = str(info.value)
    assert "needs root" in reason or "not installed" in reason


def test_required_cluster_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _as_non_root_without_cluster(monkeypatch, tmp_path)
    monkeypatch.setenv("TCNN_REQUIRE_SLURM", "1")
    with pytest.raises(pytest.fail.Exception, match="TCNN_REQUIRE_SLURM=1"):
        slurm_cluster.start_cluster()


def test_the_end_of_a_run_stops_only_the_clusters_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 59: the daemons of the clusters a run started are stopped at its end; a cluster another run (or
    the user) started is never touched. Here: the one-node cluster's marker names another run, the two-node
    cluster's this one, the three-node cluster has none (it was found running)."""
    state = tmp_path / "tcnn-slurm"
    monkeypatch.setattr(slurm_cluster, "STATE_DIR", state)
    for folder, run in (
        (state, "another-run"),
        (tmp_path / "tcnn-slurm-2n", "this-run"),
        (tmp_path / "tcnn-slurm-3n", None),
    ):
        (folder / "run").mkdir(parents=True)
        if run is not None:
            (folder / "run" / slurm_cluster.STARTED_BY).write_text(run)
    asked: list[tuple[int, bool]] = []
    monkeypatch.setattr(slurm_cluster, "_stop_one", lambda nodes, keep: asked.append((nodes, keep)) or "said")
    monkeypatch.delenv(slurm_cluster.KEEP_ENV, raising=False)
    assert slurm_cluster.stop_started_clusters("this-run") == ["said"]
    assert asked == [(2, False)]
    monkeypatch.setenv(slurm_cluster.KEEP_ENV, "1")
    assert slurm_cluster.stop_started_clusters("another-run") == ["said"]
    assert asked[1:] == [(1, True)]
