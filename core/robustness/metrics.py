"""Robustness evaluation: accuracy on clean and corrupted sets, and the corruption-error metrics.

Metrics (Hendrycks & Dietterich 2019, "Benchmarking neural network robustness to common corruptions";
used by [TCNN21] Table 2 and Fig. 3). With E(f, s, c) the top-1 error of model f on corruption c at severity s:

- corruption error        CE(f, c)  = sum_s E(f, s, c) / sum_s E(base, s, c)
- mean corruption error   mCE(f)    = mean over the 15 benchmark corruptions of CE(f, c)  (mean of ratios)
- relative CE             rCE(f, c) = sum_s (E(f, s, c) - E(f, clean)) / sum_s (E(base, s, c) - E(base, clean))
- relative mCE                      = mean over the 15 of rCE(f, c)
- mean corruption accuracy mCA(f)   = mean over the 15 x 5 cells of 1 - E(f, s, c)  (unnormalised; [TCNN21] Table 2
  reports this as "ImageNet-C top-1")

Also reported: per category (mean of the category's CEs; mean accuracy over its cells), per severity
(mCE_s = mean over the 15 of E(f, s, c) / E(base, s, c); mean accuracy over the 15 at that severity), and
the 4 extra corruptions separately (never inside mCE). Sums run over the severities evaluated (all 5 by
default). A cell flagged not meaningful (saturate on grayscale data, see core.robustness.corruptions) is left out of
every number and listed under ``excluded``.

The baseline is AlexNet on ImageNet-C (:meth:`Baseline.alexnet`, per-severity errors embedded below, equal
to ``reference/alexnet_imagenet_c_errors.json``) or, on any other data set, a frozen baseline of the project:
its 19 x 5 errors and clean error from an :func:`evaluate_model` table (:meth:`Baseline.from_table`), stored
with :meth:`Baseline.save`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from core.robustness.corruptions import (
    BENCHMARK_CORRUPTIONS,
    CATEGORIES,
    CATEGORY_OF,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
    StoredSet,
    read_set,
    set_path,
)
from core.robustness.intervals import bootstrap, difference
from core.utils.atomic import atomic_write_json

#: Columns of an evaluation table (one row per model x corruption x severity; the clean row has corruption
#: "clean", category "clean", severity 0).
TABLE_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("corruption", pa.string()),
        ("category", pa.string()),
        ("severity", pa.int64()),
        ("n", pa.int64()),
        ("correct", pa.int64()),
        ("accuracy", pa.float64()),
        ("error", pa.float64()),
        ("meaningful", pa.bool_()),
    ]
)

# AlexNet top-1 error on ImageNet-C per severity 1..5 (hendrycks/robustness; the per-corruption means are the
# usual CE normalisers) and on clean ImageNet validation.
_ALEXNET_CLEAN = 0.4348
_ALEXNET = {
    "gaussian_noise": (0.69528, 0.82542, 0.93554, 0.98138, 0.99452),
    "shot_noise": (0.71224, 0.85108, 0.93574, 0.98182, 0.99146),
    "impulse_noise": (0.78374, 0.89808, 0.9487, 0.9872, 0.99548),
    "defocus_blur": (0.65624, 0.73202, 0.85036, 0.91364, 0.94714),
    "glass_blur": (0.64308, 0.75054, 0.88806, 0.91622, 0.93344),
    "motion_blur": (0.5843, 0.70048, 0.82108, 0.8975, 0.92638),
    "zoom_blur": (0.70008, 0.76992, 0.80784, 0.84198, 0.87198),
    "snow": (0.71726, 0.88392, 0.86468, 0.9187, 0.94952),
    "frost": (0.6139, 0.79734, 0.8879, 0.89942, 0.9343),
    "fog": (0.67474, 0.7605, 0.84378, 0.8726, 0.945),
    "brightness": (0.4514, 0.48502, 0.54048, 0.62166, 0.7244),
    "contrast": (0.64548, 0.7615, 0.88874, 0.9776, 0.9927),
    "elastic_transform": (0.52596, 0.70116, 0.55686, 0.64076, 0.80554),
    "pixelate": (0.52218, 0.5462, 0.73728, 0.87092, 0.91262),
    "jpeg_compression": (0.51002, 0.54718, 0.57294, 0.65458, 0.74778),
}


# ----------------------------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """Errors of the normalising model: ``errors[corruption][severity]`` and the clean error."""

    name: str
    clean_error: float
    errors: Mapping[str, Mapping[int, float]] = field(default_factory=dict)

    @classmethod
    def alexnet(cls) -> Baseline:
        """AlexNet on ImageNet-C (the 15 benchmark corruptions; no trusted per-severity extras exist)."""
        return cls(
            "alexnet",
            _ALEXNET_CLEAN,
            {c: {s + 1: e for s, e in enumerate(v)} for c, v in _ALEXNET.items()},
        )

    @classmethod
    def from_table(cls, table: pa.Table, model: str | None = None, name: str | None = None) -> Baseline:
        """A frozen baseline from an :func:`evaluate_model` table (all its corruptions and severities)."""
        rows = _rows(table, model)
        clean = [r for r in rows if r["corruption"] == "clean"]
        if not clean:
            raise ValueError("Baseline.from_table: the table has no clean row")
        errors: dict[str, dict[int, float]] = {}
        for r in rows:
            if r["corruption"] != "clean":
                errors.setdefault(r["corruption"], {})[int(r["severity"])] = float(r["error"])
        return cls(name or rows[0]["model"], float(clean[0]["error"]), errors)

    def to_dict(self) -> dict[str, Any]:
        """The reference JSON layout: ``{"name", "clean", "per_severity": {corruption: [e1, .., e5]}}``
        (missing severities as null)."""
        per = {
            c: [self.errors[c].get(s) for s in range(1, 6)] for c in CORRUPTIONS if c in self.errors
        }  # fmt: skip
        return {"name": self.name, "clean": self.clean_error, "per_severity": per}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> Baseline:
        try:
            per = d["per_severity"]
            errors = {
                c: {s + 1: float(e) for s, e in enumerate(v) if e is not None} for c, v in per.items()
            }  # fmt: skip
            return cls(name or str(d.get("name", "baseline")), float(d["clean"]), errors)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"baseline: expected {{'clean', 'per_severity'}}, got {err!r}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON, atomically."""
        return atomic_write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Baseline:
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()), name=None)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: baseline file not found") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None


def _as_baseline(baseline: Any) -> Baseline | None:
    if baseline is None or isinstance(baseline, Baseline):
        return baseline
    if isinstance(baseline, str):
        if baseline == "alexnet":
            return Baseline.alexnet()
        return Baseline.load(baseline)
    if isinstance(baseline, os.PathLike):
        return Baseline.load(baseline)
    if isinstance(baseline, pa.Table):
        return Baseline.from_table(baseline)
    if isinstance(baseline, Mapping):
        return Baseline.from_dict(baseline)
    raise TypeError(
        f"baseline: expected Baseline, 'alexnet', a path, a table or a dict, got {type(baseline)}"
    )


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


def _normaliser(mean: Sequence[float], std: Sequence[float], channels: int, device: torch.device) -> tuple:
    m = torch.as_tensor(list(mean), dtype=torch.float32, device=device).reshape(1, -1, 1, 1)
    s = torch.as_tensor(list(std), dtype=torch.float32, device=device).reshape(1, -1, 1, 1)
    if m.shape[1] not in (1, channels) or s.shape[1] not in (1, channels):
        raise ValueError(f"mean/std have {m.shape[1]}/{s.shape[1]} entries for {channels}-channel images")
    return m, s


def _predicted(
    model: torch.nn.Module,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    mean: Sequence[float],
    std: Sequence[float],
    device: str | torch.device = "cpu",
    image_size: int | None = None,
    class_subset: Sequence[int] | np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """(top-1 predicted classes on `device`, labels) of each batch: the one forward pass of this module."""
    device = torch.device(device)
    model.eval()
    subset = None
    if class_subset is not None:
        subset = torch.as_tensor(np.asarray(class_subset, dtype=np.int64), device=device)
    norm = None
    for images, labels in batches:
        images = np.asarray(images)
        if images.ndim == 3:
            images = images[..., None]
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # memory-mapped / Arrow-backed arrays
            images = images.copy()
        x = torch.from_numpy(images).to(device)
        x = x.permute(0, 3, 1, 2).float().div_(255.0)
        if norm is None:
            norm = _normaliser(mean, std, x.shape[1], device)
        x = (x - norm[0]) / norm[1]
        if image_size is not None and tuple(x.shape[-2:]) != (image_size, image_size):
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        logits = model(x)
        if subset is not None:
            yield subset[logits.index_select(1, subset).argmax(1)], np.asarray(labels, dtype=np.int64)
        else:
            yield logits.argmax(1), np.asarray(labels, dtype=np.int64)


@torch.inference_mode()
def correct_per_image(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **options: Any
) -> np.ndarray:
    """Top-1 correctness (bool [N], in batch order) of `model` on batches of (uint8 images [B, H, W, C],
    int labels [B]).

    Images are scaled to [0, 1], normalised with the per-channel `mean`/`std` and, when `image_size` is
    given and differs, resized (bilinear). With `class_subset` (indices into the model's classes, e.g. the
    200 ImageNet-A classes in the 1000-class head) the prediction is the best class of the subset, as in
    the ImageNet-A/R evaluation; labels are then in the model's full class space.
    """
    out = [(pred == torch.as_tensor(y, device=pred.device)).cpu().numpy()
           for pred, y in _predicted(model, batches, **options)]  # fmt: skip
    return np.concatenate(out) if out else np.zeros(0, dtype=bool)


@torch.inference_mode()
def predictions(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **options: Any
) -> np.ndarray:
    """The top-1 predicted class (int64 [N], in batch order) of `model` on the batches, computed exactly as
    :func:`correct_per_image` computes correctness (the same options)."""
    out = [pred.cpu().numpy() for pred, _ in _predicted(model, batches, **options)]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def count_correct(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **kwargs: Any
) -> tuple[int, int]:
    """(top-1 correct, images) of `model` over the batches (see :func:`correct_per_image` for the options)."""
    correct = correct_per_image(model, batches, **kwargs)
    return int(correct.sum()), len(correct)


def array_batches(
    images: np.ndarray, labels: np.ndarray, batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(images, labels) in consecutive batches of ``batch_size``: how the evaluation feeds a set."""
    for a in range(0, len(images), batch_size):
        yield images[a : a + batch_size], labels[a : a + batch_size]


def evaluate_model(
    model: torch.nn.Module,
    clean: tuple[np.ndarray, np.ndarray],
    corrupted_dir: str | os.PathLike | Callable[[str, int], StoredSet],
    corruptions: Sequence[str],
    severities: Sequence[int],
    *,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 500,
    device: str | torch.device = "cpu",
    model_name: str = "model",
    image_size: int | None = None,
    per_image: bool = False,
    clean_index: np.ndarray | None = None,
) -> pa.Table | tuple[pa.Table, pa.Table]:
    """Top-1 accuracy of `model` on the clean images and on every stored corrupted set.

    `clean` is (uint8 images [N, H, W, C], labels [N]) -- image i has test index i, or ``clean_index[i]`` when
    the clean images are a cap of the split the sets index (``data.limit``; sorted); the sets are read from
    ``<corrupted_dir>/<corruption>/<severity>.parquet`` (written by the corrupt stage), or, when
    `corrupted_dir` is a callable, from ``corrupted_dir(corruption, severity)`` (e.g.
    :meth:`core.robustness.public_sets.PublicSets.load`). Returns a table with
    :data:`TABLE_SCHEMA`: a clean row (corruption "clean", severity 0) then one row per corruption x
    severity, with ``meaningful`` copied from the set (False: saturate on grayscale). Concatenate the tables
    of several models (``pa.concat_tables``) to compare them. With ``per_image``, also the correctness of
    every image (:data:`PER_IMAGE_SCHEMA`, rows keyed by the image's test index), what
    :func:`bootstrap_metrics` resamples.
    """
    images, labels = clean
    if len(images) != len(labels):
        raise ValueError(f"clean: {len(images)} images but {len(labels)} labels")
    opts = {"mean": mean, "std": std, "device": device, "image_size": image_size}
    rows, parts = [], []
    correct = correct_per_image(model, array_batches(images, np.asarray(labels), batch_size), **opts)
    rows.append(_row(model_name, "clean", 0, int(correct.sum()), len(correct), True))
    parts.append(("clean", 0, np.arange(len(correct)), correct))
    for c in corruptions:
        if c not in CATEGORY_OF:
            raise ValueError(f"unknown corruption {c!r}")
        for s in severities:
            stored = (
                corrupted_dir(c, s) if callable(corrupted_dir) else read_set(set_path(corrupted_dir, c, s))
            )
            correct = correct_per_image(
                model, array_batches(stored.images, stored.labels, batch_size), **opts
            )
            meaningful = bool(stored.meta.get("meaningful", True))
            rows.append(_row(model_name, c, int(s), int(correct.sum()), len(correct), meaningful))
            parts.append((c, int(s), _clean_positions(stored.indices, clean_index, c, s), correct))
    table = pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)
    if not per_image:
        return table
    return table, _per_image_table(model_name, parts)


def _clean_positions(indices: np.ndarray, clean_index: np.ndarray | None, c: str, s: int) -> np.ndarray:
    """The positions among the clean images of a set's images (their test indices): the indices themselves,
    or where they sit in ``clean_index``; a corrupted image whose original is not among them is an error (the
    paired bootstrap would pair it with another image)."""
    if clean_index is None:
        return np.asarray(indices)
    pos = np.searchsorted(clean_index, indices)
    inside = pos < len(clean_index)
    if not inside.all() or not np.array_equal(clean_index[pos], indices):
        raise ValueError(f"{c}/{s}: corrupted images whose clean originals are not in the capped test split")
    return pos


#: Per-image correctness: one row per model x set x image; ``index`` is the image's index in the test split
#: (a corrupted image shares it with its clean original).
PER_IMAGE_SCHEMA = pa.schema(
    [
        ("model", pa.dictionary(pa.int8(), pa.string())),
        ("corruption", pa.dictionary(pa.int8(), pa.string())),
        ("severity", pa.int8()),
        ("index", pa.int32()),
        ("correct", pa.bool_()),
    ]
)


def _per_image_table(model: str, parts: list[tuple[str, int, np.ndarray, np.ndarray]]) -> pa.Table:
    n = [len(p[3]) for p in parts]
    columns = {
        "model": pa.array([model] * sum(n)).dictionary_encode(),
        "corruption": pa.array(
            [c for (c, _, _, _), k in zip(parts, n) for _ in range(k)]
        ).dictionary_encode(),
        "severity": np.concatenate([np.full(k, s, np.int8) for (_, s, _, _), k in zip(parts, n)]),
        "index": np.concatenate([np.asarray(i, np.int32) for _, _, i, _ in parts]),
        "correct": np.concatenate([np.asarray(c, bool) for _, _, _, c in parts]),
    }
    return pa.table(columns).cast(PER_IMAGE_SCHEMA)


def _row(
    model: str, corruption: str, severity: int, correct: int, n: int, meaningful: bool
) -> dict[str, Any]:
    acc = correct / n if n else float("nan")
    return {
        "model": model,
        "corruption": corruption,
        "category": "clean" if corruption == "clean" else CATEGORY_OF[corruption],
        "severity": severity,
        "n": n,
        "correct": correct,
        "accuracy": acc,
        "error": 1.0 - acc,
        "meaningful": meaningful,
    }


def table_from_errors(
    model: str, clean_error: float, errors: Mapping[str, Sequence[float] | Mapping[int, float]], n: int = 0
) -> pa.Table:
    """An evaluation table from known errors (``errors[corruption]`` = 5 errors or {severity: error});
    handy for tests and for published numbers."""
    rows = [_row(model, "clean", 0, 0, 0, True) | {"accuracy": 1 - clean_error, "error": clean_error, "n": n}]
    for c, v in errors.items():
        items = v.items() if isinstance(v, Mapping) else enumerate(v, start=1)
        for s, e in items:
            rows.append(_row(model, c, int(s), 0, 0, True) | {"accuracy": 1 - e, "error": float(e), "n": n})
    return pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------


def _rows(table: pa.Table | Iterable[Mapping[str, Any]], model: str | None) -> list[dict[str, Any]]:
    rows = table.to_pylist() if isinstance(table, pa.Table) else [dict(r) for r in table]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if model is None:
        if len(models) != 1:
            raise ValueError(f"the table holds models {models}: name one")
        model = models[0]
    elif model not in models:
        raise ValueError(f"model {model!r} not in the table (has {models})")
    return [r for r in rows if r["model"] == model]


def corruption_error(errors: Sequence[float], base_errors: Sequence[float]) -> float | None:
    """CE = sum_s E(f, s, c) / sum_s E(base, s, c) ([Hendrycks19] Sec. 4); None when the baseline makes no
    error on the corruption (the ratio is then undefined, as a per-severity mCE is)."""
    den = sum(base_errors)
    return float(sum(errors) / den) if den > 0 else None


def relative_corruption_error(
    errors: Sequence[float], clean_error: float, base_errors: Sequence[float], base_clean_error: float
) -> float | None:
    """rCE = sum_s (E(f, s, c) - E(f, clean)) / sum_s (E(base, s, c) - E(base, clean)); None when the
    baseline's degradation is not positive (the ratio is then meaningless)."""
    den = sum(e - base_clean_error for e in base_errors)
    if den <= 0:
        return None
    return float(sum(e - clean_error for e in errors) / den)


def _clean_error(rows: list[dict[str, Any]], name: str) -> float:
    """The error of the model's one clean row."""
    clean = [r for r in rows if r["corruption"] == "clean"]
    if len(clean) != 1:
        raise ValueError(f"model {name!r}: expected one clean row, found {len(clean)}")
    return float(clean[0]["error"])


def _error_cells(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[int, float]], set[str]]:
    """(``cells[corruption][severity]`` = error of every meaningful corrupted row, the corruptions none of whose
    rows is meaningful). A cell flagged not meaningful (saturate on grayscale data) is left out of every number."""
    cells: dict[str, dict[int, float]] = {}
    excluded: set[str] = set()
    for r in rows:
        c = r["corruption"]
        if c == "clean":
            continue
        if not r.get("meaningful", True):
            excluded.add(c)
            continue
        cells.setdefault(c, {})[int(r["severity"])] = float(r["error"])
    excluded -= set(cells)  # only fully excluded corruptions
    return cells, excluded


def _corruption_entry(
    c: str, cells: Mapping[int, float], clean_err: float, base: Baseline | None
) -> dict[str, Any]:
    """One ``per_corruption`` entry: mean accuracy and error over the evaluated severities, CE and relative CE
    (Hendrycks & Dietterich 2019; None unless the baseline has every one of those severities), and the
    accuracy per severity."""
    sev = sorted(cells)
    errs = [cells[s] for s in sev]
    ce = rce = None
    if base is not None and c in base.errors and all(s in base.errors[c] for s in sev):
        b = [base.errors[c][s] for s in sev]
        ce = corruption_error(errs, b)
        rce = relative_corruption_error(errs, clean_err, b, base.clean_error)
    return {
        "category": CATEGORY_OF[c],
        "accuracy": 1.0 - float(np.mean(errs)),
        "error": float(np.mean(errs)),
        "ce": ce,
        "relative_ce": rce,
        "per_severity": {str(s): 1.0 - cells[s] for s in sev},
    }


def _group_mce(per_corruption: Mapping[str, Mapping[str, Any]], cs: list[str], key: str) -> float | None:
    """Mean of the corruptions' `key` ("ce": mCE, "relative_ce": relative mCE): a mean of ratios, None
    unless every one of them has it."""
    vals = [per_corruption[c][key] for c in cs]
    return float(np.mean(vals)) if cs and all(v is not None for v in vals) else None


def _group_accuracy(cells: Mapping[str, Mapping[int, float]], cs: list[str]) -> float | None:
    """Mean accuracy over every (corruption, severity) cell of the corruptions (mCA when they are the 15)."""
    vals = [1.0 - e for c in cs for e in cells[c].values()]
    return float(np.mean(vals)) if vals else None


def _group(
    cells: Mapping[str, Mapping[int, float]], per_corruption: Mapping[str, Mapping[str, Any]], cs: list[str]
) -> dict[str, Any]:
    """Accuracy, mCE and relative mCE of a group of corruptions (a category, or the extras)."""
    return {
        "accuracy": _group_accuracy(cells, cs),
        "mce": _group_mce(per_corruption, cs, "ce"),
        "relative_mce": _group_mce(per_corruption, cs, "relative_ce"),
        "corruptions": cs,
    }


def _per_severity(
    cells: Mapping[str, Mapping[int, float]], bench: list[str], base: Baseline | None
) -> dict[str, dict[str, float | None]]:
    """Per severity s, over the benchmark corruptions evaluated at s: mean accuracy, mean error and
    mCE_s = mean of E(f, s, c) / E(base, s, c) (None unless the baseline has every one, non-zero)."""
    per_severity = {}
    for s in sorted({s for c in bench for s in cells[c]}):
        cs = [c for c in bench if s in cells[c]]
        ratios = []
        for c in cs:
            b = base.errors.get(c, {}).get(s) if base is not None else None
            ratios.append(cells[c][s] / b if b else None)
        per_severity[str(s)] = {
            "accuracy": float(np.mean([1.0 - cells[c][s] for c in cs])),
            "error": float(np.mean([cells[c][s] for c in cs])),
            "mce": float(np.mean(ratios)) if ratios and all(v is not None for v in ratios) else None,
        }
    return per_severity


def summarize(
    table: pa.Table | Iterable[Mapping[str, Any]],
    baseline: Baseline | str | Mapping[str, Any] | pa.Table | None = None,
    *,
    model: str | None = None,
) -> dict[str, Any]:
    """Robustness summary of one model of an :func:`evaluate_model` table: the metrics of Hendrycks &
    Dietterich 2019 (see the module docstring).

    `baseline`: a :class:`Baseline`, "alexnet", a baseline JSON path, a baseline model's table, a dict in
    the reference layout, or None (accuracies only; CE entries are None). CE of a corruption is None when
    the baseline lacks one of its evaluated severities; mCE / relative mCE are None unless every evaluated
    benchmark corruption has one. Keys: model, baseline, clean_accuracy, clean_error, mca, mce,
    relative_mce, per_corruption, per_category, per_severity, extra, excluded, corruptions, complete.
    """
    rows = _rows(table, model)
    name = rows[0]["model"]
    base = _as_baseline(baseline)
    clean_err = _clean_error(rows, name)
    cells, excluded = _error_cells(rows)
    present = [c for c in CORRUPTIONS if c in cells]
    per_corruption = {c: _corruption_entry(c, cells[c], clean_err, base) for c in present}
    bench = [c for c in present if c in BENCHMARK_CORRUPTIONS]
    extra = [c for c in present if c in EXTRA_CORRUPTIONS]
    per_category = {}
    for cat, members in CATEGORIES.items():
        cs = [c for c in present if c in members]
        if cs:
            per_category[cat] = _group(cells, per_corruption, cs)
    complete = set(bench) == set(BENCHMARK_CORRUPTIONS) and all(
        sorted(cells[c]) == [1, 2, 3, 4, 5] for c in bench
    )
    return {
        "model": name,
        "baseline": base.name if base is not None else None,
        "clean_accuracy": 1.0 - clean_err,
        "clean_error": clean_err,
        "mca": _group_accuracy(cells, bench),
        "mce": _group_mce(per_corruption, bench, "ce"),
        "relative_mce": _group_mce(per_corruption, bench, "relative_ce"),
        "per_corruption": per_corruption,
        "per_category": per_category,
        "per_severity": _per_severity(cells, bench, base),
        "extra": _group(cells, per_corruption, extra),
        "excluded": sorted(excluded, key=CORRUPTIONS.index),
        "corruptions": bench,
        "complete": complete,
    }


def flat_metrics(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The summary as flat ``name -> number`` pairs for metrics.json / MLflow (None values left out):
    clean_accuracy, mca, mce, relative_mce, extra_accuracy, extra_mce, mca_<category>, mce_<category>,
    mca_sev<s>, mce_sev<s>, ce_<corruption>, acc_<corruption>."""
    out: dict[str, Any] = {
        "clean_accuracy": summary["clean_accuracy"],
        "mca": summary["mca"],
        "mce": summary["mce"],
        "relative_mce": summary["relative_mce"],
        "extra_accuracy": summary["extra"]["accuracy"],
        "extra_mce": summary["extra"]["mce"],
    }
    for cat, v in summary["per_category"].items():
        out[f"mca_{cat}"] = v["accuracy"]
        out[f"mce_{cat}"] = v["mce"]
    for s, v in summary["per_severity"].items():
        out[f"mca_sev{s}"] = v["accuracy"]
        out[f"mce_sev{s}"] = v["mce"]
    for c, v in summary["per_corruption"].items():
        out[f"acc_{c}"] = v["accuracy"]
        out[f"ce_{c}"] = v["ce"]
    return {
        f"{prefix}{k}": float(v) for k, v in out.items() if v is not None and not math.isnan(float(v))
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Uncertainty: paired bootstrap over test images (core.robustness.intervals)
# ----------------------------------------------------------------------------------------------------------

#: The differences evaluate reports with intervals: the headline metrics, then per category and severity
#: (``mca_<group>`` / ``mce_<group>`` keys of :func:`flat_metrics`).
COMPARED_METRICS = ("clean_accuracy", "mca", "mce", "relative_mce", "extra_accuracy", "extra_mce")


def compared(name: str) -> bool:
    """Whether a flat metric gets a difference with an interval (headline, per category, per severity)."""
    return name in COMPARED_METRICS or name.startswith(("mca_", "mce_"))


class _ModelCells:
    """One model's per-image correctness, arranged for weighted (bootstrap) accuracies."""

    def __init__(self, clean: np.ndarray, groups: list[tuple[np.ndarray, list[tuple[str, int]], np.ndarray]]):
        self.clean = clean  # float64 [N], by test index
        self.groups = (
            groups  # (positions [n], set keys [k], correctness float64 [k, n]) of sets sharing images
        )

    def rows(self, model: str, counts: np.ndarray, meaningful: Mapping[tuple[str, int], bool]) -> list[dict]:
        """Evaluation rows (model, corruption, severity, error, meaningful) at image weights ``counts``."""
        total = counts.sum()
        acc = float(counts @ self.clean) / total
        out = [{"model": model, "corruption": "clean", "severity": 0, "error": 1.0 - acc, "meaningful": True}]
        for pos, keys, correct in self.groups:
            w = counts[pos].astype(np.float64)
            accs = correct @ w / w.sum()
            for (c, s), a in zip(keys, accs):
                out.append({"model": model, "corruption": c, "severity": s, "error": 1.0 - float(a),
                            "meaningful": meaningful.get((c, s), True)})  # fmt: skip
        return out


def _cells(per_image: pa.Table) -> tuple[dict[str, _ModelCells], int]:
    cols = {
        k: per_image.column(k).cast(pa.string()).to_numpy(zero_copy_only=False)
        if k in ("model", "corruption")
        else per_image.column(k).to_numpy()
        for k in ("model", "corruption", "severity", "index", "correct")
    }
    out: dict[str, _ModelCells] = {}
    n_clean = None
    for model in dict.fromkeys(cols["model"]):
        mine = cols["model"] == model
        keys = cols["corruption"][mine], cols["severity"][mine].astype(int)
        index, correct = cols["index"][mine].astype(np.int64), cols["correct"][mine].astype(np.float64)
        is_clean = keys[0] == "clean"
        order = np.argsort(index[is_clean], kind="stable")
        clean_index = index[is_clean][order]
        if not np.array_equal(clean_index, np.arange(len(clean_index))):
            raise ValueError(
                f"per-image table: the clean rows of {model!r} must cover test indices 0..N-1 once"
            )
        if n_clean is not None and len(clean_index) != n_clean:
            raise ValueError(f"per-image table: {model!r} has {len(clean_index)} clean images, not {n_clean}")
        n_clean = len(clean_index)
        groups: dict[bytes, tuple[np.ndarray, list[tuple[str, int]], list[np.ndarray]]] = {}
        sets = dict.fromkeys(zip(keys[0][~is_clean].tolist(), keys[1][~is_clean].tolist()))
        for c, s in sets:
            sel = (keys[0] == c) & (keys[1] == s)
            pos = index[sel]
            if pos.size and (pos.min() < 0 or pos.max() >= n_clean):
                raise ValueError(
                    f"per-image table: {model!r} {c}/{s} has test indices outside 0..{n_clean - 1}"
                )
            g = groups.setdefault(pos.tobytes(), (pos, [], []))
            g[1].append((c, s))
            g[2].append(correct[sel])
        out[model] = _ModelCells(
            correct[is_clean][order], [(p, k, np.stack(v)) for p, k, v in groups.values()]
        )
    if n_clean is None:
        raise ValueError("per-image table: no rows")
    return out, n_clean


def bootstrap_metrics(
    table: pa.Table,
    per_image: pa.Table,
    baseline: Baseline | str | None,
    *,
    replicates: int,
    seed: int,
) -> dict[str, dict[str, np.ndarray]]:
    """Paired bootstrap replicates of every model's :func:`flat_metrics` ({model: {metric: array}}).

    Each replicate reweights the test images by one draw of :func:`core.robustness.intervals.resample_counts` (the same
    draw for every model and every set) and recomputes each model's evaluation rows and their summary; the
    CE baseline is recomputed on the same draw when it is a model of the table (``baseline`` = its name),
    and stays fixed otherwise (a :class:`Baseline`). ``table`` (the :func:`evaluate_model` counts) supplies
    the meaningful flags. At all-ones counts the replicate equals :func:`summarize` of ``table``."""

    cells, n = _cells(per_image)
    meaningful = {(r["corruption"], int(r["severity"])): bool(r["meaningful"]) for r in table.to_pylist()}
    if isinstance(baseline, str) and baseline not in cells:
        raise ValueError(f"bootstrap_metrics: baseline model {baseline!r} not in the per-image table")

    def statistic(counts: np.ndarray) -> dict[str, float]:
        rows = {m: c.rows(m, counts, meaningful) for m, c in cells.items()}
        base = (
            Baseline.from_table(rows[baseline], model=baseline, name=baseline)
            if isinstance(baseline, str)
            else baseline
        )
        out = {}
        for m, r in rows.items():
            out.update({f"{m}\t{k}": v for k, v in flat_metrics(summarize(r, base, model=m)).items()})
        return out

    flat = bootstrap(n, statistic, replicates=replicates, seed=seed)
    result: dict[str, dict[str, np.ndarray]] = {}
    for key, samples in flat.items():
        m, name = key.split("\t", 1)
        result.setdefault(m, {})[name] = samples
    return result


def comparisons(
    points: Mapping[str, Mapping[str, float]],
    samples: Mapping[str, Mapping[str, np.ndarray]],
    pairs: Sequence[tuple[str, str]],
    *,
    confidence: float = 0.95,
) -> dict[str, dict[str, Any]]:
    """For each (a, b) in ``pairs``: ``"<b>-<a>"`` -> {metric: difference b - a with its paired interval
    (core.robustness.intervals.difference)} over :func:`compared` metrics both models have, plus ``gain_<group>``: the
    relative improvement acc_b / acc_a - 1 per category and severity ([TCNN21] Fig. 3) with its interval."""

    out: dict[str, dict[str, Any]] = {}
    for a, b in pairs:
        if a not in points or b not in points:
            continue
        pa_, pb = points[a], points[b]
        sa, sb = samples.get(a, {}), samples.get(b, {})
        diffs: dict[str, Any] = {}
        for name in pa_:
            if name in pb and compared(name):
                d = difference(pa_[name], pb[name], sa.get(name), sb.get(name), confidence=confidence)
                if d is not None:
                    diffs[name] = d
                if name.startswith("mca_"):
                    g = difference(
                        pa_[name], pb[name], sa.get(name), sb.get(name), ratio=True, confidence=confidence
                    )
                    if g is not None:
                        diffs[f"gain_{name.removeprefix('mca_')}"] = g
        out[f"{b}-{a}"] = diffs
    return out
