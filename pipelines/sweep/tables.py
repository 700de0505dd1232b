"""The sweep's Parquet tables (summary.parquet, the selection's, the seed and kind tables), written one way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from core.utils.atomic import atomic_write

NODE_LISTS = ("attempt_nodes", "worker_nodes")  # list<string> columns


def _column(values: list[Any]) -> pa.Array:
    kinds = {type(v) for v in values if v is not None}
    if kinds <= {int} or kinds <= {float} or kinds <= {int, float} or kinds <= {str} or kinds <= {bool}:
        return pa.array(values)
    return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())


def write_table(rows: list[dict[str, Any]], path: Path) -> Path:
    """The rows as Parquet (atomic); a column whose values mix types is stored as JSON text."""
    names = list(rows[0]) if rows else ["trial"]
    table = pa.table(
        {
            n: pa.array([r.get(n) for r in rows], pa.list_(pa.string()))
            if n in NODE_LISTS
            else _column([r.get(n) for r in rows])
            for n in names
        }
    )
    return atomic_write(path, lambda fh: pq.write_table(table, fh))
