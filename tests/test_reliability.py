"""Every ending is clean (issue 26): a stop signal anywhere in a stage process closes its MLflow runs with the
right status, ends its workers and exits 75 (130 for Ctrl-C) with one line; a superseded parent closes its
children; what can be checked before compute is; damaged corrupted sets are refused or regenerated; one writer
per workspace; a new MLflow store survives concurrent first use; dvc.yaml's commands find the interpreter;
the smaller bad inputs give one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from _train_helpers import REPO, stage_env, tiny_params, write_dataset, write_params

from core.robustness import corruptions as C


def _workspace(tmp: Path, n_test: int = 2000, **robustness) -> Path:
    write_dataset(tmp / "data", n_train=300, n_test=n_test)
    raw = tiny_params(tmp / "data", robustness={"dir": "c", "n_images": n_test, "workers": 2, **robustness},
                      tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "t"})  # fmt: skip
    write_params(tmp / "params.yaml", raw)
    return tmp


def _runs(ws: Path) -> list:
    from mlflow import MlflowClient

    if not (ws / "mlruns.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{ws / 'mlruns.db'}")
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps]) if exps else []


def _stderr_lines(text: str) -> list[str]:
    """stderr without MLflow's own INFO logging of its system-metrics thread."""
    return [ln for ln in text.strip().splitlines() if ln.strip() and " INFO mlflow." not in ln]


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 75), (signal.SIGINT, 130), (signal.SIGHUP, 75)])
def test_a_stop_signal_outside_the_training_loop_ends_everything(
    tmp_path: Path, sig: int, status: int
) -> None:
    """stages.corrupt stopped while its process pool works: exit 75 / 130, one line and no traceback, its pool
    workers gone, its MLflow child and the parent KILLED."""
    ws = _workspace(tmp_path)
    env = stage_env(TCNN_TRACKING="1")
    proc = subprocess.Popen([sys.executable, "-m", "stages.corrupt"], cwd=ws, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    me = psutil.Process(proc.pid)
    workers: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        workers = [c for c in me.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
        if len(workers) >= 2:
            break
        time.sleep(0.2)
    assert len(workers) >= 2, "the corrupt stage never started its pool"
    time.sleep(1.0)
    everyone = me.children(recursive=True)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    lines = _stderr_lines(err)
    assert "Traceback" not in err and lines[-1].startswith(f"corrupt: stopped by {signal.Signals(sig).name}")
    gone, alive = psutil.wait_procs(everyone, timeout=15)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"
    runs = {r.data.tags.get("tcnn.kind"): r.info.status for r in _runs(ws)}
    assert runs == {"parent": "KILLED", "stage": "KILLED"}


def test_a_superseded_parent_closes_its_children(tmp_path: Path) -> None:
    from stages.harness.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    old = Tracker(uri=uri, experiment="t")
    old.start_parent("a", key="ws", params={"lr": 1})
    old.start_child("pretrain")  # left RUNNING, as by a SIGKILLed process
    child, parent = old.run_id, old.parent_run_id
    new = Tracker(uri=uri, experiment="t")
    new.start_parent("b", key="ws", params={"lr": 2})  # other params: the old chain is superseded
    assert new.parent_run_id != parent
    assert new.client.get_run(child).info.status == "FAILED"
    assert new.client.get_run(parent).info.status == "FAILED"


def test_a_value_that_fails_at_run_time_is_refused_before_any_run_opens(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, n_test=50)
    proc = subprocess.run([sys.executable, "-m", "stages.corrupt", "-S", "robustness.n_images=20000"], cwd=ws,
                          env=stage_env(TCNN_TRACKING="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert _stderr_lines(proc.stderr) == [
        f"corrupt: error: robustness.n_images: 20000 exceeds the 50 test images of {ws / 'data'}"
    ]
    assert _runs(ws) == [] and not (ws / "c").exists()


def test_missing_baseline_file_is_reported_before_evaluation(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, n_test=50)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stages.evaluate", "-S", "robustness.baseline=nowhere.json"],
                          cwd=ws, env=stage_env(TCNN_TRACKING="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and time.monotonic() - t0 < 60
    assert _stderr_lines(proc.stderr) == [
        "evaluate: error: robustness.baseline: nowhere.json: baseline file not found"
    ]
    assert _runs(ws) == []


# ----------------------------------------------------------------------------------------- corrupted sets


def _a_set(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 28, 28, 1), dtype=np.uint8)
    labels, idx = rng.integers(0, 10, 64), np.arange(64)
    meta = C.set_meta("contrast", 1, seed=0, band="cifar", image_shape=[28, 28, 1], n=64, source="x")
    C.write_set(path, images, labels, idx, meta)
    return images, labels, idx


def test_every_flipped_byte_of_a_set_is_refused_or_harmless(tmp_path: Path) -> None:
    """A set is verified where it is read: flip any byte and read_set either refuses the file (unreadable or
    checksum mismatch) or returns the very same content (a byte the reader never uses)."""
    path = tmp_path / "contrast" / "1.parquet"
    images, labels, idx = _a_set(path)
    data = path.read_bytes()
    refused = 0
    for pos in range(0, len(data), max(1, len(data) // 300)):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        path.write_bytes(bytes(bad))
        try:
            got = C.read_set(path)
        except ValueError as err:
            assert str(path) in str(err)
            refused += 1
            continue
        assert np.array_equal(got.images, images) and np.array_equal(got.labels, labels), pos
        assert np.array_equal(got.indices, idx), pos
    assert refused > 0


def test_silently_changed_content_is_a_checksum_mismatch_and_corrupt_regenerates_it(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "contrast" / "1.parquet"
    _a_set(path)
    table = pq.read_table(path)
    images = table.column("image").combine_chunks()
    raw = bytearray(images.buffers()[1].to_pybytes())
    raw[100] ^= 1  # one pixel, the metadata (and its sha256) untouched
    forged = table.set_column(2, "image", pa.FixedSizeBinaryArray.from_buffers(images.type, len(images),
                                                                               [None, pa.py_buffer(bytes(raw))]))  # fmt: skip
    pq.write_table(forged, path)
    with pytest.raises(ValueError, match="checksum mismatch"):
        C.read_set(path)
    meta = C.read_set_meta(path)
    assert meta is not None and not C.set_is_valid(path, {k: meta[k] for k in ("corruption", "severity")})


def test_the_corrupt_stage_regenerates_a_damaged_set_and_evaluate_refuses_one(tmp_path: Path) -> None:
    from core.config import validate_params
    from stages import corrupt

    ws = _workspace(tmp_path, n_test=40, corruptions=["contrast"], severities=[1])
    raw = tiny_params(ws / "data", robustness={"dir": str(ws / "c"), "n_images": 40, "corruptions": ["contrast"],
                                               "severities": [1], "workers": 1})  # fmt: skip
    params = validate_params(raw)
    corrupt.run(params, root=ws)
    path = ws / "c" / "contrast" / "1.parquet"
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError):
        C.read_set(path)
    corrupt.run(params, root=ws)
    assert path.read_bytes() == good  # regenerated, byte for byte


# --------------------------------------------------------------------------------------------- one writer


def test_a_second_writer_on_a_workspace_is_refused_and_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, n_test=20)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from core.utils.workspace import workspace_lock\n"
         "with workspace_lock(sys.argv[1], 'a test holder'):\n    print('held', flush=True); time.sleep(300)", str(ws)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "-m", "stages.prepare"], cwd=ws, env=stage_env(TCNN_TRACKING="1"),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 2
        lines = _stderr_lines(proc.stderr)
        assert len(lines) == 1 and f"pid {holder.pid} on {socket.gethostname()}" in lines[0], proc.stderr
        assert "a test holder" in lines[0] and _runs(ws) == []
    finally:
        holder.kill()  # SIGKILL: the kernel releases its lock
        holder.wait()
    proc = subprocess.run([sys.executable, "-m", "stages.corrupt"], cwd=ws, env=stage_env(TCNN_TRACKING="0"),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_a_new_mlflow_store_survives_four_processes_at_once(tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
        "from stages.harness.tracking import Tracker\n"
        "t = Tracker(uri='sqlite:///' + sys.argv[1], experiment='e')\n"
        "t.start_parent('p'); t.end_parent()\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "new.db"), str(go)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]  # fmt: skip
    time.sleep(4)  # every process imported MLflow and waits
    go.touch()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errs
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'new.db'}")
    exp = client.get_experiment_by_name("e")
    assert len(client.search_runs([exp.experiment_id])) == 4


# ---------------------------------------------------------------------------------------------- commands


def test_dvc_stage_command_finds_the_project_interpreter_or_says_what_to_do(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "TCNN_PYTHON")}
    clean["PATH"] = "/usr/bin:/bin"
    ok = subprocess.run([str(REPO / "scripts" / "stage"), "prepare", "--help"], cwd=REPO, env=clean,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0 and "python -m stages.prepare" in ok.stdout
    (tmp_path / "scripts").mkdir()
    lone = tmp_path / "scripts" / "stage"
    lone.write_bytes((REPO / "scripts" / "stage").read_bytes())
    lone.chmod(0o755)
    bad = subprocess.run([str(lone), "prepare"], cwd=tmp_path, env=clean, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "stage prepare: no project interpreter (.venv/bin/python not found here or above): run 'make setup' "
        "first, or set TCNN_PYTHON"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pretrain: {epochs: 1, epochs: 7}\n", "not valid YAML at line 1: key 'epochs' given twice"),
        ("seed: 0\ndata:\n  name: [fashion_mnist\n", "not valid YAML at line 3: expected ',' or ']'"),
        ("seed: 0\npretrain:\n  epochs: 2\n  epochs: 3\n", "key 'epochs' given twice (lines 3 and 4)"),
    ],
)
def test_bad_params_files_give_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_validate_a_directory_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tcnn validate: error: {tmp_path}: is a directory, not a params file"


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


def test_a_checkpoint_damaged_inside_a_tensor_is_refused(tmp_path: Path) -> None:
    """The zip container does not check tensor bytes: the content sha256 saved with every checkpoint does."""
    import torch

    from core.training.checkpoint import CheckpointError, atomic_save, load

    model = torch.nn.Linear(256, 256)
    atomic_save({"model": model.state_dict(), "epoch": 3}, tmp_path / "c.pt")
    assert torch.equal(load(tmp_path / "c.pt")["model"]["weight"], model.weight.detach())
    data = bytearray((tmp_path / "c.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the 256 KB weight matrix
    (tmp_path / "c.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(tmp_path / "c.pt")


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_signal_while_a_stage_imports_is_one_line(tmp_path: Path, sig: int, status: int) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "stages.evaluate"], cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True, env=stage_env())  # fmt: skip
    time.sleep(0.3)  # importing torch, MLflow and the rest takes seconds
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status
    assert (
        err.strip() == f"evaluate: stopped by {signal.Signals(sig).name} while starting; nothing was written"
    )
    assert list(tmp_path.iterdir()) == []
