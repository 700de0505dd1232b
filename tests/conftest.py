"""Shared pytest fixtures. Tests never touch the repo's own data/, runs/ or mlruns.db: they use tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401  (SLURM test-cluster fixture)

REPO = Path(__file__).resolve().parents[1]
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Stage CLIs run by tests do not write an MLflow store unless a test asks for one (TCNN_TRACKING=1).
os.environ.setdefault("TCNN_TRACKING", "0")

# Keep tests deterministic and light on a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
