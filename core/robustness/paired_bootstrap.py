"""Uncertainty of the robustness metrics: a paired bootstrap over test images (core.robustness.intervals) of
every model's :func:`core.robustness.metrics.flat_metrics`, and the differences between models with their
intervals ([TCNN21] Table 2 and Fig. 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from core.robustness.baseline import Baseline
from core.robustness.intervals import bootstrap, difference
from core.robustness.metrics import flat_metrics, summarize

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


def _meaningful(table: pa.Table) -> dict[tuple[str, int], bool]:
    return {(r["corruption"], int(r["severity"])): bool(r["meaningful"]) for r in table.to_pylist()}


def evaluation_rows(table: pa.Table, per_image: pa.Table) -> list[dict]:
    """Every model's evaluation rows (model, corruption, severity, error, meaningful) of ``per_image`` with each
    test image counted once: the point :func:`bootstrap_metrics` resamples. ``per_image``'s ``correct`` may be
    fractional (e.g. averaged over runs that saw the same images); ``table`` supplies the meaningful flags."""
    cells, n = _cells(per_image)
    meaningful, ones = _meaningful(table), np.ones(n, dtype=np.int64)
    return [row for model, c in cells.items() for row in c.rows(model, ones, meaningful)]


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
    and stays fixed otherwise (a :class:`Baseline`). ``table`` (the :func:`core.robustness.evaluation.evaluate_model` counts) supplies
    the meaningful flags. At all-ones counts the replicate equals :func:`summarize` of ``table``."""

    cells, n = _cells(per_image)
    meaningful = _meaningful(table)
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
