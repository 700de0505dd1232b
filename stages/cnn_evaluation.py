"""The pretrained CNN's evaluation, shared by identity as its pretraining is (issue 36).

Every trial of a sweep that shares one pretraining evaluates the same CNN (the group's ``cnn-final.pt``) on
the same test split and corrupted sets. With a store (the evaluate stage's ``shared`` argument: a sweep's
``<sweep.storage>/cnn_evaluation``; the DVC path has none and evaluates the CNN itself) the first trial to
need it evaluates it under the lock of ``<store>/<key>/`` (core.utils.locks) and stores it there; the others
wait on that lock, then read it. The key names :func:`identity`.

``<store>/<key>/``: ``robustness.parquet`` and ``per_image.parquet`` (the CNN's rows of evaluate's two tables,
the generated suite), and ``record.json``, written last: the identity, each file's sha256 (verified on every
read: a damaged store is said in one line and evaluated again), the check and how long the evaluation took.

The check: a trial that reads the store evaluates the T-CNN and the control in another process than the one
that evaluated the CNN. It predicts the first clean test images (:func:`check_size`: whole evaluation batches)
with the CNN exactly as it would evaluate it and compares them with the stored predictions; on any difference
it says so, evaluates the CNN itself, and its note records why (``source: recomputed``).

A published benchmark (robustness.public) has no checksums to key an identity on cheaply: the CNN's
evaluation on it stays in each trial.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.config import Params
from core.data import manifest_fingerprint
from core.robustness.corruptions import INDEX, content_digest, set_path
from core.utils.atomic import atomic_write_json, atomic_write_parquet
from core.utils.hashing import file_digest, stable_hash
from core.utils.locks import locked, say
from core.utils.machine import cpu_model
from stages.harness.identity import code_digest, key, stage_identity

DIR = "cnn_evaluation"  # the store's directory under sweep.storage (and the cost.csv row of its work)
SUITE = "generated"  # the suite that is shared: the corrupt stage's sets (core.robustness.bench.Suite)
TABLES = ("robustness.parquet", "per_image.parquet")  # evaluate's (counts, per-image) tables, in that order
RECORD = "record.json"
CHECK_IMAGES = 256  # at least this many clean test images are predicted again where the store is read
PRECISION = "float32"  # evaluate runs every model in float32 (no autocast)

Tables = tuple[Any, Any]  # (counts, per-image) pyarrow tables


def identity(
    params: Params, root: Path, cnn: Path, manifest: dict[str, Any], norm: dict[str, Any], device: str
) -> dict[str, Any]:
    """What the CNN's evaluation on the generated sets depends on (`stages.harness.identity`): the checkpoint's bytes
    (its sha256: the same pretraining or import read anywhere), the test split's content (its manifest), the
    corrupted sets (the corrupt stage's identity and each set's sha256), which corruptions and severities in
    which order, the cap on the clean test split (``data.limit.test``, when set), its half (``data.val_from``,
    when not "train"), the resolution, the normalization, the batch size, the precision, the device kind, the
    size of the check, and the evaluate stage's code."""
    rob = params.robustness
    parts = {"model": "cnn", "suite": SUITE, "corruptions": list(rob.corruptions),
             "severities": [int(s) for s in rob.severities], "image_size": params.test_image_size(),
             "normalization": {k: np.atleast_1d(norm[k]).astype(float).tolist() for k in ("mean", "std")},
             "batch_size": rob.batch_size, "precision": PRECISION, "check_images": CHECK_IMAGES}  # fmt: skip
    inputs = {"cnn": file_digest(cnn), "test": manifest_fingerprint(manifest),
              "corrupted": sets_identity(root / rob.dir, rob.corruptions, rob.severities)}  # fmt: skip
    if params.data.limit is not None and params.data.limit.test is not None:  # a capped clean test split
        parts["test_limit"] = params.data.limit.test
    if params.data.val_from != "train":  # the clean test split is the test half
        parts["test_split"] = params.data.val_from
    return stage_identity(
        f"evaluate-{DIR}", parts, inputs=inputs, device=device, code=code_digest("evaluate")
    )


def sets_identity(directory: Path, corruptions: Sequence[str], severities: Sequence[int]) -> dict[str, Any]:
    """The corrupted sets evaluated: the corrupt stage's identity key and the hash of every set's sha256 (as
    its index lists it; hashed here where the index lacks it)."""
    try:
        index = json.loads((directory / INDEX).read_text())
    except (OSError, ValueError):
        index = {}
    listed = {(s["corruption"], int(s["severity"])): s["sha256"] for s in index.get("sets", [])}
    digests = {f"{c}/{s}": listed.get((c, int(s))) or file_digest(set_path(directory, c, s))
               for c in corruptions for s in severities}  # fmt: skip
    return {"identity": index.get("identity"), "sets": stable_hash(digests)}


def check_size(n_images: int, batch_size: int) -> int:
    """How many of the first clean test images the check predicts: whole batches of the evaluation (the same
    images in the same batches), at least :data:`CHECK_IMAGES`, at most the split."""
    return min(n_images, -(-CHECK_IMAGES // batch_size) * batch_size)


def check_record(images: np.ndarray, labels: np.ndarray, predicted: np.ndarray) -> dict[str, Any]:
    """What the check compares: the images' and labels' sha256 and the CNN's predicted classes."""
    return {"images": len(images), "sha256": content_digest(images, labels, np.arange(len(images))),
            "predictions": [int(p) for p in predicted]}  # fmt: skip


def differs(stored: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why the stored evaluation is not this process's (None: the check agrees)."""
    if (stored.get("images"), stored.get("sha256")) != (mine["images"], mine["sha256"]):
        return f"was made on other test images than this process's first {mine['images']}"
    wrong = sum(a != b for a, b in zip(stored.get("predictions", []), mine["predictions"], strict=True))
    if wrong:
        return (
            f"predicts {wrong} of the first {mine['images']} clean test images differently from this process"
        )
    return None


def verified(
    directory: Path, ident: dict[str, Any]
) -> tuple[tuple[Tables, dict[str, Any]] | None, str | None]:
    """(the stored tables and record, None) when ``directory`` holds a complete evaluation of ``ident`` whose
    files match their recorded sha256; (None, why) when it holds a damaged one; (None, None) when none."""
    import pyarrow.parquet as pq

    from core.robustness.eval_table import PER_IMAGE_SCHEMA, TABLE_SCHEMA

    path = directory / RECORD
    if not path.is_file():
        return None, None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"{path}: unreadable ({type(err).__name__})"
    if record.get("identity") != ident:
        return None, f"{path}: written for another identity"
    for name in TABLES:
        f = directory / name
        if not f.is_file() or file_digest(f) != record.get("files", {}).get(name):
            return None, f"{f}: checksum mismatch, the file is damaged"
    tables = tuple(
        pq.read_table(directory / n).cast(s) for n, s in zip(TABLES, (TABLE_SCHEMA, PER_IMAGE_SCHEMA))
    )
    return (tables, record), None  # type: ignore[return-value]


def store(
    directory: Path, ident: dict[str, Any], tables: Tables, check: dict[str, Any], seconds: float
) -> None:
    """Write the evaluation into ``directory``: the tables, then the record (a reader trusts only a record)."""
    (directory / RECORD).unlink(missing_ok=True)
    for name, table in zip(TABLES, tables, strict=True):
        atomic_write_parquet(directory / name, table)
    files = {name: file_digest(directory / name) for name in TABLES}
    record = {"identity": ident, "files": files, "check": check, "seconds": round(seconds, 3),
              "finished": time.time(), "cpu": cpu_model()}  # fmt: skip
    atomic_write_json(directory / RECORD, record)


def shared(
    where: Path, ident: dict[str, Any], *, compute: Callable[[], Tables], check: Callable[[], dict[str, Any]]
) -> tuple[Tables, dict[str, Any]]:
    """The CNN's evaluation from the store ``where`` (``compute`` it and store it when it is not there or is
    damaged), and how this process had it: ``{"key", "source": computed | shared | recomputed, "seconds"
    (spent evaluating the CNN here), "reason" (recomputed: what the check found; computed over a damaged
    store: what was wrong with it)}``. ``check``: this process's :func:`check_record`."""
    k = key(ident)
    directory = where / k
    with locked(directory, f"evaluate: the CNN's evaluation {k}"):
        found, problem = verified(directory, ident)
        if found is None:
            if problem:
                say(None, f"evaluate: {problem}; evaluating the CNN again")
            tables, seconds = timed(compute)
            store(directory, ident, tables, check(), seconds)
            note = {"key": k, "source": "computed", "seconds": round(seconds, 3)}
            return tables, {**note, "reason": problem} if problem else note  # why a stored one was replaced
    tables, record = found
    why = differs(record.get("check", {}), check())
    if why is None:
        return tables, {"key": k, "source": "shared", "seconds": 0.0}
    say(None, f"evaluate: the CNN's shared evaluation {directory} {why}; evaluating the CNN in this process")
    tables, seconds = timed(compute)
    return tables, {"key": k, "source": "recomputed", "seconds": round(seconds, 3), "reason": why}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
