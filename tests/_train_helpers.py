"""Shared helpers for the training tests: a tiny Fashion-MNIST slice in the prepared-data format, tiny params."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from core.training.checkpoint import load
from core.training.loop import TIMING_KEYS
from stages.tracking.store import store_client

REPO = Path(__file__).resolve().parents[1]
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# The device the stage tests train and evaluate on: CPU, unless scripts/gpu_check.sh sets TCNN_TEST_DEVICE=cuda.
TEST_DEVICE = os.environ.get("TCNN_TEST_DEVICE", "cpu")
LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]


def _idx(path: Path) -> np.ndarray:
    from core.data import parse_idx

    return parse_idx(gzip.decompress(path.read_bytes()), path.name)


def fmnist_slice(n_train: int, n_test: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The first images of the real Fashion-MNIST files when present, else class-structured synthetic ones."""
    if (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        out = {}
        for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
            x = _idx(FMNIST_DIR / f"{prefix}-images-idx3-ubyte.gz")[:n, :, :, None]
            y = _idx(FMNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz")[:n].astype(np.int64)
            out[split] = (np.ascontiguousarray(x), y)
        return out
    rng = np.random.default_rng(0)
    protos = rng.integers(0, 256, size=(10, 28, 28, 1))
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        y = np.arange(n, dtype=np.int64) % 10
        noise = rng.integers(-60, 60, size=(n, 28, 28, 1))
        out[split] = (np.clip(protos[y] + noise, 0, 255).astype(np.uint8), y)
    return out


def write_dataset(out: Path, n_train: int = 600, n_test: int = 200) -> Path:
    """A prepared dataset directory (Parquet shards + manifest.json) written by core's own writer."""
    from core.data.shards import write_array_dataset

    arrays = fmnist_slice(n_train, n_test)
    write_array_dataset(
        "fashion_mnist", out, arrays, LABELS, {"kind": "test-slice", "path": str(out)}, "test", 256, None
    )
    return out


def tiny_params(data_dir: Path, **sections: Any) -> dict[str, Any]:
    """A params dict for a run of a few seconds on CPU (override sections with dicts)."""
    raw: dict[str, Any] = {
        "seed": 0,
        "data": {"dir": str(data_dir), "val_size": 100, "sample_fraction": 1.0},
        "model": {"kind": "tcnn", "arch": "resnet10_cifar"},
        "pretrain": {"epochs": 2, "batch_size": 50, "lr": 0.05, "warmup_epochs": 0.5},
        "reparam": {"epoch": 1},
        "finetune": {"epochs": 2, "batch_size": 50, "lr": 0.004, "warmup_epochs": 0.5},
        "tracking": {"enabled": False},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:
            raw[name] = values
    return raw


def write_params(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def repo_pythonpath() -> str:
    """PYTHONPATH for a subprocess that imports the project: the repo first, then what this process was given
    (the GPU check puts the wheels a bare CUDA image lacks there)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def stage_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"TCNN_QUIET": "1", "OMP_NUM_THREADS": "1", "TCNN_DEVICE": TEST_DEVICE, "PYTHONHASHSEED": "0"})
    env.update(extra)
    return env


def stage_cmd(stage: str, params: Path) -> list[str]:
    return [sys.executable, "-m", f"stages.{stage}", "--params", str(params)]


def run_stage(stage: str, params: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        stage_cmd(stage, params), cwd=cwd, env=stage_env(**env), capture_output=True, text=True, timeout=600
    )


#: What may differ between an interrupted and an unbroken run.
VOLATILE = {*TIMING_KEYS, "resumed"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _assert_equal_tree(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys() ^ b.keys()}"
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_outputs(got: Path, ref: Path) -> None:
    """A training stage's outputs under ``got`` equal those under ``ref`` (an unbroken run): checkpoints
    tensor for tensor, histories and JSON files up to timing fields."""

    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    names = files(ref)
    assert files(got) == names and any(n.endswith(".pt") for n in names)
    for name in names:
        if name.endswith(".pt"):
            a, b = load(got / name), load(ref / name)
            a_hist, b_hist = _strip(a.pop("history", [])), _strip(b.pop("history", []))
            assert a_hist == b_hist, f"{name}: history differs"
            _assert_equal_tree(a, b, name)
        elif name.endswith(".json"):
            assert _strip(json.loads((got / name).read_text())) == _strip(
                json.loads((ref / name).read_text())
            ), name
        elif name.endswith("gpsa.csv"):
            assert (got / name).read_text() == (ref / name).read_text()
        elif name.endswith("history.csv"):
            hdr, *rows = (got / name).read_text().splitlines()
            rhdr, *rrows = (ref / name).read_text().splitlines()
            keep = [i for i, c in enumerate(hdr.split(",")) if c not in VOLATILE]
            assert hdr == rhdr
            assert [[r.split(",")[i] for i in keep] for r in rows] == [
                [r.split(",")[i] for i in keep] for r in rrows
            ]
        else:
            raise AssertionError(f"{name}: output not compared by this test")


def tracked_workspace(tmp: Path, n_test: int = 2000, **robustness) -> Path:
    """A workspace (data, params.yaml) whose stages track to a sqlite MLflow store inside it."""
    write_dataset(tmp / "data", n_train=300, n_test=n_test)
    raw = tiny_params(tmp / "data", robustness={"dir": "c", "n_images": n_test, "workers": 2, **robustness},
                      tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "t"})  # fmt: skip
    write_params(tmp / "params.yaml", raw)
    return tmp


def tracked_runs(ws: Path) -> list:
    """Every MLflow run of a `tracked_workspace`."""
    if not (ws / "mlruns.db").exists():
        return []
    client = store_client(f"sqlite:///{ws / 'mlruns.db'}")
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps]) if exps else []


def stderr_lines(text: str) -> list[str]:
    """stderr without MLflow's own INFO logging of its system-metrics thread."""
    return [ln for ln in text.strip().splitlines() if ln.strip() and " INFO mlflow." not in ln]
