"""Stage `corrupt`: corrupted copies of the test set, one Parquet file per corruption x severity.

    python -m stages.corrupt [--params params.yaml] [-S robustness.n_images=500]

Reads the test split of ``data.dir`` (under ``data.val_from: test_half`` its test half only,
`core.data.splits.half_split`: the validation half is never corrupted, and a set's ``index`` is then the
image's position in the test half, as in the clean test split evaluate reads), keeps ``robustness.n_images``
images (capped at ``data.limit.test``, `Params.corrupted_images`) chosen class-stratified (classes take turns
in index order, see ``core.robustness.corruptions.select_indices``; deterministic, and growing n keeps the
images already chosen: a capped test split's sets are the full split's first ones) and writes, under
``robustness.dir``:

- ``<corruption>/<severity>.parquet`` for every ``robustness.corruptions`` x ``robustness.severities``
  (columns index, label, image; metadata: band, seed, code version, source fingerprint, meaningful flag);
- ``clean.parquet``: the chosen clean images (same layout, severity 0);
- ``index.json``: what was generated (band, selection, per-set file and sha256, sets excluded from
  summaries) and from which test images (``test_split``: the whole split or its test half);
- ``contact_sheet.png``: three test images across all corruptions and severities.

Image i is seeded by (seed, corruption, severity, its index: in the test split, or in its test half), so the
files are byte-identical across runs, machines with the same libraries, and worker counts. A set already present
with matching metadata (and a readable footer) is kept, so re-runs and Ray trials only fill in what is
missing; every write is atomic. Work runs in parallel over all cores (``robustness.workers`` when that key
exists; 0 = all), with a progress bar.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from core.config import Params
from core.data import manifest_fingerprint
from core.robustness import corruption_build as B
from core.robustness import corruptions as C
from core.utils.atomic import atomic_write_json
from stages.harness.identity import key, stage_identity
from stages.harness.runner import StageError, stage_main

CONTACT_SHEET = "contact_sheet.png"
INDEX = C.INDEX


def _load_test(params: Params, data_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The test split's images and labels (its test half under ``data.val_from: test_half``:
    `core.data.splits.positions_of_test`), and the manifest they come from."""
    from core.data import DataError, load_split, positions_of_test, read_manifest

    try:
        manifest = read_manifest(data_dir)
        images, labels = load_split(data_dir, "test", image_size=_decode_size(params, manifest))
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(f"data.dir: {err}") from None
    keep = positions_of_test(labels, val_from=params.data.val_from)  # capped by n_images (corrupted_images)
    return (images, labels, manifest) if keep is None else (images[keep], labels[keep], manifest)


def source_record(params: Params, data_dir: Path) -> dict[str, Any]:
    """``index.json``'s ``test_split``: which test images the sets are drawn from (the whole split, or its test
    half under ``data.val_from: test_half``; core.data.role_of_test, from the labels alone) and what a set's
    ``index`` counts."""
    from core.data import load_labels, role_of_test

    role = role_of_test(load_labels(data_dir, "test"), val_from=params.data.val_from)
    half = params.data.val_from == "test_half"
    return {**role, "index": "position in the test half" if half else "index in the test split"}


def _decode_size(params: Params, manifest: dict[str, Any]) -> int | None:
    """The size encoded images are decoded at (data.image_size); None for stored arrays."""
    return None if manifest.get("image_shape") else params.data.image_size


def identity(params: Params, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the corrupted sets depend on (`stages.harness.identity`): the test split's content (``manifest``), which
    images are chosen (n_images, the selection), the seed, the decode size of encoded images, and the
    corruption algorithms' version (``core.robustness.corruptions.CORRUPTION_VERSION``). That version stands
    for the code, not the stage's files: the sets take minutes, and an edit of the contact sheet or of
    this module must not regenerate them. Which corruptions and severities are asked for is not part of it:
    each stored set names its own, and a set is kept when its metadata and this identity's key match."""
    parts = {"seed": params.cnn_seed, "n_images": params.corrupted_images(), "selection": B.SELECTION,
             "decode_size": _decode_size(params, manifest)}  # fmt: skip
    if params.data.val_from != "train":  # the test half (the sets of the whole split keep their identity)
        parts["test_split"] = params.data.val_from
    inputs = {"data": manifest_fingerprint(manifest)}
    code = f"corruptions-v{C.CORRUPTION_VERSION}"
    return stage_identity("corrupt", parts, inputs=inputs, code=code)


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run is opened: the prepared test split exists and holds ``robustness.n_images`` images (its
    test half under ``data.val_from: test_half``; only its labels are read)."""
    from core.data import DataError, half_split, load_labels, read_manifest

    data_dir = root / params.data.dir
    half = params.data.val_from == "test_half"
    try:
        n = int(read_manifest(data_dir)["splits"]["test"]["num_rows"])
        if half:
            n = len(half_split(load_labels(data_dir, "test"))[1])
    except (DataError, FileNotFoundError, ValueError, KeyError) as err:
        raise StageError(f"data.dir: {err} (run the prepare stage)") from None
    if params.corrupted_images() > n:
        what = "test-half images (data.val_from: test_half)" if half else "test images"
        raise StageError(
            f"robustness.n_images: {params.corrupted_images()} exceeds the {n} {what} of {data_dir}"
        )


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Generate the missing corrupted sets ([Hendrycks19]'s corruptions, `core.robustness.corruption_build`);
    returns counts and timing (``seconds``: generating the sets, ``wall_s``: the whole run)."""
    t_start = time.perf_counter()
    rb = params.robustness
    data_dir = Path(root) / params.data.dir
    out_dir = Path(root) / rb.dir
    images, labels, manifest = _load_test(params, data_dir)
    n_images = params.corrupted_images()
    if n_images < rb.n_images:
        print(f"corrupt: {n_images} images per set (robustness.n_images {rb.n_images}, capped at "
              f"data.limit.test)", file=sys.stderr)  # fmt: skip
    try:
        B.check_test_split(images, n_images, data_dir)
    except ValueError as err:
        raise StageError(str(err)) from None
    sel = B.select(images, labels, n_images, seed=params.cnn_seed, ident=key(identity(params, manifest)))
    pairs = [(c, s) for c in rb.corruptions for s in rb.severities]
    todo = [(c, s) for c, s in pairs if not C.set_is_valid(C.set_path(out_dir, c, s), sel.expected(c, s))]
    t0 = time.perf_counter()
    picks = B.sheet_picks(sel.labels)
    shown = B.write_sets(sel, out_dir, pairs, todo, picks, seed=params.cnn_seed, workers=rb.workers)
    seconds = time.perf_counter() - t0
    _write_contact_sheet(params, sel, out_dir, pairs, todo, picks, shown)
    index = {
        **B.index(sel, out_dir, pairs, data_dir=params.data.dir),
        "test_split": source_record(params, data_dir),
    }
    atomic_write_json(out_dir / INDEX, index, indent=1)
    result = {
        "n_images": len(sel.images),
        "n_sets": len(pairs),
        "generated": len(todo),
        "skipped": len(pairs) - len(todo),
        "seconds": round(seconds, 2),
        "band": sel.band,
        "wall_s": round(time.perf_counter() - t_start, 3),
    }
    print(
        f"corrupt: generated {len(todo)}, kept {len(pairs) - len(todo)} sets in {seconds:.1f} s",
        file=sys.stderr,
    )
    return result


def _write_contact_sheet(
    params: Params, sel: B.Selection, out_dir: Path, pairs: list[tuple[str, int]], todo: list[tuple[str, int]],
    picks: list[int], shown: dict[tuple[str, int], np.ndarray],
) -> None:  # fmt: skip
    """Redraw ``contact_sheet.png`` when a set was generated or the sheet is missing (the sets kept are read
    back for it: `core.robustness.corruption_build.sheet_panels`)."""
    sheet = out_dir / CONTACT_SHEET
    if todo or not sheet.is_file():
        from core.viz.plots import contact_sheet

        shown_idx = [int(sel.idx[p]) for p in picks]
        contact_sheet(
            sel.images[picks], B.sheet_panels(out_dir, pairs, picks, shown), sheet,
            title=f"{params.data.name} test images {shown_idx}, {sel.band} band constants",
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return stage_main("corrupt", run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
