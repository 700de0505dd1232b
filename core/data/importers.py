"""Importers: raw datasets -> Parquet shards + ``manifest.json``, the project's one on-disk data format.

A prepared dataset directory holds ``<split>-NNNNN.parquet`` shards (columns ``image``, ``label``,
``index``) and ``manifest.json``. Two image encodings exist:

- ``raw`` (Fashion-MNIST, CIFAR): ``image`` is a fixed-size binary column holding the uint8 H x W x C pixels
  of each image, so a split reads back into one contiguous numpy array without decoding.
- ``encoded`` (ImageFolder trees such as ImageNet): ``image`` holds the file bytes as found (JPEG, PNG, ...),
  decoded on read; images may differ in size.

Every import is written into a temporary directory next to the output and renamed into place at the end, so
a failed run leaves nothing half-written and never destroys an existing good output. An import whose
output already matches its source (same fingerprint, shards verified) is skipped.

Source verification: Fashion-MNIST files must match the published MD5 of the ``.gz`` file or the published
MD5 of the decompressed IDX file. Debian's ``dataset-fashion-mnist`` re-gzipped the files (no file name in
the gzip header, a 2020 mtime), so only the second check can pass there; the decompressed bytes are the
published ones. CIFAR archives are compared with the official archive MD5 and the outcome is recorded.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import pickle
import shutil
import tarfile
import tempfile
import time
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

DATASETS = ("fashion_mnist", "cifar10", "cifar100", "imagefolder")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# name: (published MD5 of name.gz, published MD5 of the decompressed file)
FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": ("25c81989df183df01b3e8a0aad5dffbe", "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": ("bef4ecab320f06d8554ea6380940ec79", "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": ("bb300cfdad3c16e7a12a480ee83cd310", "15d484375f8d13e6eb1aabb0c3f46965"),
}
FASHION_MNIST_LABELS = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip

# name: (archive file name, official archive MD5, directory inside the archive)
CIFAR_ARCHIVES = {
    "cifar10": ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", "cifar-10-batches-py"),
    "cifar100": ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85", "cifar-100-python"),
}
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
# small file helpers


def _default_cache() -> Path:
    return Path(os.environ.get("TCNN_DATA_CACHE", Path.home() / ".cache" / "tcnn"))


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
        # Raw pixels compress well (zstd, ~2x on Fashion-MNIST at ~1 GB/s decode); JPEG/PNG bytes do not.
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


# ----------------------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX)


def parse_idx(data: bytes, name: str = "IDX data") -> np.ndarray:
    """Parse an IDX file (big-endian header: 0, 0, dtype code, ndim, then ndim uint32 sizes)."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{name}: not an unsigned-byte IDX file")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape)):
        raise DataError(f"{name}: {len(data)} bytes, the IDX header promises {header + int(np.prod(shape))}")
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _find_fashion_mnist(source: Path | None) -> Path | None:
    candidates = [Path(source)] if source is not None else [FASHION_MNIST_DIR]
    if source is None:
        candidates.append(_default_cache() / "FashionMNIST" / "raw")
    for base in list(candidates):
        candidates.append(base / "FashionMNIST" / "raw")
    for base in candidates:
        if all((base / f"{n}.gz").is_file() or (base / n).is_file() for n in FASHION_MNIST_MD5):
            return base
    return None


def download_fashion_mnist(cache: Path | None = None) -> Path:
    """Fetch the four IDX files through torchvision (checks the published gz MD5s); needs internet."""
    cache = cache or _default_cache()
    try:
        from torchvision.datasets import FashionMNIST

        FashionMNIST(root=str(cache), train=True, download=True)
        FashionMNIST(root=str(cache), train=False, download=True)
    except Exception as err:  # URLError, RuntimeError("File not found or corrupted"), ...
        raise DataError(
            f"Fashion-MNIST: download into {cache} failed ({type(err).__name__}: {err})"
        ) from None
    return cache / "FashionMNIST" / "raw"


def _read_fashion_mnist_file(base: Path, name: str) -> tuple[bytes, dict[str, Any]]:
    """The decompressed bytes of one IDX file, verified against the published MD5s."""
    gz_md5, raw_md5 = FASHION_MNIST_MD5[name]
    path = base / f"{name}.gz"
    if not path.is_file():
        path = base / name
    blob = path.read_bytes()
    file_md5 = hashlib.md5(blob).hexdigest()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(blob)
        except (OSError, EOFError) as err:
            raise DataError(f"{path}: not a valid gzip file ({err})") from None
    else:
        data = blob
    content_md5 = hashlib.md5(data).hexdigest()
    if file_md5 == gz_md5:
        verified = "published MD5 of the .gz file"
    elif content_md5 == raw_md5:
        verified = "published MD5 of the decompressed IDX file"
    else:
        raise DataError(
            f"{path}: MD5 {file_md5} (decompressed {content_md5}) matches neither the published "
            f"{gz_md5} (.gz) nor {raw_md5} (IDX); the file is corrupt or not Fashion-MNIST"
        )
    info = {
        "name": path.name,
        "bytes": len(blob),
        "md5": file_md5,
        "content_md5": content_md5,
        "verified": verified,
    }
    return data, info


def _locate_fashion_mnist(source: Path | None, allow_download: bool) -> Path:
    base = _find_fashion_mnist(source)
    if base is None:
        where = source if source is not None else FASHION_MNIST_DIR
        if not allow_download or source is not None:
            raise DataError(
                f"{where}: the four Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, ...) are not there; "
                "install Debian's dataset-fashion-mnist or set data.source"
            )
        try:
            base = download_fashion_mnist()
        except DataError as err:
            raise DataError(f"{where}: Fashion-MNIST IDX files not found, and {err}") from None
    return base


def import_fashion_mnist(
    source: Path | None, out: Path, *, shard_rows: int = 10000, allow_download: bool = True,
    progress: Progress | None = None, force: bool = False,
) -> ImportResult:  # fmt: skip
    """Import Fashion-MNIST from its IDX files (``source`` dir, the Debian dir, or torchvision's download)."""
    t0 = time.perf_counter()
    base = _locate_fashion_mnist(source, allow_download)
    raw: dict[str, bytes] = {}
    files: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(FASHION_MNIST_MD5):
        data, info = _read_fashion_mnist_file(base, name)
        raw[name] = data
        files[info.pop("name")] = info
        if progress:
            progress("verify source", i + 1, len(FASHION_MNIST_MD5))
    identity = sorted(v["content_md5"] for v in files.values())
    fingerprint = _fingerprint("fashion_mnist", shard_rows, identity)
    if not force and (existing := _up_to_date(out, fingerprint)) is not None:
        return ImportResult(existing, out, True, time.perf_counter() - t0)

    arrays = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = parse_idx(raw[f"{prefix}-images-idx3-ubyte"], f"{prefix}-images-idx3-ubyte")
        labels = parse_idx(raw[f"{prefix}-labels-idx1-ubyte"], f"{prefix}-labels-idx1-ubyte")
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{base}/{prefix}-*: {images.shape} images do not match {labels.shape} labels")
        arrays[split] = (images[..., None], labels.astype(np.int64))
    source_info = {"kind": "idx", "path": str(base.resolve()), "files": files}
    manifest = write_array_dataset(
        "fashion_mnist",
        out,
        arrays,
        list(FASHION_MNIST_LABELS),
        source_info,
        fingerprint,
        shard_rows,
        progress,
    )
    return ImportResult(manifest, out, False, time.perf_counter() - t0)


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


_write_array_dataset = write_array_dataset  # the old private name (tests/_train_helpers.py uses it)


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


# ----------------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python-version archive)


class _CifarUnpickler(pickle.Unpickler):
    """CIFAR batches are pickles; allow only what they contain (dicts, lists, bytes, numpy arrays)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module.replace("numpy.core.", "numpy._core."), name)


def _unpickle(data: bytes, name: str) -> dict[str, Any]:
    try:
        obj = _CifarUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as err:
        raise DataError(f"{name}: not a CIFAR python batch ({type(err).__name__}: {err})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{name}: not a CIFAR python batch (a {type(obj).__name__}, expected a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _cifar_members(source: Path, inner: str, names: list[str]) -> Iterator[tuple[str, bytes]]:
    """Yield (member name, bytes) from the archive or an extracted directory, without extracting to disk."""
    if source.is_dir():
        base = source / inner if (source / inner).is_dir() else source
        for n in names:
            path = base / n
            if not path.is_file():
                raise DataError(f"{path}: missing CIFAR batch file")
            yield str(path), path.read_bytes()
        return
    try:
        with tarfile.open(source, "r:*") as tar:
            members = {m.name.split("/", 1)[-1] if "/" in m.name else m.name: m for m in tar.getmembers()}
            for n in names:
                m = members.get(n)
                if m is None or not m.isfile():
                    raise DataError(f"{source}: archive has no {inner}/{n}")
                f = tar.extractfile(m)
                assert f is not None
                yield f"{source}:{m.name}", f.read()
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as err:
        raise DataError(f"{source}: unreadable archive ({type(err).__name__}: {err})") from None


def _cifar_arrays(batches: list[dict[str, Any]], label_key: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    data, labels = [], []
    for b in batches:
        if "data" not in b or label_key not in b:
            raise DataError(f"{name}: batch lacks 'data' or '{label_key}'")
        x = np.asarray(b["data"], np.uint8)
        if x.ndim != 2 or x.shape[1] != 3072:
            raise DataError(f"{name}: 'data' has shape {x.shape}, expected [N, 3072]")
        data.append(x)
        labels.append(np.asarray(b[label_key], np.int64))
    x = np.concatenate(data)
    # Rows are 1024 red, then 1024 green, then 1024 blue values, each plane row-major 32 x 32.
    images = np.ascontiguousarray(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, np.concatenate(labels)


def download_cifar(name: str, cache: Path | None = None) -> Path:
    """Fetch the python-version archive through torchvision (checks the official MD5); needs internet."""
    cache = cache or _default_cache()
    try:
        from torchvision.datasets import CIFAR10, CIFAR100

        (CIFAR10 if name == "cifar10" else CIFAR100)(root=str(cache), train=True, download=True)
    except Exception as err:
        raise DataError(f"{name}: download into {cache} failed ({type(err).__name__}: {err})") from None
    return cache / CIFAR_ARCHIVES[name][0]


def import_cifar(
    name: str, source: Path | None, out: Path, *, shard_rows: int = 10000, allow_download: bool = True,
    progress: Progress | None = None, force: bool = False,
) -> ImportResult:  # fmt: skip
    """Import CIFAR-10/100 from the python-version archive (``.tar.gz``) or its extracted directory."""
    t0 = time.perf_counter()
    archive_name, official_md5, inner = CIFAR_ARCHIVES[name]
    if source is None:
        cached = _default_cache() / archive_name
        if cached.is_file():
            source = cached
        elif allow_download:
            source = download_cifar(name)
        else:
            raise DataError(f"{name}: data.source is not set and {cached} does not exist")
    source = Path(source)
    if not source.exists():
        raise DataError(f"{source}: no such CIFAR archive or directory")
    if source.is_dir():
        files = {}
        for p in sorted(q for q in source.rglob("*") if q.is_file()):
            files[str(p.relative_to(source))] = {"bytes": p.stat().st_size, "md5": file_digest(p, "md5")}
        identity: Any = files
        verified = "extracted directory (no official checksum to compare)"
    else:
        md5 = file_digest(source, "md5")
        files = {source.name: {"bytes": source.stat().st_size, "md5": md5}}
        identity = md5
        verified = (
            "official archive MD5" if md5 == official_md5 else f"differs from the official MD5 {official_md5}"
        )
        files[source.name]["verified"] = verified
    fingerprint = _fingerprint(name, shard_rows, identity)
    if not force and (existing := _up_to_date(out, fingerprint)) is not None:
        return ImportResult(existing, out, True, time.perf_counter() - t0)

    if name == "cifar10":
        train_names, test_names, meta_name = (
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
            "batches.meta",
        )
        label_key, names_key = "labels", "label_names"
    else:
        train_names, test_names, meta_name = ["train"], ["test"], "meta"
        label_key, names_key = "fine_labels", "fine_label_names"
    blobs = dict(_cifar_members(source, inner, [*train_names, *test_names, meta_name]))
    batches = {k.rsplit("/", 1)[-1].rsplit(":", 1)[-1]: _unpickle(v, k) for k, v in blobs.items()}
    meta = batches[meta_name]
    if names_key not in meta:
        raise DataError(f"{source}: {meta_name} lacks '{names_key}'")
    label_names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[names_key]]
    arrays = {
        "train": _cifar_arrays([batches[n] for n in train_names], label_key, f"{source} (train)"),
        "test": _cifar_arrays([batches[n] for n in test_names], label_key, f"{source} (test)"),
    }
    source_info = {
        "kind": "cifar-python",
        "path": str(source.resolve()),
        "files": files,
        "verified": verified,
    }
    manifest = write_array_dataset(
        name, out, arrays, label_names, source_info, fingerprint, shard_rows, progress
    )
    return ImportResult(manifest, out, False, time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------------------


def import_dataset(
    name: str, source: Path | str | None, out: Path | str, *, shard_rows: int = 10000,
    allow_download: bool = True, progress: Progress | None = None, force: bool = False, order: str = "sorted",
) -> ImportResult:  # fmt: skip
    """Import dataset ``name`` (``data.name``) from ``source`` (``data.source``; None = default/download).
    ``order``: the row order of an ImageFolder import (core.data.imagefolder: "interleaved" for streaming)."""
    out = Path(out)
    if name not in DATASETS:
        raise DataError(f"data.name: unknown dataset {name!r}; choose from {list(DATASETS)}")
    check_output_dir(out)  # before any expensive work on the source
    source = Path(source) if source is not None else None
    kw = dict(shard_rows=shard_rows, progress=progress, force=force)
    with _output_lock(out):  # concurrent imports into one dir (Ray trials): the later ones find it done
        if name == "fashion_mnist":
            return import_fashion_mnist(source, out, allow_download=allow_download, **kw)
        if name in CIFAR_ARCHIVES:
            return import_cifar(name, source, out, allow_download=allow_download, **kw)
        from core.data.imagefolder import import_imagefolder

        return import_imagefolder(source, out, order=order, **kw)


@contextlib.contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """An exclusive advisory lock on the output's nearest existing ancestor directory (no lock file, nothing
    created; released if the process dies). Filesystems that refuse flock on a directory run unlocked."""
    import fcntl

    anchor = out.absolute().parent
    while not anchor.is_dir() and anchor != anchor.parent:
        anchor = anchor.parent
    fd = os.open(anchor, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
