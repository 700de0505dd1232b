"""Readers for the public robustness benchmarks (none can be downloaded here; tests build tiny copies).

Layouts:

- ImageNet-C: ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``; some copies keep the category level
  (``<root>/noise/gaussian_noise/1/<wnid>/...``). 50k images per (corruption, severity); class index =
  position of the wnid in sorted order (the 1000 ImageNet classes), or in a wnid list you pass.
- Tiny-ImageNet-C: the same tree with 64 px images and 200 classes (sorted wnids of the tree).
- CIFAR-10-C / CIFAR-100-C: ``<root>/<corruption>.npy`` uint8 [5 n, 32, 32, 3] holding severities 1..5 in
  order (n = 10000), and ``<root>/labels.npy`` with the labels for all 5 n rows.
- ImageNet-A / ImageNet-R: ImageFolder trees ``<root>/<wnid>/*`` over a 200-class subset of the ImageNet
  classes. The two benchmarks use *different* 200-wnid subsets, so no subset is hard-coded: it is read off
  the sorted wnid folders present in the tree and mapped onto the 1000-class head through the full
  ImageNet-1k wnid list the caller supplies (:func:`load_wnids`: a list, a text file with one wnid per line
  such as ``LOC_synset_mapping.txt``, a JSON list or class-index dict, or an ImageNet train/val directory
  whose sorted sub-folders are the wnids). Labels are then in the 1000-class space and
  :func:`read_imagenet_subset` also returns the subset's 1000-class indices, with which the evaluation
  takes the best class among the 200 (``core.robustness.count_correct(..., class_subset=...)``), as the
  benchmarks' own evaluation code masks the logits.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from core.robustness.corruptions import CATEGORIES, CATEGORY_OF, CORRUPTIONS, SEVERITIES, StoredSet
from core.robustness.public_kinds import PUBLIC_KINDS
from core.utils.errors import first_line

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_WNID = re.compile(r"^n\d{8}$")


class ImageFolderSet(Sequence):
    """Images of an ImageFolder-style tree, read lazily: ``ds[i] -> (uint8 [H, W, 3], label)``.

    `classes` lists the class names (wnids) in label order; `samples` the (path, label) pairs in sorted
    class then file order.
    """

    def __init__(
        self,
        root: Path,
        samples: list[tuple[Path, int]],
        classes: list[str],
        transform: Callable[[Image.Image], Image.Image] | None = None,
    ) -> None:
        self.root, self.samples, self.classes, self.transform = Path(root), samples, classes, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
        path, label = self.samples[i]
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                if self.transform is not None:
                    im = self.transform(im)
                return np.asarray(im, dtype=np.uint8), label
        except OSError as err:
            raise ValueError(f"{path}: unreadable image ({err})") from None

    @property
    def labels(self) -> np.ndarray:
        return np.array([label for _, label in self.samples], dtype=np.int64)

    def batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(uint8 [B, H, W, 3], int64 [B]) in order; images of a batch must share a size (set a transform
        such as :func:`resize_center_crop` for trees of mixed sizes)."""
        for a in range(0, len(self), batch_size):
            items = [self[i] for i in range(a, min(a + batch_size, len(self)))]
            shapes = {x.shape for x, _ in items}
            if len(shapes) > 1:
                raise ValueError(f"{self.root}: images of different sizes {sorted(shapes)}; pass a transform")
            yield np.stack([x for x, _ in items]), np.array([y for _, y in items], dtype=np.int64)


def resize_center_crop(resize: int = 256, crop: int = 224) -> Callable[[Image.Image], Image.Image]:
    """The standard ImageNet evaluation transform: shorter side to `resize` (bilinear), centre `crop`."""

    def transform(im: Image.Image) -> Image.Image:
        w, h = im.size
        scale = resize / min(w, h)
        im = im.resize((max(crop, round(w * scale)), max(crop, round(h * scale))), Image.BILINEAR)
        w, h = im.size
        left, top = (w - crop) // 2, (h - crop) // 2
        return im.crop((left, top, left + crop, top + crop))

    return transform


def _class_dirs(root: Path) -> list[str]:
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _images_of(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def read_image_folder(
    root: str | os.PathLike,
    *,
    classes: Sequence[str] | None = None,
    transform: Callable[[Image.Image], Image.Image] | None = None,
) -> ImageFolderSet:
    """An ImageFolder tree; label = index of the folder name in `classes` (default: sorted folder names).
    Folders missing from `classes` are an error; classes without a folder simply have no images."""
    root = Path(root)
    folders = _class_dirs(root)
    if not folders:
        raise ValueError(f"{root}: no class folders")
    names = list(classes) if classes is not None else folders
    index = {name: i for i, name in enumerate(names)}
    unknown = [f for f in folders if f not in index]
    if unknown:
        raise ValueError(f"{root}: class folders not in the class list: {unknown[:5]}")
    samples = [(p, index[f]) for f in folders for p in _images_of(root / f)]
    if not samples:
        raise ValueError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)})")
    return ImageFolderSet(root, samples, names, transform)


# ----------------------------------------------------------------------------------------------------------
# ImageNet-C / Tiny-ImageNet-C
# ----------------------------------------------------------------------------------------------------------


def imagenet_c_sets(root: str | os.PathLike) -> dict[tuple[str, int], Path]:
    """``{(corruption, severity): directory}`` of an ImageNet-C style tree, with or without the category
    level (``<root>/<corruption>/<s>`` or ``<root>/<category>/<corruption>/<s>``)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    found: dict[tuple[str, int], Path] = {}
    for c in CORRUPTIONS:
        for base in (root / c, root / CATEGORY_OF[c] / c):
            for s in SEVERITIES:
                d = base / str(s)
                if d.is_dir():
                    if (c, s) in found and found[(c, s)] != d:
                        raise ValueError(f"{root}: {c} severity {s} found twice ({found[(c, s)]}, {d})")
                    found[(c, s)] = d
    if not found:
        expected = ", ".join(list(CATEGORIES)[:1] + list(CORRUPTIONS)[:2])
        raise ValueError(f"{root}: no <corruption>/<severity> folders (expected e.g. {expected})")
    return found


def read_imagenet_c(
    root: str | os.PathLike,
    corruption: str,
    severity: int,
    *,
    wnids: Sequence[str] | None = None,
    transform: Callable[[Image.Image], Image.Image] | None = None,
) -> ImageFolderSet:
    """One (corruption, severity) of ImageNet-C or Tiny-ImageNet-C.

    Class index = position in `wnids` (the model's class list) or, by default, in the sorted wnid folders
    of that set -- for a complete tree, the usual sorted-wnid ImageNet (1000) / Tiny-ImageNet (200) order.
    """
    sets = imagenet_c_sets(root)
    if (corruption, severity) not in sets:
        raise FileNotFoundError(f"{root}: no {corruption}/{severity} (has {len(sets)} sets)")
    return read_image_folder(sets[(corruption, severity)], classes=wnids, transform=transform)


read_tiny_imagenet_c = read_imagenet_c  # same layout, 64 px, 200 classes


# ----------------------------------------------------------------------------------------------------------
# CIFAR-10-C / CIFAR-100-C
# ----------------------------------------------------------------------------------------------------------


def cifar_c_corruptions(root: str | os.PathLike) -> list[str]:
    """The corruptions with a ``<corruption>.npy`` file under `root`, in benchmark order."""
    root = Path(root)
    return [c for c in CORRUPTIONS if (root / f"{c}.npy").is_file()]


def read_cifar_c(
    root: str | os.PathLike, corruption: str, severity: int | None = None, *, mmap: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [n, H, W, C], int64 labels [n]) of one severity (or all 5, stacked, for None).

    The .npy holds the 5 severities one after the other (10k each for the public sets; any multiple of 5
    is accepted). With `mmap` the images are memory-mapped, not read.
    """
    root = Path(root)
    if corruption not in CATEGORY_OF:
        raise ValueError(f"unknown corruption {corruption!r}")
    path, lpath = root / f"{corruption}.npy", root / "labels.npy"
    for p in (path, lpath):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: not found")
    try:
        images = np.load(path, mmap_mode="r" if mmap else None)
        labels = np.load(lpath).astype(np.int64).reshape(-1)
    except ValueError as err:
        raise ValueError(f"{path}: not a valid .npy file ({err})") from None
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise ValueError(f"{path}: expected uint8 [N, H, W(, C)], got {images.dtype} {list(images.shape)}")
    total = len(images)
    if total % 5 or len(labels) != total:
        raise ValueError(f"{path}: {total} images and {len(labels)} labels; expected 5 x n of each")
    if images.ndim == 3:
        images = images[..., None]
    if severity is None:
        return images, labels
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1..5, got {severity!r}")
    n = total // 5
    sl = slice((severity - 1) * n, severity * n)
    return images[sl], labels[sl]


# ----------------------------------------------------------------------------------------------------------
# ImageNet-A / ImageNet-R
# ----------------------------------------------------------------------------------------------------------


def load_wnids(source: str | os.PathLike | Sequence[str]) -> list[str]:
    """The ordered ImageNet wnid list (index = class of the 1000-class head) from a list, a text file
    (first token of each non-empty line, e.g. ``LOC_synset_mapping.txt``), a JSON list, a JSON dict
    ``{"0": ["n01440764", "tench"], ...}`` (Keras' imagenet_class_index.json) or a directory whose sorted
    sub-folders are the wnids (an ImageNet train or val tree)."""
    if not isinstance(source, (str, os.PathLike)):
        wnids = [str(w) for w in source]
        where = "wnids"
    else:
        path = Path(source)
        where = str(path)
        if path.is_dir():
            wnids = _class_dirs(path)
        elif not path.is_file():
            raise FileNotFoundError(f"{path}: wnid list not found")
        elif path.suffix.lower() == ".json":
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
            if isinstance(data, list):
                wnids = [str(w) for w in data]
            elif isinstance(data, dict):
                items = sorted(data.items(), key=lambda kv: int(kv[0]))
                wnids = [str(v[0] if isinstance(v, (list, tuple)) else v) for _, v in items]
            else:
                raise ValueError(f"{path}: expected a JSON list or dict of wnids")
        else:
            wnids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
    bad = [w for w in wnids if not _WNID.match(w)]
    if bad:
        raise ValueError(f"{where}: not ImageNet wnids: {bad[:3]}")
    if len(set(wnids)) != len(wnids):
        raise ValueError(f"{where}: duplicate wnids")
    return wnids


def read_imagenet_subset(
    root: str | os.PathLike,
    wnids: str | os.PathLike | Sequence[str],
    *,
    transform: Callable[[Image.Image], Image.Image] | None = None,
) -> tuple[ImageFolderSet, np.ndarray]:
    """ImageNet-A or ImageNet-R (or any ImageFolder over ImageNet classes) mapped onto the full head.

    Returns the set, whose labels are indices into `wnids` (the 1000-class head), and the sorted head
    indices of the classes present (200 for both benchmarks, but different ones), to pass as
    ``class_subset`` to the evaluation.
    """
    full = load_wnids(wnids)
    ds = read_image_folder(root, classes=full, transform=transform)
    index = {w: i for i, w in enumerate(full)}
    subset = np.array(sorted(index[f] for f in _class_dirs(Path(root))), dtype=np.int64)
    return ds, subset


read_imagenet_a = read_imagenet_subset
read_imagenet_r = read_imagenet_subset


# ----------------------------------------------------------------------------------------------------------
# Published corrupted sets as an evaluation source (robustness.public)
# ----------------------------------------------------------------------------------------------------------


#: robustness.public.kind -> layout: "npy" (CIFAR-10-C / CIFAR-100-C) or "tree" (ImageNet-C / Tiny-ImageNet-C).


class PublicSets:
    """The (corruption, severity) sets of a published benchmark, read like the corrupt stage's own sets.

    ``load(c, s)`` returns a :class:`core.robustness.corruptions.StoredSet` of the same ``n_images`` positions
    of every set (evenly spaced over the set, or all of them): ``indices`` are those positions, so every
    corrupted copy of one source image carries one index, and the paired bootstrap resamples source images
    across all sets, as for the generated sets. The positions also index the clean test split the stage
    evaluates: the same images when that split is the benchmark's source in its order (canonical CIFAR-10 /
    CIFAR-100 test split: CIFAR-10-C row i of every severity is test image i; an ImageNet validation tree in
    sorted wnid/file order for ImageNet-C), otherwise only positions are paired (point estimates unchanged).
    """

    def __init__(self, kind: str, root: str | os.PathLike, n_images: int | None, n_clean: int) -> None:
        if kind not in PUBLIC_KINDS:
            raise ValueError(f"robustness.public.kind: {kind!r}; choose from {list(PUBLIC_KINDS)}")
        self.kind, self.root = kind, Path(root)
        if PUBLIC_KINDS[kind].layout == "npy":
            names = cifar_c_corruptions(self.root)
            if not names:
                raise FileNotFoundError(f"{self.root}: no <corruption>.npy files (CIFAR-10-C layout)")
            self.available = [(c, s) for c in names for s in SEVERITIES]
            first = self.root / f"{names[0]}.npy"
            try:
                size = len(np.load(first, mmap_mode="r")) // 5
            except (ValueError, OSError) as err:
                raise ValueError(f"{first}: not a valid .npy file ({first_line(err, 120)})") from None
        else:
            self.sets = imagenet_c_sets(self.root)
            self.available = sorted(self.sets, key=lambda cs: (CORRUPTIONS.index(cs[0]), cs[1]))
            size = len(read_imagenet_c(self.root, *self.available[0]))
        n = min(size, n_clean, n_images or size)
        self.positions = np.unique(np.linspace(0, min(size, n_clean) - 1, n).round().astype(np.int64))

    def check(self, corruptions: Sequence[str], image_shape: Sequence[int], num_classes: int) -> None:
        """Before any model runs: every ``<corruption>.npy`` of the CIFAR-C layout holds uint8 images of the
        clean test images' shape ([N, H, W, C] channels-last; [N, H, W] for one channel) and ``labels.npy``
        integer labels of the dataset's classes, one per image (headers and labels only; the images are
        memory-mapped, not read). ValueError or FileNotFoundError naming the file otherwise."""
        if PUBLIC_KINDS[self.kind].layout != "npy":
            return
        h, w, c = (int(x) for x in image_shape)
        lpath = self.root / "labels.npy"
        if not lpath.is_file():
            raise FileNotFoundError(f"{lpath}: not found")
        try:
            labels = np.load(lpath)
        except ValueError as err:
            raise ValueError(f"{lpath}: not a valid .npy file ({err})") from None
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{lpath}: labels must be integers, got {labels.dtype}")
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(
                f"{lpath}: labels {labels.min()}..{labels.max()} outside the dataset's 0..{num_classes - 1}"
            )
        for name in corruptions:
            path = self.root / f"{name}.npy"
            try:
                images = np.load(path, mmap_mode="r")
            except (ValueError, OSError) as err:
                raise ValueError(f"{path}: not a valid .npy file ({first_line(err, 120)})") from None
            shape = list(images.shape) + ([1] if images.ndim == 3 else [])
            if images.dtype != np.uint8 or len(shape) != 4 or shape[1:] != [h, w, c]:
                raise ValueError(f"{path}: {images.dtype} {list(images.shape)}; the clean test images are uint8 "
                                 f"[N, {h}, {w}, {c}] (channels last)")  # fmt: skip
            if len(images) != labels.size:
                raise ValueError(f"{path}: {len(images)} images, {lpath.name} {labels.size} labels")

    def load(self, corruption: str, severity: int) -> StoredSet:
        if (corruption, severity) not in self.available:
            raise FileNotFoundError(f"{self.root}: the published set has no {corruption} severity {severity}")
        if PUBLIC_KINDS[self.kind].layout == "npy":
            images, labels = read_cifar_c(self.root, corruption, severity)
            images, labels = np.ascontiguousarray(images[self.positions]), labels[self.positions]
        else:
            ds = read_imagenet_c(self.root, corruption, severity)
            items = [ds[int(i)] for i in self.positions]
            images = np.stack([x for x, _ in items])
            labels = np.array([y for _, y in items], dtype=np.int64)
        meta = {"meaningful": True, "source": self.kind, "root": str(self.root)}
        return StoredSet(images, labels, self.positions.copy(), meta)
