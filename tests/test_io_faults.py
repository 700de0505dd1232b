"""I/O and tracking-store faults end a stage with one line naming the file, exit 74 (sysexits EX_IOERR), and no
MLflow run left RUNNING. The faults are real ones: a file-size limit (RLIMIT_FSIZE, what a full disk
does to a writer), a file where a folder must be, a folder where the lock file must be, a damaged sqlite store,
a store deleted, replaced or removed with its folder while the stage runs, a store past the file-size limit.
The stage here is the real harness (stages.harness.runner.stage_main, MLflow on a sqlite store) around a trivial run."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _train_helpers import repo_pythonpath, stage_env, tiny_params, write_params

from core.utils.workspace import LOCK_FILE
from stages.tracking.store import store_client

STAGE = textwrap.dedent(
    """
    import sys
    from stages.harness.runner import stage_main
    sys.exit(stage_main("prepare", lambda params: {"ok": 1}, sys.argv[1:]))
    """
)


#: The trivial stage with a fault of the store while its runs are open (argv[1]: which).
FAULTY_STAGE = textwrap.dedent(
    """
    import os, shutil, sys
    from pathlib import Path
    from stages.harness.runner import stage_main

    def run(params):
        if sys.argv[1] == "deleted":
            os.unlink("mlruns.db")
        elif sys.argv[1] == "removed with its folder":
            shutil.rmtree(os.getcwd())
        elif sys.argv[1] == "replaced":
            Path("other").write_bytes(b"not a database\\n" * 100)
            os.replace("other", "mlruns.db")
        return {"ok": 1}

    sys.exit(stage_main("prepare", run, sys.argv[2:]))
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


def _stage(ws: Path, *argv: str, fsize: int | None = None, code: str = STAGE) -> subprocess.CompletedProcess:
    """The stage in ``ws`` (``fsize``: under that file-size limit, as ``ulimit -f``; Python ignores SIGXFSZ,
    so a write past it fails with EFBIG)."""
    limit = None if fsize is None else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize)))
    env = stage_env(TCNN_TRACKING="1", PYTHONPATH=repo_pythonpath())
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri in an earlier test of this process sets it
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)  # fmt: skip


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
        (
            "the store is damaged",
            "mlruns.db is not an sqlite database (damaged, or another file in its place)",
        ),
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


def _journals(where: Path) -> list[Path]:
    return sorted(where.rglob("*-journal")) if where.is_dir() else []


def _one_line(proc: subprocess.CompletedProcess) -> str:
    """stderr's only line (MLflow's and SQLAlchemy's own logging included: nothing else may be there)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 74 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,what",
    [
        ("deleted", "the MLflow store mlruns.db was deleted during the run"),
        ("removed with its folder", "mlruns.db was removed during the run with its folder"),
        (
            "replaced",
            "the MLflow store mlruns.db was replaced during the run by a file that is not an sqlite",
        ),
    ],
)
def test_a_store_gone_while_the_stage_runs_is_one_line(
    finished: Path, tmp_path: Path, fault: str, what: str
) -> None:
    """Issue 47: the store deleted (or replaced, or removed with its folder) under a running stage was 19 raw
    MLflow/SQLAlchemy tracebacks before a line that said 'attempt to write a readonly database'."""
    ws = tmp_path / "ws"
    shutil.copytree(finished, ws)
    line = _one_line(_stage(ws, fault, code=FAULTY_STAGE))
    assert line.startswith("prepare: error: ") and what in line, line
    assert _journals(tmp_path) == []
    if fault == "deleted":  # and nothing recreated an empty store in its place
        assert not (ws / "mlruns.db").exists()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_copied_store_past_the_file_size_limit_is_refused_before_its_rewrite(
    finished: Path, tmp_path: Path
) -> None:
    """Issue 47: the rewrite of a copied workspace's store (stages.tracking.store_location) under a file-size
    limit below the store's size was a raw sqlite3.OperationalError, exit 1 and a hot mlruns.db-journal: sqlite
    can neither write the store's pages past the limit nor roll them back. It is refused before any write."""
    ws = tmp_path / "copy"
    shutil.copytree(finished, ws)
    before = _digest(ws / "mlruns.db")
    line = _one_line(_stage(ws, fsize=100 * 1024))
    assert line.startswith("prepare: error: the MLflow store mlruns.db cannot be written: it is larger"), line
    assert "file-size limit (ulimit -f: 100 KiB)" in line, line
    assert _journals(tmp_path) == [] and _digest(ws / "mlruns.db") == before
    assert sorted(_statuses(ws)) == ["FINISHED", "FINISHED"]


@pytest.mark.slow
def test_a_store_write_past_the_file_size_limit_is_rolled_back(finished: Path, tmp_path: Path) -> None:
    """A limit just above the store's size (a disk that fills during the stage): the copy's locations are
    rewritten, MLflow's first write that grows the file fails, sqlite rolls it back (no journal), the stage
    ends with one line and its runs FAILED."""
    ws = tmp_path / "copy"
    shutil.copytree(finished, ws)
    line = _one_line(_stage(ws, fsize=(ws / "mlruns.db").stat().st_size + 4096))
    assert line.startswith("prepare: error: the MLflow store mlruns.db could not be written past"), line
    assert "file-size limit" in line and "(tracking store: disk I/O error)" in line, line
    assert _journals(tmp_path) == []
    with sqlite3.connect(ws / "mlruns.db") as con:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        (location,) = con.execute("SELECT artifact_location FROM experiments WHERE name = 't'").fetchone()
    assert location == (ws / "mlartifacts").as_uri()
    assert "RUNNING" not in _statuses(ws)


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


#: A stage named evaluate (its outs: dvc.yaml's) that writes its headline and metrics, then (argv[1] ==
#: "deleted") deletes the store before its MLflow logging: the logging fails, exit 74.
WRITING_STAGE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from stages.harness.runner import stage_main

    def run(params):
        Path("results/headline").mkdir(parents=True, exist_ok=True)
        Path("results/headline/tcnn_minus_control.json").write_text(sys.argv[2])
        Path("results/metrics.json").write_text(sys.argv[2])
        if sys.argv[1] == "deleted":
            os.unlink("mlruns.db")
        return {"ok": 1}

    sys.exit(stage_main("evaluate", run, sys.argv[3:]))
    """
)


@pytest.mark.slow
def test_a_store_fault_after_the_outputs_were_written_leaves_the_last_finished_ones(
    finished: Path, tmp_path: Path
) -> None:
    """Issue 59 (8): evaluate rewrote results/* (the git-tracked headline too) and then the store failed, exit
    74: the workspace held the headline of a run that did not finish. Now the outputs of the last run that
    finished are back in place (stages.harness.previous), and nothing is left aside."""
    ws = tmp_path / "ws"
    shutil.copytree(finished, ws)
    ok = _stage(ws, "none", '{"run": 1}', code=WRITING_STAGE)
    assert ok.returncode == 0, ok.stderr[-3000:]
    head, metrics = ws / "results/headline/tcnn_minus_control.json", ws / "results/metrics.json"
    assert head.read_text() == metrics.read_text() == '{"run": 1}'
    line = _one_line(_stage(ws, "deleted", '{"run": 2}', code=WRITING_STAGE))
    assert line.startswith("evaluate: error: the MLflow store mlruns.db was deleted during the run"), line
    assert head.read_text() == metrics.read_text() == '{"run": 1}'
    assert sorted(p.name for p in (ws / "results").iterdir()) == ["headline", "metrics.json"]
    assert not (ws / "runs/.previous").exists()
