"""Stage `corrupt`: corrupted copies of the test set, one Parquet file per corruption x severity.

    python -m stages.corrupt [--params params.yaml] [-S robustness.n_images=500]

Reads the test split of ``data.dir``, keeps ``robustness.n_images`` images (capped at ``data.limit.test``,
`Params.corrupted_images`) chosen class-stratified (classes take turns in index order, see
``core.robustness.corruptions.select_indices``; deterministic, and growing n keeps the images already chosen:
a capped test split's sets are the full split's first ones) and writes, under ``robustness.dir``:

- ``<corruption>/<severity>.parquet`` for every ``robustness.corruptions`` x ``robustness.severities``
  (columns index, label, image; metadata: band, seed, code version, source fingerprint, meaningful flag);
- ``clean.parquet``: the chosen clean images (same layout, severity 0);
- ``index.json``: what was generated (band, selection, per-set file and sha256, sets excluded from
  summaries);
- ``contact_sheet.png``: three test images across all corruptions and severities.

Image i is seeded by (seed, corruption, severity, its index in the test split), so the files are
byte-identical across runs, machines with the same libraries, and worker counts. A set already present
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
    """The test split's images and labels, and the manifest they come from."""
    from core.data import DataError, load_split, read_manifest

    try:
        manifest = read_manifest(data_dir)
        images, labels = load_split(data_dir, "test", image_size=_decode_size(params, manifest))
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(f"data.dir: {err}") from None
    return images, labels, manifest


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
    inputs = {"data": manifest_fingerprint(manifest)}
    code = f"corruptions-v{C.CORRUPTION_VERSION}"
    return stage_identity("corrupt", parts, inputs=inputs, code=code)


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run is opened: the prepared test split exists and holds ``robustness.n_images`` images."""
    from core.data import DataError, read_manifest

    data_dir = root / params.data.dir
    try:
        n = int(read_manifest(data_dir)["splits"]["test"]["num_rows"])
    except (DataError, FileNotFoundError, ValueError, KeyError) as err:
        raise StageError(f"data.dir: {err} (run the prepare stage)") from None
    if params.corrupted_images() > n:
        raise StageError(
            f"robustness.n_images: {params.corrupted_images()} exceeds the {n} test images of {data_dir}"
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
    atomic_write_json(out_dir / INDEX, B.index(sel, out_dir, pairs, data_dir=params.data.dir), indent=1)
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
