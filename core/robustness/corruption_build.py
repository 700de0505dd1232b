"""The stored corrupted test sets of one test split ([Hendrycks19], CIFAR-10-C style), built and described: the
chosen clean images and what every set made from them records (`check_test_split`, `select`), the missing sets written in parallel
(`write_sets`), the contact sheet's images (`sheet_picks`, `sheet_panels`) and ``index.json`` (`index`).

The corrupt stage decides which sets are missing and draws the contact sheet; the corruptions, their seeds and
the Parquet store are `core.robustness.corruptions`'. A set is written atomically with its metadata, so a set
whose metadata matches (`Selection.expected`) is kept and an interrupted build only fills in what is missing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.robustness import corruptions as C
from core.utils.hashing import file_digest

__all__ = [
    "SELECTION",
    "Selection",
    "check_test_split",
    "index",
    "select",
    "sheet_panels",
    "sheet_picks",
    "write_sets",
]

SELECTION = "stratified"  # classes take turns in index order (`core.robustness.corruptions.select_indices`)


def check_test_split(images: np.ndarray, n_images: int, data_dir: Path) -> None:
    """The loaded test split of ``data_dir`` is not empty, holds ``n_images`` images and is large enough to
    corrupt; ValueError if not."""
    if len(images) == 0:
        raise ValueError(f"data.dir: {data_dir} has an empty test split")
    if n_images > len(images):
        raise ValueError(
            f"robustness.n_images: {n_images} exceeds the {len(images)} test images of {data_dir}"
        )
    if min(images.shape[1:3]) < 8:
        raise ValueError(
            f"data.dir: test images of {list(images.shape[1:3])} px are too small to corrupt (< 8)"
        )


def sheet_picks(labels: np.ndarray, k: int = 3) -> list[int]:
    """The first image of each of the first `k` classes met in index order."""
    picks: list[int] = []
    for i, y in enumerate(labels.tolist()):
        if all(labels[j] != y for j in picks):
            picks.append(i)
        if len(picks) == k:
            break
    return picks


@dataclass(frozen=True)
class Selection:
    """The chosen test images (``idx``: their indices in the test split) and what every set made from them
    records: the band, the source fingerprint, the ``common`` metadata and the identity key."""

    images: np.ndarray
    labels: np.ndarray
    idx: np.ndarray
    band: str
    source: str
    common: dict[str, Any]
    ident: str

    def expected(self, c: str, s: int) -> dict[str, Any]:
        """The metadata set ``c`` at severity ``s`` must carry to be kept."""
        return {**C.set_meta(c, s, source=self.source, **self.common), "identity": self.ident}


def select(images: np.ndarray, labels: np.ndarray, n_images: int, *, seed: int, ident: str) -> Selection:
    """The ``n_images`` class-stratified test images (`core.robustness.corruptions.select_indices`) and the
    metadata their sets carry (``seed``: the corruptions' seed; ``ident``: the corrupt stage's identity key)."""
    idx = C.select_indices(labels, n_images, SELECTION)
    images, labels = np.ascontiguousarray(images[idx]), labels[idx]
    band = C.band_for_size(*images.shape[1:3])
    source = C.fingerprint(images, labels, idx)
    common = {"seed": seed, "band": band, "image_shape": list(images.shape[1:]), "n": len(images)}
    return Selection(images, labels, idx, band, source, common, ident)


def write_sets(
    sel: Selection, out_dir: Path, pairs: list[tuple[str, int]], todo: list[tuple[str, int]], picks: list[int],
    *, seed: int, workers: int,
) -> dict[tuple[str, int], np.ndarray]:  # fmt: skip
    """Write the clean set when it is not up to date and every set of ``todo``, in parallel over ``workers``
    (0 = all cores); returns the contact sheet's images (``picks``) of each generated set."""
    if not C.set_is_valid(C.set_path(out_dir, "clean", 0), sel.expected("clean", 0)):
        C.write_set(
            C.set_path(out_dir, "clean", 0), sel.images, sel.labels, sel.idx, sel.expected("clean", 0)
        )
    workers = workers or C.default_workers()
    chunk = max(50, min(1000, -(-len(sel.images) // (4 * workers))))
    print(
        f"corrupt: {len(pairs)} sets of {len(sel.images)} images ({sel.band} band, {SELECTION} selection) -> "
        f"{out_dir}: {len(pairs) - len(todo)} up to date, {len(todo)} to generate on {workers} workers",
        file=sys.stderr,
    )
    shown: dict[tuple[str, int], np.ndarray] = {}
    for c, s, out in C.iter_sets(
        sel.images,
        todo,
        seed=seed,
        indices=sel.idx,
        band=sel.band,
        workers=workers,
        chunk_size=chunk,
        progress=True,
    ):
        C.write_set(C.set_path(out_dir, c, s), out, sel.labels, sel.idx, sel.expected(c, s))
        shown[(c, s)] = out[picks]
    return shown


def sheet_panels(
    out_dir: Path, pairs: list[tuple[str, int]], picks: list[int], shown: dict[tuple[str, int], np.ndarray]
) -> dict[tuple[str, int], np.ndarray]:
    """The contact sheet's images of every set of ``pairs``: ``shown`` (the sets just generated, filled in
    place) and the sets kept, read back."""
    for c, s in pairs:
        if (c, s) not in shown:
            shown[(c, s)] = C.read_set(C.set_path(out_dir, c, s)).images[picks]
    return shown


def index(sel: Selection, out_dir: Path, pairs: list[tuple[str, int]], *, data_dir: Path) -> dict[str, Any]:
    """``index.json``: what was generated from the test split of ``data_dir`` (band, selection, per-set file and
    sha256, the sets excluded from summaries)."""
    channels = sel.images.shape[3]
    return {
        "version": C.CORRUPTION_VERSION,
        "data_dir": str(data_dir),
        "selection": SELECTION,
        "source": sel.source,
        "identity": sel.ident,
        "excluded_from_summaries": sorted({c for c, _ in pairs if not C.is_meaningful(c, channels)}),
        "grayscale": channels == 1,
        **sel.common,
        "sets": [
            {
                "corruption": c,
                "severity": s,
                "category": C.CATEGORY_OF[c],
                "meaningful": C.is_meaningful(c, channels),
                "file": str(C.set_path(Path("."), c, s)),
                "sha256": file_digest(C.set_path(out_dir, c, s)),
            }
            for c, s in pairs
        ],
    }
