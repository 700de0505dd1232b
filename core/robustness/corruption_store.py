"""Stored corrupted sets: ``<dir>/<corruption>/<severity>.parquet`` (and ``<dir>/clean.parquet``), written atomically
with their metadata and content sha256, verified on every read; and the choice of the test images to corrupt."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from core.data.splits import stratified_head
from core.robustness.corruption_ops import check_setting
from core.robustness.corruption_tables import CATEGORY_OF, CORRUPTION_VERSION, is_meaningful
from core.utils.atomic import atomic_write

# ----------------------------------------------------------------------------------------------------------
# Stored sets: <dir>/<corruption>/<severity>.parquet (and <dir>/clean.parquet)
# ----------------------------------------------------------------------------------------------------------

INDEX = "index.json"  # <dir>/index.json: the sets of a folder, their sha256 and the identity that made them
SET_FORMAT = 3  # 3: the stored content's sha256 in the metadata, verified on every read
_META_KEY = b"tcnn.corrupted_set"


class StoredSet(NamedTuple):
    images: np.ndarray  # uint8 [N, H, W, C]
    labels: np.ndarray  # int64 [N]
    indices: np.ndarray  # int64 [N]: the images' indices in the source test split
    meta: dict[str, Any]


def set_path(root: str | os.PathLike, corruption: str, severity: int) -> Path:
    """<root>/<corruption>/<severity>.parquet, or <root>/clean.parquet for corruption "clean"."""
    if corruption == "clean":
        return Path(root) / "clean.parquet"
    return Path(root) / corruption / f"{int(severity)}.parquet"


def fingerprint(images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of the clean images, labels and indices a set was made from (detects a changed source)."""
    h = hashlib.sha256()
    images = np.ascontiguousarray(images, dtype=np.uint8)
    h.update(repr(list(images.shape)).encode())
    h.update(images.tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()


def set_meta(
    corruption: str,
    severity: int,
    *,
    seed: int,
    band: str,
    image_shape: Sequence[int],
    n: int,
    source: str,
) -> dict[str, Any]:
    """The metadata stored with (and checked against) a set; `source` is :func:`fingerprint` of the clean
    images. ``meaningful`` is False for saturate on grayscale images (left out of every summary)."""
    clean = corruption == "clean"
    if not clean:
        check_setting(corruption, severity, band)
    channels = int(image_shape[-1])
    return {
        "format": SET_FORMAT,
        "version": CORRUPTION_VERSION,
        "corruption": corruption,
        "severity": 0 if clean else int(severity),
        "category": "clean" if clean else CATEGORY_OF[corruption],
        "meaningful": True if clean else is_meaningful(corruption, channels),
        "band": band,
        "seed": int(seed),
        "image_shape": [int(v) for v in image_shape],
        "n": int(n),
        "source": source,
    }


def write_set(
    path: str | os.PathLike, images: np.ndarray, labels: np.ndarray, indices: np.ndarray, meta: dict[str, Any]
) -> Path:
    """Write one set as Parquet, atomically (temp file in the same directory, fsync, os.replace).

    Columns: ``index`` (int64, position in the source split), ``label`` (int64), ``image`` (fixed-size
    binary of H*W*C bytes, row-major HWC uint8, as the prepared data shards); `meta` is stored as JSON in
    the schema metadata. zstd, no dictionary. The bytes depend only on the
    arguments, so two processes writing the same set produce identical files.
    """
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    images = np.ascontiguousarray(images, dtype=np.uint8)
    if images.ndim == 3:
        images = images[..., None]
    n = len(images)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if labels.shape != (n,) or indices.shape != (n,):
        raise ValueError(f"write_set: {n} images but {labels.size} labels and {indices.size} indices")
    per = int(np.prod(images.shape[1:]))
    image_col = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(per), n, [None, pa.py_buffer(images.reshape(-1))]
    )
    table = pa.table({"index": indices, "label": labels, "image": image_col})
    meta = {**meta, "image_shape": [int(v) for v in images.shape[1:]], "n": n,
            "sha256": content_digest(images, labels, indices)}  # fmt: skip
    table = table.replace_schema_metadata({_META_KEY: json.dumps(meta, sort_keys=True).encode()})
    return atomic_write(
        path,
        lambda fh: pq.write_table(
            table, fh, compression="zstd", use_dictionary=False, row_group_size=max(n, 1)
        ),
    )


def read_set_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The stored metadata of a set, or None when the file is missing, truncated or not one of ours."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        md = pq.read_metadata(path)
        raw = (md.schema.to_arrow_schema().metadata or {}).get(_META_KEY)
        if raw is None:
            return None
        meta = json.loads(raw)
        if md.num_rows != meta.get("n"):
            return None
        return meta
    except (OSError, ValueError):
        return None


def content_digest(images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of a set's content as stored (uint8 images, int64 labels and indices), kept in its metadata and
    recomputed by :func:`read_set`: a damaged file is detected where it is read."""
    h = hashlib.sha256()
    for a in (
        np.ascontiguousarray(images, np.uint8),
        np.asarray(labels, np.int64),
        np.asarray(indices, np.int64),
    ):
        h.update(repr(list(a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def set_is_valid(path: str | os.PathLike, expected: dict[str, Any]) -> bool:
    """True when `path` holds a complete set whose metadata equals `expected` (see :func:`set_meta`) and
    whose content matches its stored sha256 (the whole file is read)."""
    meta = read_set_meta(path)
    if meta is None or any(meta.get(k) != v for k, v in expected.items()):
        return False
    try:
        read_set(path)
    except (OSError, ValueError):
        return False
    return True


def read_set(path: str | os.PathLike) -> StoredSet:
    """Read a set written by :func:`write_set` (clear error naming the file when missing or corrupt).

    ``images`` is a read-only view of the Arrow buffer (no copy); copy it before writing into it."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: corrupted set not found (run the corrupt stage)")
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {})[_META_KEY])
        shape = tuple(int(v) for v in meta["image_shape"])
        col = table.column("image").combine_chunks()
        per = int(np.prod(shape))
        if col.type != pa.binary(per) or col.null_count:
            raise ValueError(f"image column of type {col.type}, expected fixed_size_binary[{per}]")
        images = np.frombuffer(col.buffers()[1], np.uint8, count=len(col) * per, offset=col.offset * per)
        images = images.reshape((table.num_rows, *shape))
        labels = table.column("label").to_numpy().astype(np.int64)
        indices = table.column("index").to_numpy().astype(np.int64)
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: not a readable corrupted set ({type(err).__name__}: {err})") from None
    if "sha256" not in meta:
        raise ValueError(f"{path}: written without a checksum (an older version); rerun the corrupt stage")
    if content_digest(images, labels, indices) != meta["sha256"]:
        raise ValueError(f"{path}: checksum mismatch, the file is damaged; rerun the corrupt stage")
    return StoredSet(images, labels, indices, meta)


def select_indices(labels: np.ndarray, n: int, mode: str = "stratified") -> np.ndarray:
    """Which test images to corrupt: sorted indices of `n` images.

    "first": the first n. "stratified" (default): classes take turns in index order
    (`core.data.splits.stratified_head`, the rule ``data.limit`` caps a split with too) -- class counts
    differ by at most one while a class has images left, the choice is a deterministic function of the labels
    (no RNG), and growing n keeps every previously chosen image.
    """
    labels = np.asarray(labels).reshape(-1)
    total = len(labels)
    if n <= 0:
        raise ValueError(f"n_images must be positive, got {n}")
    if n >= total:
        return np.arange(total)
    if mode == "first":
        return np.arange(n)
    if mode != "stratified":
        raise ValueError(f"unknown selection mode {mode!r} (stratified | first)")
    return stratified_head(labels, n)
