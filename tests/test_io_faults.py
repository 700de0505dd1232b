"""I/O and tracking-store faults end a stage with one line naming the file, exit 74 (sysexits EX_IOERR), and no
MLflow run left RUNNING. The faults are real ones: a file-size limit (RLIMIT_FSIZE, what a full disk
does to a writer), a file where a folder must be, a folder where the lock file must be, a damaged sqlite store.
The stage here is the real harness (stages.harness.runner.stage_main, MLflow on a sqlite store) around a trivial run."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _train_helpers import repo_pythonpath, stage_env, tiny_params, write_params

from core.utils.workspace import LOCK_FILE
from stages.harness.tracking import store_client

STAGE = textwrap.dedent(
    """
    import sys
    from stages.harness.runner import stage_main
    sys.exit(stage_main("prepare", lambda params: {"ok": 1}, sys.argv[1:]))
    """
)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace whose stage ran once: a working store holding one finished parent and child."""
    ws = tmp_path_factory.mktemp("io") / "ws"
    ws.mkdir()
    raw = tiny_params(
        ws / "data", tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "t"}
    )
    write_params(ws / "params.yaml", raw)
    proc = _stage(ws)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ws


def _stage(ws: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAGE], cwd=ws, env=stage_env(TCNN_TRACKING="1", PYTHONPATH=repo_pythonpath()),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and " INFO mlflow." not in ln]


def _statuses(ws: Path) -> list[str]:
    client = store_client(f"sqlite:///{ws / 'mlruns.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return [r.info.status for r in client.search_runs(exps)]


def test_a_checkpoint_write_past_the_file_size_limit_names_the_file(tmp_path: Path) -> None:
    """torch's zip writer reports the failed write as a RuntimeError (inline_container.cc); atomic_save turns it
    into an OSError that names the destination, and leaves neither the destination nor a temp file."""
    code = textwrap.dedent(
        f"""
        import torch
        from core.training.checkpoint import atomic_save
        try:
            atomic_save({{"w": torch.zeros(1_000_000)}}, {str(tmp_path / "ckpt.pt")!r})
        except OSError as err:
            print(type(err).__name__, err.filename, err.strerror)
        """
    )
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))  # noqa: E731
    proc = subprocess.run([sys.executable, "-c", code], env=stage_env(PYTHONPATH=repo_pythonpath()), capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        proc.stdout.startswith(f"OSError {tmp_path / 'ckpt.pt'} writing failed (")
        and "MiB free there" in proc.stdout
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,fragment",
    [
        ("runs is a file", "runs: File exists"),
        ("the lock path is a folder", f"{LOCK_FILE}: Is a directory"),
        ("the store is damaged", "tracking store: file is not a database"),
    ],
)
def test_io_and_store_faults_are_one_line_and_close_every_run(
    finished: Path, tmp_path: Path, fault: str, fragment: str
) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(finished, ws)
    if fault == "runs is a file":
        (ws / "runs" / "mlflow_runs.json").unlink()
        (ws / "runs").rmdir()
        (ws / "runs").write_text("not a folder\n")
    elif fault == "the lock path is a folder":
        (ws / LOCK_FILE).unlink(missing_ok=True)
        (ws / LOCK_FILE).mkdir()
    else:
        (ws / "mlruns.db").write_bytes(b"\x00garbage" * 4096)
    proc = _stage(ws)
    lines = _lines(proc)
    assert proc.returncode == 74 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("prepare: error: ") and fragment in lines[0], lines[0]
    if fault == "runs is a file":  # failed after this copy's parent and child opened: both end FAILED
        assert sorted(_statuses(ws)) == ["FAILED", "FAILED", "FINISHED", "FINISHED"]
    elif fault == "the lock path is a folder":  # refused before any run opened
        assert sorted(_statuses(ws)) == ["FINISHED", "FINISHED"]


def test_atomic_writes_get_the_umask_permissions(tmp_path: Path) -> None:
    from core.utils.atomic import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        atomic_write_json(tmp_path / "b.json", {"x": 1})
        assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
