"""ImageFolder trees (``train/<class>/*.jpg`` + ``test/`` or ``val/``) into encoded Parquet shards, read from a
directory or straight from a ``.tar`` / ``.tar.gz`` / ``.tgz`` archive of one.

The archive path exists for data that arrives as one file (the CIFAR-10 JPEG copy of this project's machines,
``../shared/datasets/cifar10-jpeg.tar.gz``): it is read in one streaming pass, never extracted to disk, and
its sha256 becomes the source identity, so a changed archive is re-imported and an unchanged one is not.
The manifest's ``source`` records the provenance a lossy copy needs: the archive's sha256 and size and the
JPEG quality and chroma subsampling of its files (the IJG quality whose quantization tables the file carries,
found by re-encoding with the same library; "custom" when none matches).

Row order: "sorted" (class folders in name order, files sorted: the default) or "interleaved" (classes take
turns: the r-th file of every class before the (r+1)-th of any), which a streamed dataset gets (``data.stream``:
stages/prepare.py). A Parquet row group is what core.data.stream reads at once, and its window shuffle draws a
batch from a few dozen groups: sorted, a group holds one or two classes and a batch of 256 from a 1000-class
tree spans ~32 of them; interleaved, a group holds as many classes as rows and the batch spans about as many
as a uniform shuffle's ~226 (tests/test_data_stream.py measures it).

A missing, truncated or corrupt source fails with one :class:`~core.data.importers.DataError` line before
anything is written (the output is assembled in a temp dir and renamed into place).
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core.data.shards import (
    IMG_EXTENSIONS,
    MANIFEST,
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
)
from core.utils.atomic import atomic_write_json
from core.utils.errors import first_line

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
ORDERS = ("sorted", "interleaved")
ARCHIVE_MAX_BYTES = 4 << 30  # held in memory while importing; larger archives: extract and pass the folder
_SPLIT_DIRS = {"train": ("train",), "test": ("val", "test")}  # the first that exists names the test split
_SUBSAMPLING = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}


def is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


# ------------------------------------------------------------------------------------------- the trees


class _Tree:
    """The files of an ImageFolder tree: relative POSIX paths -> bytes, and the tree's identity."""

    def paths(self) -> list[str]:
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        raise NotImplementedError

    def identity(self, items: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
        """What names this tree's content for the import fingerprint."""
        raise NotImplementedError


class _DirTree(_Tree):
    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: list[str] = []
        for top, dirs, names in os.walk(root, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rel = Path(top).relative_to(root)
            self._paths += [
                f"{(rel / d).as_posix()}/" for d in dirs
            ]  # folders too: an empty class folder counts
            self._paths += [(rel / n).as_posix() for n in sorted(names) if not n.startswith(".")]

    def paths(self) -> list[str]:
        return self._paths

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def identity(self, items: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
        listing = hashlib.sha256()
        for split, its in items.items():
            for rel, label in its:
                st = (self.root / rel).stat()
                listing.update(f"{split}\0{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"listing": listing.hexdigest()}


class _ArchiveTree(_Tree):
    """A tar archive's regular files, read in one streaming pass (a top-level folder above ``train/`` is
    stripped). ``sha256`` is the archive file's."""

    def __init__(self, path: Path, sha256: str) -> None:
        self.path, self.sha256 = path, sha256
        files: dict[str, bytes] = {}
        try:
            with tarfile.open(path, mode="r|*") as tar:
                for member in tar:
                    name = member.name.removeprefix("./").lstrip("/")
                    if member.isdir():
                        files[name.rstrip("/") + "/"] = b""
                    if not member.isfile():
                        continue
                    fh = tar.extractfile(member)
                    if fh is not None:
                        files[name] = fh.read()
        except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
            raise DataError(
                f"data.source: {path} is not a readable tar archive ({first_line(err)})"
            ) from None
        prefix = _archive_root(files)
        self._files = {k[len(prefix) :]: v for k, v in files.items() if k.startswith(prefix)}

    def paths(self) -> list[str]:
        return sorted(self._files)  # folders end in "/"

    def read(self, rel: str) -> bytes:
        return self._files[rel]

    def identity(self, items: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
        return {"archive_sha256": self.sha256}


def _archive_root(files: dict[str, bytes]) -> str:
    """The prefix ('' or 'top/') under which the archive holds ``train/``."""
    for name in sorted(files):
        parts = name.split("/")
        if "train" in parts[:-1]:
            return "/".join(parts[: parts.index("train")]) + ("/" if parts.index("train") else "")
    return ""


def _archive_digest(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError as err:
        raise DataError(f"data.source: cannot read {path} ({first_line(err)})") from None
    return h.hexdigest()


def check_archive(source: Path) -> None:
    """Read an archive source to its end without keeping anything (a truncated or corrupt one fails here, in
    one :class:`DataError` line); a folder or a missing path is left to the import."""
    if not source.is_file() or not is_archive(source):
        return
    try:
        with tarfile.open(source, mode="r|*") as tar:
            for member in tar:
                if member.isfile() and (fh := tar.extractfile(member)) is not None:
                    while fh.read(1 << 20):
                        pass
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise DataError(f"data.source: {source} is not a readable tar archive ({first_line(err)})") from None


def _open_tree(source: Path) -> _Tree:
    if not source.exists():
        raise DataError(f"data.source: {source} does not exist")
    if source.is_dir():
        return _DirTree(source)
    if not is_archive(source):
        raise DataError(
            f"data.source: {source} is neither a directory nor a {'/'.join(ARCHIVE_SUFFIXES)} archive"
        )
    size = source.stat().st_size
    if size > ARCHIVE_MAX_BYTES:
        raise DataError(
            f"data.source: {source} is {size / 2**30:.1f} GiB; extract it and point data.source at the folder"
        )
    return _ArchiveTree(source, _archive_digest(source))


# ------------------------------------------------------------------------------------------ the listing


def _where(source: Path, prefix: str) -> str:
    return f"{source}/{prefix.rstrip('/')}" if prefix else str(source)


def _split_prefixes(paths: list[str]) -> dict[str, str]:
    """``train/`` + ``val/`` (or ``test/``) -> splits train/test; else the whole tree is the train split."""
    tops = {p.split("/", 1)[0] for p in paths if "/" in p}
    if "train" not in tops:
        return {"train": ""}
    out = {"train": "train/"}
    test = next((d for d in _SPLIT_DIRS["test"] if d in tops), None)
    if test:
        out["test"] = f"{test}/"
    return out


def _scan(
    paths: list[str], prefix: str, classes: list[str] | None, where: str
) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(path, label)]) of the images under ``prefix``: ``<class>/.../<image>``."""
    found: dict[str, list[str]] = {}
    for p in paths:
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix) :].split("/")
        if len(rest) >= 2 and not rest[0].startswith("."):
            found.setdefault(rest[0], [])
            if rest[-1].lower().endswith(IMG_EXTENSIONS):
                found[rest[0]].append(p)
    if classes is None:
        classes = sorted(found)
    elif unknown := sorted(set(found) - set(classes)):
        raise DataError(f"{where}: class folder(s) {unknown[:5]} do not exist in the train split")
    if not classes:
        raise DataError(f"{where}: no class folders")
    index = {c: i for i, c in enumerate(classes)}
    items = [(p, index[c]) for c in sorted(found) for p in sorted(found[c])]
    if not items:
        raise DataError(f"{where}: no image files ({', '.join(IMG_EXTENSIONS)})")
    return classes, items


# ----------------------------------------------------------------------------------------- JPEG quality


@lru_cache(maxsize=1)
def _ijg_tables() -> dict[tuple, int]:
    """The luminance quantization table of every IJG quality 1..100, as this PIL writes it -> the quality."""
    from PIL import Image

    out: dict[tuple, int] = {}
    img = Image.new("RGB", (8, 8))
    for q in range(1, 101):
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=q)
        with Image.open(buf) as decoded:
            out.setdefault(tuple(decoded.quantization[0]), q)
    return out


def jpeg_quality(img: Any) -> str:
    """The IJG quality (1..100, as a string) whose luminance table an open PIL JPEG carries, or "custom"."""
    tables = getattr(img, "quantization", None) or {}
    if 0 not in tables:
        return "custom"
    return str(_ijg_tables().get(tuple(tables[0]), "custom"))


def interleave(items: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Classes take turns (round robin in class order), each class's files in their sorted order."""
    rank: dict[int, int] = {}
    keyed = []
    for i, (_path, label) in enumerate(items):
        rank[label] = rank.get(label, -1) + 1
        keyed.append((rank[label], label, i))
    return [items[i] for _, _, i in sorted(keyed)]


def _jpeg_info(img: Any) -> tuple[str, str] | None:
    if img.format != "JPEG":
        return None
    from PIL import JpegImagePlugin

    return jpeg_quality(img), _SUBSAMPLING.get(JpegImagePlugin.get_sampling(img), "other")


def _count(counter: dict[str, int], key: str) -> None:
    counter[key] = counter.get(key, 0) + 1


# ------------------------------------------------------------------------------------------------ import


def import_imagefolder(
    source: Path | None, out: Path, *, shard_rows: int = 10000, mode: str = "RGB",
    progress: Progress | None = None, force: bool = False, stats_max_images: int = STATS_MAX_IMAGES,
    order: str = "sorted",
) -> ImportResult:  # fmt: skip
    """Import an ImageFolder tree (``class/image.ext``; a directory or a tar archive of one), streaming file
    bytes into shards, rows in ``order`` (see the module docstring).

    Every file's header is parsed (PIL) so that a file that is not an image fails here, naming the file,
    rather than in the middle of training. Per-channel mean/std come from an evenly spaced subset of at most
    ``stats_max_images`` decoded training images.
    """
    t0 = time.perf_counter()
    if source is None:
        raise DataError("data.source: an ImageFolder import needs the tree's path (a folder or a .tar.gz)")
    source = Path(source)
    tree = _open_tree(source)
    paths = tree.paths()
    prefixes = _split_prefixes(paths)
    classes, train_items = _scan(paths, prefixes["train"], None, _where(source, prefixes["train"]))
    items = {"train": train_items}
    if "test" in prefixes:
        items["test"] = _scan(paths, prefixes["test"], classes, _where(source, prefixes["test"]))[1]
    if order not in ORDERS:
        raise DataError(f"row order {order!r}: choose from {list(ORDERS)}")
    identity = {**tree.identity(items), "mode": mode, "stats_max_images": stats_max_images}
    if order != "sorted":  # the default keeps the identity (and the fingerprint) of earlier imports
        identity["order"] = order
        items = {split: interleave(its) for split, its in items.items()}
    fingerprint = _fingerprint("imagefolder", shard_rows, identity)
    if not force and (existing := _up_to_date(out, fingerprint)) is not None:
        return ImportResult(existing, out, True, time.perf_counter() - t0)
    check_output_dir(out)
    info = _write(
        tree, items, prefixes, classes, out, fingerprint, shard_rows, mode, progress, stats_max_images, order
    )
    return ImportResult(info, out, False, time.perf_counter() - t0)


def _source_info(tree: _Tree, source_path: Path, prefixes: dict[str, str], n: int, content: str) -> dict:
    info: dict[str, Any] = {
        "kind": "imagefolder", "path": str(source_path.resolve()),
        "split_dirs": {k: v.rstrip("/") or "." for k, v in prefixes.items()},
        "num_files": n, "content_sha256_of_md5s": content,
    }  # fmt: skip
    if isinstance(tree, _ArchiveTree):
        info.update(
            kind="imagefolder-archive", archive_sha256=tree.sha256, archive_bytes=source_path.stat().st_size
        )
    return info


def _write(
    tree: _Tree, items: dict[str, list[tuple[str, int]]], prefixes: dict[str, str], classes: list[str],
    out: Path, fingerprint: str, shard_rows: int, mode: str, progress: Progress | None, stats_max_images: int,
    order: str,
) -> dict[str, Any]:  # fmt: skip
    from PIL import Image, UnidentifiedImageError

    source_path = tree.path if isinstance(tree, _ArchiveTree) else tree.root
    channels = len(Image.new(mode, (1, 1)).getbands())
    stats = _ChannelStats(channels)
    formats: dict[str, int] = {}
    quality: dict[str, int] = {}
    sampling: dict[str, int] = {}
    sizes: set[tuple[int, int]] = set()
    content = hashlib.sha256()
    splits = {}
    stride = max(1, -(-len(items["train"]) // stats_max_images))  # ceil: at most stats_max_images
    read: Callable[[str], bytes] = tree.read
    with atomic_output_dir(out) as tmp:
        for split, its in items.items():
            writer = _ShardWriter(
                tmp, split, shard_rows=shard_rows, image_type=pa.binary(),
                meta={"image_encoding": "encoded", "image_mode": mode},
            )  # fmt: skip
            for i, (rel, label) in enumerate(its):
                data = read(rel)
                content.update(hashlib.md5(data).digest())
                try:
                    with Image.open(io.BytesIO(data)) as img:
                        _count(formats, img.format or "unknown")
                        if (jpeg := _jpeg_info(img)) is not None:
                            _count(quality, jpeg[0])
                            _count(sampling, jpeg[1])
                        sizes.add((img.height, img.width))
                        if split == "train" and i % stride == 0:
                            stats.add(np.asarray(img.convert(mode)).reshape(-1, channels))
                except (UnidentifiedImageError, OSError, ValueError) as err:
                    raise DataError(f"{source_path}/{rel}: not a readable image ({err})") from None
                writer.add_encoded(data, label)
                if progress and (i % 256 == 0 or i + 1 == len(its)):
                    progress(f"write {split}", i + 1, len(its))
            splits[split] = _split_record(writer.close(), [lab for _, lab in its], len(classes))
        mean, std = stats.result()
        (h, w), uniform = (next(iter(sizes)), True) if len(sizes) == 1 else ((None, None), False)
        info = _source_info(
            tree, source_path, prefixes, sum(len(v) for v in items.values()), content.hexdigest()
        )
        if quality:
            info.update(jpeg_quality=quality, jpeg_subsampling=sampling)
        manifest = _manifest(
            "imagefolder", info, fingerprint, "encoded", [h, w, channels] if uniform else None, classes,
            mean, std, shard_rows, splits, image_mode=mode, image_formats=formats,
            image_size_range=[list(min(sizes)), list(max(sizes))],
            stats_images=len(range(0, len(items["train"]), stride)),
            **({"row_order": order} if order != "sorted" else {}),
        )  # fmt: skip
        atomic_write_json(tmp / MANIFEST, manifest, indent=1)
    return manifest
