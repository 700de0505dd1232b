"""The evaluation table: one row per model x corruption x severity (top-1 counts, accuracy, error), and the
per-image correctness table the paired bootstrap resamples.

:func:`core.robustness.evaluation.evaluate_model` writes both; :func:`table_from_errors` builds the first from
known errors (published numbers, tests); :func:`model_rows` reads one model's rows back for the metrics
(Hendrycks & Dietterich 2019, see core.robustness.metrics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from core.robustness.corruptions import CATEGORY_OF

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


def per_image_table(model: str, parts: list[tuple[str, int, np.ndarray, np.ndarray]]) -> pa.Table:
    """The :data:`PER_IMAGE_SCHEMA` table of one model from its (corruption, severity, test indices, correct) parts."""
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


def table_row(
    model: str, corruption: str, severity: int, correct: int, n: int, meaningful: bool
) -> dict[str, Any]:
    """One :data:`TABLE_SCHEMA` row from a set's top-1 counts."""
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
    rows = [
        table_row(model, "clean", 0, 0, 0, True) | {"accuracy": 1 - clean_error, "error": clean_error, "n": n}
    ]
    for c, v in errors.items():
        items = v.items() if isinstance(v, Mapping) else enumerate(v, start=1)
        for s, e in items:
            rows.append(
                table_row(model, c, int(s), 0, 0, True) | {"accuracy": 1 - e, "error": float(e), "n": n}
            )
    return pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)


def model_rows(table: pa.Table | Iterable[Mapping[str, Any]], model: str | None) -> list[dict[str, Any]]:
    """The rows of `model` (or of the table's one model, when None) of an evaluation table or row list."""
    rows = table.to_pylist() if isinstance(table, pa.Table) else [dict(r) for r in table]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if model is None:
        if len(models) != 1:
            raise ValueError(f"the table holds models {models}: name one")
        model = models[0]
    elif model not in models:
        raise ValueError(f"model {model!r} not in the table (has {models})")
    return [r for r in rows if r["model"] == model]
