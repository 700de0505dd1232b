"""Reading prepared datasets (Parquet shards + ``manifest.json``, written by core.data.shards and the importers):
the manifest, checksum verification, whole splits as arrays and, for data too large to hold in memory, a per-sample
torch Dataset.

:func:`read_manifest`, :func:`load_split` read them back (checksums verified; a truncated, missing or altered shard
fails with one line naming the file); :class:`ShardDataset` is the per-sample torch Dataset. The splits a run
trains, validates and tests on are chosen in core.data.splits.
"""

from __future__ import annotations

import bisect
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.data.importers import FORMAT_VERSION, MANIFEST, DataError
from core.utils.hashing import file_digest, stable_hash


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The dataset's ``manifest.json`` (see core/data/importers.py for its fields)."""
    path = Path(data_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing; prepare the dataset first (python -m stages.prepare)") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(
            f"{path}: format_version {version!r}, this code reads {FORMAT_VERSION}; re-run prepare"
        )
    return manifest


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """The prepared dataset's content identity: the hash of its manifest (which lists every shard's sha256),
    leaving out where it was imported from."""
    return stable_hash({k: v for k, v in manifest.items() if k != "source"})


def split_entry(manifest: dict[str, Any], split: str, data_dir: Path) -> dict[str, Any]:
    splits = manifest.get("splits", {})
    if split not in splits:
        raise DataError(f"{data_dir / MANIFEST}: no split {split!r} (has: {', '.join(splits) or 'none'})")
    return splits[split]


def verify_split(data_dir: str | Path, split: str, manifest: dict[str, Any] | None = None) -> None:
    """Check every shard of ``split`` against the manifest: present, same size, same SHA-256."""
    data_dir = Path(data_dir)
    manifest = manifest if manifest is not None else read_manifest(data_dir)
    for rec in split_entry(manifest, split, data_dir)["files"]:
        path = data_dir / rec["name"]
        if not path.is_file():
            raise DataError(f"{path}: missing shard (listed in {MANIFEST})")
        size = path.stat().st_size
        if size < rec["bytes"]:
            raise DataError(f"{path}: truncated shard ({size} bytes, {MANIFEST} says {rec['bytes']})")
        if size != rec["bytes"]:
            raise DataError(f"{path}: shard size {size} bytes differs from {MANIFEST} ({rec['bytes']})")
        digest = file_digest(path)
        if digest != rec["sha256"]:
            raise DataError(
                f"{path}: checksum mismatch (sha256 {digest[:16]}..., {MANIFEST} says {rec['sha256'][:16]}...)"
            )


def _read_shard(path: Path, columns: list[str]) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: unreadable shard ({type(err).__name__}: {err})") from None


def load_labels(data_dir: str | Path, split: str) -> np.ndarray:
    """A split's labels in ``index`` order, read from the label column only (no image is read or decoded)."""
    data_dir = Path(data_dir)
    entry = split_entry(read_manifest(data_dir), split, data_dir)
    labels = np.full(int(entry["num_rows"]), -1, np.int64)
    for rec in entry["files"]:
        table = _read_shard(data_dir / rec["name"], ["label", "index"])
        labels[table.column("index").to_numpy()] = table.column("label").to_numpy()
    if (labels < 0).any():
        raise DataError(f"{data_dir}: split {split!r} is missing rows")
    return labels


def _decode(data: bytes, mode: str, image_size: int | None, name: str) -> np.ndarray:
    """Decode one encoded image; with ``image_size``: resize the shorter side, then centre-crop a square."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img = img.convert(mode)
            if image_size is not None and (img.width, img.height) != (image_size, image_size):
                scale = image_size / min(img.width, img.height)
                w, h = max(image_size, round(img.width * scale)), max(image_size, round(img.height * scale))
                img = img.resize((w, h), Image.BICUBIC)
                left, top = (w - image_size) // 2, (h - image_size) // 2
                img = img.crop((left, top, left + image_size, top + image_size))
            arr = np.asarray(img)
    except OSError as err:
        raise DataError(f"{name}: undecodable image ({err})") from None
    return arr.reshape(arr.shape[0], arr.shape[1], -1)


def load_split(
    data_dir: str | Path, split: str, *, verify: bool = True, image_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read a split into ``(images uint8 [N,H,W,C], labels int64 [N])``, rows in ``index`` order.

    Raw shards are copied buffer by buffer into one preallocated array (peak memory: the output plus one
    shard). Encoded shards (ImageFolder) are decoded; images of different sizes need ``image_size`` (shorter
    side resized to it, then a centre crop). With ``verify`` (default) every shard's SHA-256 is checked first.
    """
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    entry = split_entry(manifest, split, data_dir)
    if verify:
        verify_split(data_dir, split, manifest)
    n = int(entry["num_rows"])
    labels = np.empty(n, np.int64)
    filled = np.zeros(n, bool)
    raw = manifest["image_encoding"] == "raw"
    shape = manifest.get("image_shape")
    if raw:
        h, w, c = shape
        images = np.empty((n, h, w, c), np.uint8)
        row_bytes = h * w * c
    else:
        mode = manifest.get("image_mode", "RGB")
        if image_size is None and shape is None:
            raise DataError(
                f"{data_dir}: images differ in size ({manifest.get('image_size_range')}); pass image_size"
            )
        size = image_size
        images = None
    for rec in entry["files"]:
        path = data_dir / rec["name"]
        table = _read_shard(path, ["image", "label", "index"])
        if table.num_rows != rec["rows"]:
            raise DataError(f"{path}: {table.num_rows} rows, {MANIFEST} says {rec['rows']}")
        index = table.column("index").to_numpy()
        if len(index) and (index.min() < 0 or index.max() >= n):
            raise DataError(f"{path}: row index outside 0..{n - 1}")
        labels[index] = table.column("label").to_numpy()
        filled[index] = True
        pos = 0
        for chunk in table.column("image").chunks:
            rows = index[pos : pos + len(chunk)]
            pos += len(chunk)
            if chunk.null_count:
                raise DataError(f"{path}: null images")
            if raw:
                buf = chunk.buffers()[1]
                flat = np.frombuffer(
                    buf, np.uint8, count=len(chunk) * row_bytes, offset=chunk.offset * row_bytes
                )
                block = flat.reshape(len(chunk), h, w, c)
                if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
                    images[rows[0] : rows[-1] + 1] = block
                else:
                    images[rows] = block
            else:
                for r, data in zip(rows, chunk.to_pylist()):
                    arr = _decode(data, mode, size, f"{path} row {r}")
                    if images is None:
                        images = np.empty((n, *arr.shape), np.uint8)
                    if arr.shape != images.shape[1:]:
                        raise DataError(
                            f"{path} row {r}: image shape {arr.shape} != {images.shape[1:]}; pass image_size"
                        )
                    images[r] = arr
    if not filled.all():
        raise DataError(f"{data_dir}: split {split!r} is missing rows (e.g. index {int(np.argmin(filled))})")
    if images is None:
        images = np.empty((0, 0, 0, 0), np.uint8)
    return images, labels


class ShardDataset:
    """A map-style torch Dataset over a split's shards, one sample at a time, for data too large for memory.

    ``ds[i]`` returns ``(transform(image), label)`` where image is a PIL image (mode from the manifest; "L"
    for one channel). Rows are read a row group at a time and the last group is cached, so sequential or
    group-local access is cheap; use :class:`~core.data.loader.BatchLoader` over :func:`load_split` arrays when
    the split fits in memory (much faster).
    """

    def __init__(
        self, data_dir: str | Path, split: str, transform: Any = None, *, verify: bool = True
    ) -> None:
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        self.entry = split_entry(self.manifest, split, self.data_dir)
        if verify:
            verify_split(self.data_dir, split, self.manifest)
        self.transform = transform
        self.files = [self.data_dir / r["name"] for r in self.entry["files"]]
        self.starts = list(np.cumsum([0] + [r["rows"] for r in self.entry["files"]]))
        self.raw = self.manifest["image_encoding"] == "raw"
        shape = self.manifest.get("image_shape")
        self.mode = self.manifest.get("image_mode") or ("L" if shape and shape[2] == 1 else "RGB")
        self._handles: dict[int, pq.ParquetFile] = {}
        self._group_starts: dict[int, list[int]] = {}
        self._cache: tuple[int, int, list[Any], np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.entry["num_rows"])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the files
        return {**self.__dict__, "_handles": {}, "_cache": None}

    def _row(self, i: int) -> tuple[Any, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        f = bisect.bisect_right(self.starts, i) - 1
        local = i - self.starts[f]
        if f not in self._handles:
            try:
                self._handles[f] = pq.ParquetFile(self.files[f])
            except (pa.ArrowException, OSError) as err:
                raise DataError(f"{self.files[f]}: unreadable shard ({err})") from None
            md = self._handles[f].metadata
            self._group_starts[f] = list(
                np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
            )
        g = bisect.bisect_right(self._group_starts[f], local) - 1
        if self._cache is None or self._cache[:2] != (f, g):
            t = self._handles[f].read_row_group(g, columns=["image", "label"])
            self._cache = (f, g, t.column("image").to_pylist(), t.column("label").to_numpy())
        row = local - self._group_starts[f][g]
        return self._cache[2][row], int(self._cache[3][row])

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        data, label = self._row(int(i))
        if self.raw:
            h, w, c = self.manifest["image_shape"]
            arr = np.frombuffer(data, np.uint8).reshape(h, w, c)
            img = Image.fromarray(arr[..., 0] if c == 1 else arr, self.mode)
        else:
            img = Image.open(io.BytesIO(data)).convert(self.mode)
        return (self.transform(img) if self.transform else img), label
