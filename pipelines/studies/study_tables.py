"""A study's committed tables as files: the CSV cells written (:func:`write_csv`) and the tables read back
(:func:`load`), with the error the study tools raise (:class:`StudyError`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_text

#: What ``render`` reads (a study exported before cost.csv existed renders the same).
RENDERED = ("results.csv", "history.csv", "attention.csv", "meta.json")


class StudyError(ValueError):
    pass


def seconds(v: Any) -> str | None:
    """A time in seconds for the tables, to the millisecond (sums of them recompute the compute hours)."""
    return None if v is None else f"{float(v):.3f}"


def write_csv(path: Path, rows: list[dict[str, Any]], cols: list[str]) -> Path:
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _cell(r.get(k)) for k in cols})
    atomic_write_text(path, buf.getvalue())
    return path


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


# ----------------------------------------------------------------------------------- the tables read back


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _read_csv(path: Path) -> list[dict[str, Any]]:
    def conv(v: str) -> Any:
        if v == "":
            return None
        if v in ("True", "False"):
            return v == "True"
        try:
            return int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            return v

    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    for i, r in enumerate(
        rows, start=2
    ):  # a short row reads its missing fields as None, a long one under None
        if None in r or any(v is None for v in r.values()):
            have = sum(v is not None for k, v in r.items() if k is not None)
            raise StudyError(
                f"{path}: line {i} has {have} of {len(reader.fieldnames or [])} fields (cut short?)"
            )
    return [{k: conv(v) for k, v in r.items()} for r in rows]


def load(results: Path) -> dict[str, Any]:
    """The committed tables of a study (``cost``: [] for a study exported before cost.csv existed)."""
    missing = [f for f in RENDERED if not (results / f).is_file()]
    if missing:
        raise StudyError(f"{results}: missing {', '.join(missing)} (tcnn study export)")
    cost = _read_csv(results / "cost.csv") if (results / "cost.csv").is_file() else []
    return {"rows": _read_csv(results / "results.csv"), "history": _read_csv(results / "history.csv"),
            "attention": _read_csv(results / "attention.csv"), "cost": cost, "meta": _json(results / "meta.json")}  # fmt: skip
