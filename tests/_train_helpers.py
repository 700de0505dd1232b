"""Shared helpers for the training tests: a tiny Fashion-MNIST slice in the prepared-data format, tiny params."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
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
    from core.data.importers import _write_array_dataset

    arrays = fmnist_slice(n_train, n_test)
    _write_array_dataset(
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


def stage_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"TCNN_QUIET": "1", "OMP_NUM_THREADS": "1", "TCNN_DEVICE": "cpu", "PYTHONHASHSEED": "0"})
    env.update(extra)
    return env


def stage_cmd(stage: str, params: Path) -> list[str]:
    return [sys.executable, "-m", f"stages.{stage}", "--params", str(params)]


def run_stage(stage: str, params: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        stage_cmd(stage, params), cwd=cwd, env=stage_env(**env), capture_output=True, text=True, timeout=600
    )
