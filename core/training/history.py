"""Training histories as files: one flat row per epoch (DVC plots CSV) with per-layer GPSA means."""

from __future__ import annotations

from typing import Any


def summarize_gpsa(stats: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Flat per-layer means: gpsa/<layer>/{inv_alpha,gate,nonlocality}."""
    flat = {}
    for layer, s in stats.items():
        for key, values in s.items():
            if values:
                flat[f"gpsa/{layer}/{key}"] = float(sum(values) / len(values))
    return flat


def history_rows_flat(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for row in history:
        flat = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
        if isinstance(row.get("gpsa"), dict):
            flat.update(summarize_gpsa(row["gpsa"]))
        rows.append(flat)
    return rows


CSV_FIRST = ("epoch", "finetune_epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc")


def csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    seen: list[str] = []
    for r in rows:
        seen += [k for k in r if k not in seen]
    columns = [k for k in CSV_FIRST if k in seen] + [k for k in seen if k not in CSV_FIRST]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", restval="")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()
