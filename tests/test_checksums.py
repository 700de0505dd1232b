"""Checksummed data and checkpoints: a corrupted set or a checkpoint damaged in any byte is refused where it is
read (or harmless), and the corrupt stage regenerates a damaged set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _train_helpers import (
    tiny_params,
    tracked_workspace,
)

from core.robustness import corruptions as C


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

    ws = tracked_workspace(tmp_path, n_test=40, corruptions=["contrast"], severities=[1])
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
