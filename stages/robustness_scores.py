"""The evaluate stage's scores and the files it writes from them: each model's summary and flat metrics
against one CE baseline (Hendrycks & Dietterich 2019), every difference of :data:`PAIRS` with its paired
bootstrap interval over test images (core.robustness.intervals), the relative gain per category and severity
([TCNN21] Fig. 3), and the lines that say them. What each file holds: stages.evaluate's docstring.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from core.config import Params
from core.robustness.baseline import Baseline
from core.robustness.headline import headline_rows, interval_text
from core.robustness.intervals import CONFIDENCE
from core.robustness.metrics import flat_metrics, summarize
from core.robustness.paired_bootstrap import bootstrap_metrics, comparisons
from core.utils.atomic import atomic_write_json, atomic_write_parquet, atomic_write_text
from core.utils.hashing import derive_seed
from core.viz.plots import plot_gains
from stages.harness.runner import StageError
from stages.robustness_bench import LABELS

#: The differences evaluate reports (b - a for (a, b)): first what attention buys (T-CNN vs its matched
#: control), then each fine-tuned model vs the pretrained CNN.
PAIRS = (("control", "tcnn"), ("cnn", "tcnn"), ("cnn", "control"))
#: The headline's folder under the stage's output (dvc.yaml's one ``metrics:`` entry of evaluate).
HEADLINE_DIR = "headline"


def resolve_baseline(spec: str, table: pa.Table) -> Baseline:
    """The CE baseline ``robustness.baseline`` names: "alexnet", a model of this run's table, or a JSON file."""
    if spec == "alexnet":
        return Baseline.alexnet()
    models = set(table.column("model").to_pylist())
    if spec in models:
        return Baseline.from_table(table, model=spec, name=f"{spec} (this run)")
    try:
        return Baseline.load(spec)
    except (FileNotFoundError, ValueError) as err:
        raise StageError(f"robustness.baseline: {err}") from None


def score(params: Params, table: pa.Table, per_image: pa.Table, models: Sequence[str]) -> dict[str, Any]:
    """Each model's summary and flat metrics, and every :data:`PAIRS` difference with its paired bootstrap
    interval (one draw over test images for every model and set; the CE baseline redrawn with it when it is
    a model of the run)."""
    rob = params.robustness
    baseline = resolve_baseline(rob.baseline, table)
    summaries = {m: summarize(table, baseline, model=m) for m in models}
    points = {m: flat_metrics(s) for m, s in summaries.items()}
    samples = bootstrap_metrics(
        table, per_image, rob.baseline if rob.baseline in models else baseline,
        replicates=rob.bootstrap, seed=derive_seed(params.seed, "bootstrap"),
    )  # fmt: skip
    pairs = [(a, b) for a, b in PAIRS if a in models and b in models]
    return {"baseline": baseline, "summaries": summaries, "points": points, "pairs": pairs, "samples": samples,
            "comparisons": comparisons(points, samples, pairs)}  # fmt: skip


def write_main(
    params: Params, out: Path, name: str, table: pa.Table, per_image: pa.Table, models: list[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Score the main suite (``name``) and write its tables, baseline, plot and CSVs; returns (metrics.json's content so
    far, the summaries, the comparisons)."""
    rob = params.robustness
    t0 = time.perf_counter()
    main = score(params, table, per_image, models)
    baseline, summaries, points, pairs, comps = (
        main[k] for k in ("baseline", "summaries", "points", "pairs", "comparisons")
    )
    print(
        f"evaluate: paired bootstrap, {rob.bootstrap} replicates over test images, in {time.perf_counter() - t0:.1f} s"
    )
    (out / "plots").mkdir(parents=True, exist_ok=True)
    atomic_write_parquet(out / "robustness.parquet", table)
    atomic_write_parquet(out / "per_image.parquet", per_image)
    baseline.save(out / "baseline.json")
    plot_gains(comps, [f"{b}-{a}" for a, b in pairs if b == "tcnn"], out / "plots" / "robustness_gain.png",
               labels=LABELS)  # fmt: skip
    atomic_write_text(out / "robustness_by_category.csv", _group_csv(summaries, "per_category"))
    atomic_write_text(out / "robustness_by_severity.csv", _group_csv(summaries, "per_severity"))
    metrics: dict[str, Any] = dict(points)
    metrics["baseline"] = baseline.name
    metrics["corrupted_sets"] = name
    metrics["test_image_size"] = params.test_image_size()
    metrics["comparisons"] = comps
    metrics["bootstrap"] = {
        "replicates": rob.bootstrap,
        "confidence": CONFIDENCE,
        "unit": "test image (paired: one draw for every model and set)",
        "method": "percentile",
        "seed": derive_seed(params.seed, "bootstrap"),
        "images": _set_sizes(table),
    }
    return metrics, summaries, comps


def write_public(
    params: Params, out: Path, name: str, table: pa.Table, per_image: pa.Table, models: list[str]
) -> dict[str, Any]:
    """Score the published benchmark evaluated next to the main sets and write its tables; returns
    metrics.json's ``public`` entry."""
    pub = score(params, table, per_image, models)
    (out / "public").mkdir(exist_ok=True)
    atomic_write_parquet(out / "public" / "robustness.parquet", table)
    atomic_write_parquet(out / "public" / "per_image.parquet", per_image)
    say_all(f"{name}: ", pub["summaries"], pub["comparisons"])
    return {"kind": name, "dir": str(params.robustness.public.dir), "baseline": pub["baseline"].name,
            "images": _set_sizes(table), **pub["points"], "comparisons": pub["comparisons"]}  # fmt: skip


def say_all(prefix: str, summaries: dict[str, Any], comps: dict[str, Any]) -> None:
    """One line per model (clean accuracy, mean corruption accuracy, mCE), one per difference with its interval."""
    for m, s in summaries.items():
        mce = "n/a" if s["mce"] is None else f"{s['mce']:.3f}"
        print(
            f"evaluate: {prefix}{m}: clean {s['clean_accuracy']:.4f}  mean corruption acc {s['mca']:.4f}  mCE {mce}"
        )
    for key, diffs in comps.items():
        print(
            f"evaluate: {prefix}{key}: "
            + "  ".join(_say(diffs, k) for k in ("clean_accuracy", "mca", "mce") if k in diffs)
        )


def write_headline(out: Path, metrics: dict[str, Any]) -> None:
    """``<out>/headline/<row>.json``, one file per row of core.robustness.headline.headline_rows: DVC shows
    a metrics folder's files as rows, so `dvc metrics show` prints the headline as a small table."""
    folder = out / HEADLINE_DIR
    shutil.rmtree(folder, ignore_errors=True)  # no row of an earlier run's models survives
    folder.mkdir(parents=True)
    for name, row in headline_rows(metrics).items():
        atomic_write_json(folder / f"{name}.json", row)


def _group_csv(summaries: dict[str, dict[str, Any]], key: str) -> str:
    groups = list(next(iter(summaries.values()))[key])
    lines = [",".join([key.removeprefix("per_"), *summaries])]
    for g in groups:
        vals = [summaries[m][key].get(g, {}).get("accuracy") for m in summaries]
        lines.append(",".join([str(g), *("" if v is None else f"{v:.6f}" for v in vals)]))
    return "\n".join(lines) + "\n"


def _set_sizes(table: pa.Table) -> dict[str, int]:
    """Images per set: the clean test split and (the largest) corrupted set."""
    rows = table.to_pylist()
    return {
        "clean": max((r["n"] for r in rows if r["corruption"] == "clean"), default=0),
        "per_corrupted_set": max((r["n"] for r in rows if r["corruption"] != "clean"), default=0),
    }


def _say(diffs: dict[str, Any], key: str) -> str:
    return f"{key} {interval_text(diffs[key], ' pp')}"
