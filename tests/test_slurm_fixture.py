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
