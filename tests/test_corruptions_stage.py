"""Stage `corrupt`: files, metadata, caching, contact sheet, bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from core.config import Params
from core.robustness import corruptions as C
from stages import corrupt
from stages.harness.runner import StageError

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _fmnist(n: int) -> tuple[np.ndarray, np.ndarray]:
    if not (FMNIST / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST IDX files not installed")
    with gzip.open(FMNIST / "t10k-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)[:n].copy()
    with gzip.open(FMNIST / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)[:n].astype(np.int64)
    return x, y


@pytest.fixture()
def dataset(tmp_path) -> Path:
    """A prepared 60-image Fashion-MNIST dataset (train = test) written by the data helper's importer."""
    from core.data.importers import write_array_dataset

    x, y = _fmnist(60)
    out = tmp_path / "data" / "fmnist"
    names = [str(i) for i in range(10)]
    info = {"kind": "test", "path": "tests"}
    write_array_dataset("fashion_mnist", out, {"train": (x, y), "test": (x, y)}, names, info, "t", 1000, None)
    return out


def _params(tmp_path: Path, **over) -> Params:
    base = {
        "data.dir": str(tmp_path / "data" / "fmnist"),
        "robustness.dir": str(tmp_path / "c"),
        "robustness.n_images": 24,
        "robustness.corruptions": ["glass_blur", "fog", "saturate"],
        "robustness.severities": [1, 5],
    }
    return Params().with_overrides({**base, **over})


def test_stage_writes_sets_index_and_sheet_then_skips(tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(C, "default_workers", lambda: 1)
    params = _params(tmp_path)
    first = corrupt.run(params, root=Path("/"))
    assert first["generated"] == 6 and first["skipped"] == 0 and first["band"] == "cifar"
    out = tmp_path / "c"
    index = json.loads((out / "index.json").read_text())
    assert index["n"] == 24 and index["excluded_from_summaries"] == ["saturate"] and index["grayscale"]
    assert {(s["corruption"], s["severity"]) for s in index["sets"]} == {
        (c, s) for c in ("glass_blur", "fog", "saturate") for s in (1, 5)
    }
    x, y = _fmnist(60)
    idx = C.select_indices(y, 24)
    clean = C.read_set(out / "clean.parquet")
    assert np.array_equal(clean.images, x[idx]) and np.array_equal(clean.indices, idx)
    fog5 = C.read_set(out / "fog" / "5.parquet")
    assert np.array_equal(fog5.images, C.corrupt_batch(x[idx], "fog", 5, seed=params.seed, indices=idx))
    assert np.array_equal(fog5.labels, y[idx])
    assert C.read_set(out / "saturate" / "1.parquet").meta["meaningful"] is False
    assert (out / "contact_sheet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")}
    again = corrupt.run(params, root=Path("/"))
    assert again["generated"] == 0 and again["skipped"] == 6
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")}


@pytest.mark.slow
def test_stage_regenerates_damaged_and_stale_sets(tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(C, "default_workers", lambda: 1)
    params = _params(tmp_path, **{"robustness.corruptions": ["fog", "frost"]})
    assert corrupt.run(params, root=Path("/"))["generated"] == 4
    out = tmp_path / "c"
    (out / "fog" / "1.parquet").write_bytes(b"garbage")  # a damaged set is regenerated, the rest kept
    frost = (out / "frost" / "5.parquet").stat().st_mtime_ns
    assert corrupt.run(params, root=Path("/"))["generated"] == 1
    assert (out / "frost" / "5.parquet").stat().st_mtime_ns == frost
    assert corrupt.run(params.with_overrides({"seed": 1}), root=Path("/"))["generated"] == 4
    more = params.with_overrides({"robustness.n_images": 30})  # another selection: every set is stale
    assert corrupt.run(more, root=Path("/"))["generated"] == 4


def test_stage_rejects_too_many_images_and_writes_nothing(tmp_path, dataset):
    params = _params(tmp_path, **{"robustness.n_images": 61})
    with pytest.raises(StageError, match="robustness.n_images: 61 exceeds the 60 test images"):
        corrupt.run(params, root=Path("/"))
    assert not (tmp_path / "c").exists()


def test_stage_cli_missing_data_is_one_line_exit_2(tmp_path, capsys):
    code = corrupt.main(["-S", f"data.dir={tmp_path / 'nope'}", "-S", f"robustness.dir={tmp_path / 'c'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("corrupt: error: data.dir:")
    assert not (tmp_path / "c").exists()
