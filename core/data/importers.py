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
import os
import pickle
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from core.data.catalog import DATASETS
from core.data.shards import (  # noqa: F401  (re-exported: the import path of the format's pieces before the split)
    FORMAT_VERSION,
    IMG_EXTENSIONS,
    IMPORTER_VERSION,
    MANIFEST,
    ROW_GROUP_BYTES,
    SPLITS,
    STATS_MAX_IMAGES,
    DataError,
    ImportResult,
    Progress,
    _ChannelStats,
    _fingerprint,
    _manifest,
    _ShardWriter,
    _split_record,
    _up_to_date,
    atomic_output_dir,
    check_output_dir,
    write_array_dataset,
    write_array_split,
)
from core.utils.hashing import file_digest

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

# small file helpers


def _default_cache() -> Path:
    return Path(os.environ.get("TCNN_DATA_CACHE", Path.home() / ".cache" / "tcnn"))


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
