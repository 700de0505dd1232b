"""infra/mlflow/server.sh: a real MLflow server on loopback, written to through the tracking adapter."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.tracking.names import PARENT_TAG
from stages.tracking.tracker import Tracker

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "infra" / "mlflow" / "server.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outside_ip() -> str | None:
    """This machine's non-loopback address, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent for a UDP connect
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCNN_MLFLOW_")}
    env.update(
        TCNN_MLFLOW_PORT=str(port),
        TCNN_MLFLOW_BACKEND_URI=f"sqlite:///{tmp_path}/server/mlflow.db",
        TCNN_MLFLOW_ARTIFACTS=str(tmp_path / "server" / "artifacts"),
        TCNN_MLFLOW_STATE=str(tmp_path / "server" / "state"),
        TCNN_MLFLOW_WORKERS="1",
    )
    env.update(extra)
    return env


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    env = _env(tmp_path, port)
    res = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert res.returncode == 0, res.stderr
        url = res.stdout.strip().splitlines()[-1]
        assert url == f"http://127.0.0.1:{port}"
        yield url
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=60)
        with (
            contextlib.suppress(ConnectionRefusedError, OSError),
            socket.create_connection(("127.0.0.1", port), 1),
        ):
            pytest.fail("the server still answers after stop")


@pytest.mark.slow
def test_server_roundtrip_through_adapter(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(server.rsplit(":", 1)[1])
    outside = _outside_ip()
    if outside is not None:  # bound to loopback only
        with pytest.raises(OSError), socket.create_connection((outside, port), timeout=2):
            pass

    tracker = Tracker(uri=server, experiment="server-test")
    parent = tracker.start_parent("sweep", {"origin": "test"})
    child = tracker.start_child("trial_0", params={"reparam": {"alpha_init": 2.0}, "seed": 1})
    for step in range(3):
        tracker.log_metrics({"val_acc": 0.1 * step}, step=step)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True}))
    tracker.log_artifact(report, "reports")
    tracker.end()
    tracker.end_parent()

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server)
    exp = client.get_experiment_by_name("server-test")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {parent, child}
    assert runs[child].data.tags[PARENT_TAG] == parent
    assert runs[child].data.params == {"alpha_init": "2.0", "seed": "1"}
    assert [(m.step, m.value) for m in client.get_metric_history(child, "val_acc")] == [
        (0, 0.0),
        (1, 0.1),
        (2, 0.2),
    ]
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    # Artifacts go through the server (proxied) into its artifacts destination.
    assert runs[child].info.artifact_uri.startswith("mlflow-artifacts:")
    got = client.download_artifacts(child, "reports/report.json", str(tmp_path / "download"))
    assert json.loads(Path(got).read_text()) == {"ok": True}
    stored = list((tmp_path / "server" / "artifacts").rglob("report.json"))
    assert len(stored) == 1


def test_bad_backend_is_one_clear_error(tmp_path: Path) -> None:
    env = _env(tmp_path, _free_port(), TCNN_MLFLOW_BACKEND_URI="ftp://nowhere/db")
    res = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "mlflow server: error: TCNN_MLFLOW_BACKEND_URI: unsupported backend 'ftp://nowhere/db' "
        "(sqlite:///PATH or postgresql://...)"
    ]
    assert not (tmp_path / "server").exists()


def test_bad_port_is_one_clear_error(tmp_path: Path) -> None:
    env = _env(tmp_path, 0, TCNN_MLFLOW_PORT="http")
    res = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "TCNN_MLFLOW_PORT: bad port 'http'" in res.stderr
