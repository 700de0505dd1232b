"""Stage `prepare`: imports data.name into root/data.dir, skips when up to date, one-line errors, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _train_helpers import repo_pythonpath

from core.config import load_params
from core.data import load_split, read_manifest
from stages.harness.runner import StageError
from stages.prepare import main, run

REPO = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").is_file(), reason="Debian dataset-fashion-mnist not installed"
)


def params_file(tmp_path: Path, **data: object) -> Path:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update(data)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@needs_fmnist
@pytest.mark.slow
def test_run_imports_then_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = load_params(params_file(tmp_path, dir="data/fm", shard_rows=20000))
    first = run(params, root=tmp_path)
    assert first["train_images"] == 60000 and first["test_images"] == 10000 and first["num_classes"] == 10
    assert first["skipped"] is False
    assert "train 60000, test 10000 images" in capsys.readouterr().out
    out = tmp_path / "data" / "fm"
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "test-00000.parquet", "train-00000.parquet", "train-00001.parquet", "train-00002.parquet",
    ]  # fmt: skip
    assert read_manifest(out)["shard_rows"] == 20000
    assert run(params, root=tmp_path)["skipped"] is True
    # the fraction and the validation split are applied when loading, not here
    assert load_split(out, "train")[0].shape == (60000, 28, 28, 1)


def test_missing_source_is_a_stage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    params = load_params(params_file(tmp_path, dir="data/fm", source=str(tmp_path / "empty")))
    with pytest.raises(StageError, match="empty: the four Fashion-MNIST IDX files"):
        run(params, root=tmp_path)
    assert not (tmp_path / "data").exists()  # not even the parent


def test_cli_bad_data_exits_2_one_line(
    tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    path = params_file(tmp_path, dir="out", source=str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert main(["--params", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prepare: error: ") and "empty" in err[0]
    assert not (tmp_path / "out").exists()


def test_cli_refuses_to_replace_the_working_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    path = params_file(tmp_path, dir=".")
    raw = yaml.safe_load(path.read_text())
    raw["robustness"]["dir"] = str(tmp_path.parent / f"{tmp_path.name}-c")  # outside "."
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["--params", str(path)]) == 2
    assert "exists, is not empty and holds no manifest.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@needs_fmnist
@pytest.mark.slow
def test_python_m_stages_prepare(tmp_path: Path) -> None:
    params_file(tmp_path, dir="data/fashion_mnist")
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    cmd = [sys.executable, "-m", "stages.prepare", "--params", "params.yaml", "-S", "data.shard_rows=30000"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout
    m = read_manifest(tmp_path / "data" / "fashion_mnist")
    assert m["shard_rows"] == 30000 and m["splits"]["train"]["num_rows"] == 60000
