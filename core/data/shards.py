"""The prepared-data format every importer writes: Parquet shards + ``manifest.json`` in a directory that
appears atomically (written into a temp dir next to it, renamed into place), the shard writer, the manifest and
the up-to-date check. Importers (core.data.importers, core.data.imagefolder) build on it.

A prepared dataset directory holds ``<split>-NNNNN.parquet`` shards (columns ``image``, ``label``,
``index``) and ``manifest.json`` (every shard's sha256, verified where the shards are read). Two image
encodings exist: ``raw`` (a fixed-size binary column of uint8 H x W x C pixels) and ``encoded`` (the file bytes
as found, decoded on read).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.utils.atomic import atomic_write_json, fsync_dir, fsync_file, umask
from core.utils.hashing import file_digest

FORMAT_VERSION = 1
IMPORTER_VERSION = 1  # bump when the bytes an importer writes change
MANIFEST = "manifest.json"
SPLITS = ("train", "test")
ROW_GROUP_BYTES = 4 << 20  # ~4 MiB of image data per row group: cheap random access, few groups per shard
STATS_MAX_IMAGES = 20000  # encoded datasets: mean/std from an evenly spaced subset of at most this many
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

Progress = Callable[[str, int, int], None]
"""progress(task, done, total): called as an import advances (the stage wires it to a progress bar)."""


class DataError(ValueError):
    """Bad or missing data: a one-line message that names the file."""


@dataclass
class ImportResult:
    manifest: dict[str, Any]
    out_dir: Path
    skipped: bool  # the output already matched the source
    seconds: float


# ----------------------------------------------------------------------------------------------------------
# output directories


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(out: Path) -> None:
    """Drop temp dirs that a killed import (SIGKILL, power loss) left next to ``out``."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(tmp.name.split(".tmp-", 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _make_dir(parent: Path, prefix: str) -> Path:
    """A fresh directory with the usual permissions (mkdtemp's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~umask())
    return path


@contextlib.contextmanager
def atomic_output_dir(out: Path) -> Iterator[Path]:
    """Yield a temp dir next to ``out``; on success it replaces ``out``, on failure it is removed.

    An existing ``out`` survives every failure before the final swap; the swap itself is two renames
    (old -> backup, temp -> out) and the backup is removed afterwards.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = _make_dir(out.parent, f".{out.name}.tmp-{os.getpid()}-")
    try:
        yield tmp
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        if out.exists():
            backup = _make_dir(out.parent, f".{out.name}.old-{os.getpid()}-")
            os.replace(out, backup / out.name)
            os.replace(tmp, out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_dir(out: Path) -> None:
    """Refuse to replace a directory that is not a prepared dataset (e.g. data.dir set to '.')."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory; refusing to replace it")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise DataError(f"{out}: exists, is not empty and holds no {MANIFEST}; refusing to replace it")


# ----------------------------------------------------------------------------------------------------------
# shard writing


def _row_group_rows(bytes_per_row: float, shard_rows: int) -> int:
    """Rows per row group: the largest power of two with at most ROW_GROUP_BYTES of image data."""
    rows = max(1, int(ROW_GROUP_BYTES // max(1.0, bytes_per_row)))
    return int(min(shard_rows, 1 << (rows.bit_length() - 1)))


class _ShardWriter:
    """Writes one split as ``<split>-NNNNN.parquet`` files of ``shard_rows`` rows, shard by shard."""

    def __init__(
        self, out_dir: Path, split: str, *, shard_rows: int, image_type: pa.DataType, meta: dict[str, str]
    ) -> None:
        self.out_dir, self.split, self.shard_rows = out_dir, split, shard_rows
        self.raw = pa.types.is_fixed_size_binary(image_type)
        self.schema = pa.schema(
            [("image", image_type), ("label", pa.int64()), ("index", pa.int64())],
            metadata={f"tcnn.{k}".encode(): v.encode() for k, v in meta.items()},
        )
        self.files: list[dict[str, Any]] = []
        self.rows = 0
        self._pending: list[bytes] = []
        self._pending_labels: list[int] = []

    def _write(self, images: pa.Array, labels: np.ndarray) -> None:
        n = len(labels)
        name = f"{self.split}-{len(self.files):05d}.parquet"
        index = np.arange(self.rows, self.rows + n, dtype=np.int64)
        table = pa.Table.from_arrays(
            [images, pa.array(labels, pa.int64()), pa.array(index)], schema=self.schema
        )
        nbytes = images.nbytes / max(1, n)
        path = self.out_dir / name
        # Raw pixels compress well with zstd (and it decodes fast); JPEG/PNG bytes, already compressed, do not.
        pq.write_table(
            table,
            path,
            row_group_size=_row_group_rows(nbytes, self.shard_rows),
            compression="zstd" if self.raw else "none",
            use_dictionary=["label"],
            write_statistics=["label", "index"],
        )
        self.files.append(
            {"name": name, "rows": n, "bytes": path.stat().st_size, "sha256": file_digest(path)}
        )
        self.rows += n

    def add_encoded(self, data: bytes, label: int) -> None:
        self._pending.append(data)
        self._pending_labels.append(label)
        if len(self._pending) >= self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._write(pa.array(self._pending, pa.binary()), np.asarray(self._pending_labels, np.int64))
            self._pending, self._pending_labels = [], []

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        return self.files


def write_array_split(
    out_dir: Path, split: str, images: np.ndarray, labels: np.ndarray, *, shard_rows: int,
    progress: Progress | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write uint8 ``images`` [N,H,W,C] and ``labels`` [N] as raw shards; returns the split's manifest entry."""
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"images must be uint8 [N,H,W,C], got {images.dtype} {images.shape}")
    n, h, w, c = images.shape
    writer = _ShardWriter(
        out_dir, split, shard_rows=shard_rows, image_type=pa.binary(h * w * c),
        meta={"image_encoding": "raw", "image_shape": json.dumps([h, w, c])},
    )  # fmt: skip
    images = np.ascontiguousarray(images)
    for start in range(0, n, shard_rows):
        block = images[start : start + shard_rows]
        arr = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(h * w * c), len(block), [None, pa.py_buffer(block)]
        )
        writer._write(arr, np.asarray(labels[start : start + shard_rows], np.int64))
        if progress:
            progress(f"write {split}", min(n, start + shard_rows), n)
    return _split_record(writer.close(), labels)


def _split_record(files: list[dict[str, Any]], labels: np.ndarray | list[int], num_classes: int = 0) -> dict:
    labels = np.asarray(labels, np.int64)
    counts = np.bincount(labels, minlength=num_classes) if len(labels) else np.zeros(num_classes, np.int64)
    return {"num_rows": int(len(labels)), "class_counts": [int(x) for x in counts], "files": files}


class _ChannelStats:
    """Exact per-channel mean/std in [0, 1] units from 256-bin histograms (integer counts, no float drift)."""

    def __init__(self, channels: int) -> None:
        self.hist = np.zeros((channels, 256), np.int64)

    def add(self, images: np.ndarray) -> None:
        channels = images.shape[-1]
        if channels == 1:  # contiguous: no per-channel copy
            self.hist[0] += np.bincount(np.ascontiguousarray(images).reshape(-1), minlength=256)
            return
        flat = images.reshape(-1, channels)
        for ch in range(channels):
            self.hist[ch] += np.bincount(flat[:, ch], minlength=256)

    def result(self) -> tuple[list[float], list[float]]:
        v = np.arange(256, dtype=np.float64) / 255.0
        n = self.hist.sum(axis=1).astype(np.float64)
        mean = (self.hist * v).sum(axis=1) / n
        var = (self.hist * v**2).sum(axis=1) / n - mean**2
        return [round(float(m), 6) for m in mean], [round(float(s), 6) for s in np.sqrt(np.maximum(var, 0))]


def _fingerprint(dataset: str, shard_rows: int, source_identity: Any) -> str:
    blob = json.dumps(
        {"format": FORMAT_VERSION, "importer": IMPORTER_VERSION, "dataset": dataset, "shard_rows": shard_rows,
         "source": source_identity},
        sort_keys=True,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()


def write_array_dataset(
    dataset: str, out: Path, arrays: dict[str, tuple[np.ndarray, np.ndarray]], label_names: list[str],
    source_info: dict[str, Any], fingerprint: str, shard_rows: int, progress: Progress | None,
) -> dict[str, Any]:  # fmt: skip
    """Write in-memory uint8 ``arrays`` {split: (images [N,H,W,C], labels [N])} as a prepared dataset at
    ``out`` (atomically; ``arrays`` must hold "train", whose per-channel mean/std go into the manifest)."""
    check_output_dir(out)
    num_classes = len(label_names)
    for split, (_, labels) in arrays.items():
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(f"{source_info['path']}: {split} labels outside 0..{num_classes - 1}")
    stats = _ChannelStats(arrays["train"][0].shape[-1])
    for start in range(0, len(arrays["train"][0]), 10000):
        stats.add(arrays["train"][0][start : start + 10000])
    mean, std = stats.result()
    with atomic_output_dir(out) as tmp:
        splits = {}
        for split, (images, labels) in arrays.items():
            entry = write_array_split(tmp, split, images, labels, shard_rows=shard_rows, progress=progress)
            entry["class_counts"] = [int(x) for x in np.bincount(labels, minlength=num_classes)]
            splits[split] = entry
        manifest = _manifest(
            dataset, source_info, fingerprint, "raw", list(arrays["train"][0].shape[1:]), label_names,
            mean, std, shard_rows, splits,
        )  # fmt: skip
        atomic_write_json(tmp / MANIFEST, manifest, indent=1)
    return manifest


def _manifest(
    dataset: str, source: dict[str, Any], fingerprint: str, encoding: str, image_shape: list[int] | None,
    label_names: list[str], mean: list[float], std: list[float], shard_rows: int, splits: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    return {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "source": source,
        "fingerprint": fingerprint,
        "image_encoding": encoding,
        "image_shape": image_shape,
        "label_names": label_names,
        "num_classes": len(label_names),
        "mean": mean,
        "std": std,
        "shard_rows": shard_rows,
        "columns": {"image": "raw uint8 HxWxC bytes" if encoding == "raw" else "encoded file bytes",
                    "label": "int64", "index": "int64 position in the split"},
        **extra,
        "splits": splits,
    }  # fmt: skip


def _up_to_date(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """The existing manifest when ``out`` already holds this exact import with intact shards, else None."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("fingerprint") != fingerprint or manifest.get("format_version") != FORMAT_VERSION:
        return None
    for entry in manifest.get("splits", {}).values():
        for rec in entry["files"]:
            path = out / rec["name"]
            if (
                not path.is_file()
                or path.stat().st_size != rec["bytes"]
                or file_digest(path) != rec["sha256"]
            ):
                return None
    return manifest
