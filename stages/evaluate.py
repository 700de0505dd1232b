"""Stage `evaluate`: accuracy of the CNN and the T-CNN on the clean and corrupted test sets.

    python -m stages.evaluate [--params params.yaml]

Reads the corrupt stage's sets (``robustness.dir``), the pretrained CNN (``runs/pretrain/cnn-final.pt``)
and the fine-tuned T-CNN (``runs/finetune/tcnn-final.pt``), and writes under ``results/``:

- ``robustness.parquet``: one row per model x corruption x severity (clean row: severity 0) with n,
  correct, accuracy, error and the meaningful flag (core.robustness.TABLE_SCHEMA);
- ``baseline.json``: the frozen baseline's 19 x 5 errors and clean error (``robustness.baseline``: "cnn" =
  this run's own pretrained CNN, the default; "alexnet" = AlexNet's ImageNet-C table; or a baseline JSON);
- ``metrics.json``: per model the flat robustness metrics (clean accuracy, mCA, mCE, relative mCE, per
  category / severity / corruption) — DVC metrics;
- ``robustness_by_category.csv`` / ``robustness_by_severity.csv``: mean corruption accuracy per group and
  model (DVC plots), and ``plots/robustness_gain.png``: the T-CNN's relative improvement over the CNN per
  category and severity (000 Fig. 3).
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from core.checkpoint import CheckpointError, atomic_write_json, atomic_write_text, load_model
from core.config import Params
from core.corruptions import read_set, set_path
from core.data import DataError, read_manifest
from core.plots import plot_relative_improvement
from core.robustness import Baseline, evaluate_model, flat_metrics, summarize
from stages._cli import StageError, stage_main

NAME = "evaluate"


def model_paths(root: Path) -> dict[str, Path]:
    """The models the default chain compares, by the names used in tables, metrics and MLflow."""
    return {
        "cnn": root / "runs" / "pretrain" / "cnn-final.pt",
        "tcnn": root / "runs" / "finetune" / "tcnn-final.pt",
    }


def resolve_baseline(spec: str, table: pa.Table) -> Baseline:
    if spec == "alexnet":
        return Baseline.alexnet()
    models = set(table.column("model").to_pylist())
    if spec in models:
        return Baseline.from_table(table, model=spec, name=f"{spec} (this run)")
    try:
        return Baseline.load(spec)
    except (FileNotFoundError, ValueError) as err:
        raise StageError(f"robustness.baseline: {err}") from None


def _group_csv(summaries: dict[str, dict[str, Any]], key: str) -> str:
    groups = list(next(iter(summaries.values()))[key])
    lines = [",".join([key.removeprefix("per_"), *summaries])]
    for g in groups:
        vals = [summaries[m][key].get(g, {}).get("accuracy") for m in summaries]
        lines.append(",".join([str(g), *("" if v is None else f"{v:.6f}" for v in vals)]))
    return "\n".join(lines) + "\n"


class _ChannelsLast(torch.nn.Module):
    """Feeds the wrapped model channels-last inputs (faster convolutions on CPU: oneDNN's native layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.contiguous(memory_format=torch.channels_last))


def inference_model(model: torch.nn.Module, example: torch.Tensor, *, tol: float = 1e-4) -> tuple[Any, str]:
    """The fastest of a few equivalent forms of `model` (eval mode) for pure inference, and its name.

    Candidates: the eager model; channels-last weights and inputs (oneDNN's native layout on CPU); for a
    model without GPSA layers (the CNN) also a traced and frozen TorchScript graph (batch norm folded into
    the convolutions). Speed only: a candidate qualifies when its logits on `example` match the eager
    model's within `tol` (float32 rounding), and the one with the shortest time on `example` (best of two
    calls, after a warm-up) is used."""
    model = model.eval()
    with torch.no_grad():
        reference = model(example)
    candidates: list[tuple[str, Any]] = [("eager", model)]
    cl = _ChannelsLast(copy.deepcopy(model).to(memory_format=torch.channels_last)).eval()
    candidates.append(("eager, channels-last", cl))
    if not any(type(m).__name__ == "GPSA" for m in model.modules()):
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = torch.jit.freeze(torch.jit.trace(cl, example, check_trace=False).eval())
            candidates.append(("TorchScript (traced, frozen), channels-last", traced))
        except Exception as err:  # tracing is an optimisation only
            print(f"evaluate: TorchScript not used ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
    best: tuple[float, str, Any] | None = None
    for kind, candidate in candidates:
        try:
            with torch.no_grad():
                if (candidate(example) - reference).abs().max().item() > tol:
                    continue
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    candidate(example)
                    times.append(time.perf_counter() - t0)
        except Exception:  # a candidate that fails is skipped; the eager model always works
            continue
        if best is None or min(times) < best[0]:
            best = (min(times), kind, candidate)
    assert best is not None  # the eager model matches itself
    return best[2], best[1]


def evaluate_models(params: Params, root: Path, paths: dict[str, Path]) -> pa.Table:
    rob = params.robustness
    cdir = root / rob.dir
    try:
        manifest = read_manifest(root / params.data.dir)
        clean = read_set(set_path(cdir, "clean", 0))
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(str(err)) from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = []
    for name, path in paths.items():
        try:
            model = load_model(path, map_location=device)
        except CheckpointError as err:
            raise StageError(str(err)) from None
        size = params.finetune.image_size if name != "cnn" else None
        if device.type == "cpu":
            example = _example_batch(clean.images, manifest, size, min(rob.batch_size, len(clean.images)))
            model, kind = inference_model(model, example)
        else:
            kind = "eager"
        t0 = time.perf_counter()
        print(
            f"evaluate: {name} on clean + {len(rob.corruptions)} x {len(rob.severities)} corrupted sets ({kind})"
        )
        tables.append(
            evaluate_model(
                model,
                (clean.images, clean.labels),
                cdir,
                rob.corruptions,
                rob.severities,
                mean=manifest["mean"],
                std=manifest["std"],
                batch_size=rob.batch_size,
                device=device,
                model_name=name,
                image_size=size,
            )  # fmt: skip
        )
        n = sum(tables[-1].column("n").to_pylist())
        dt = time.perf_counter() - t0
        print(f"evaluate: {name}: {n} images in {dt:.1f} s ({n / max(dt, 1e-9):.0f} img/s)")
    return pa.concat_tables(tables)


def _example_batch(images: Any, manifest: dict[str, Any], size: int | None, n: int) -> torch.Tensor:
    """The first `n` clean images as the models see them (normalised, resized like count_correct does)."""
    x = torch.from_numpy(np.ascontiguousarray(images[:n])).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(manifest["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(manifest["std"], dtype=torch.float32).view(1, -1, 1, 1)
    x = (x - mean) / std
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.contiguous()


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    root = Path(root)
    paths = model_paths(root)
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise StageError(f"missing model checkpoint(s): {', '.join(missing)} (run pretrain and finetune)")
    table = evaluate_models(params, root, paths)
    baseline = resolve_baseline(params.robustness.baseline, table)
    summaries = {m: summarize(table, baseline, model=m) for m in paths}
    out = root / "results"
    (out / "plots").mkdir(parents=True, exist_ok=True)
    tmp = out / ".robustness.parquet.tmp"
    pq.write_table(table, tmp)
    tmp.replace(out / "robustness.parquet")
    baseline.save(out / "baseline.json")
    gains = plot_relative_improvement(table, "cnn", "tcnn", out / "plots" / "robustness_gain.png")
    atomic_write_text(out / "robustness_by_category.csv", _group_csv(summaries, "per_category"))
    atomic_write_text(out / "robustness_by_severity.csv", _group_csv(summaries, "per_severity"))
    metrics = {m: flat_metrics(s) for m, s in summaries.items()}
    metrics["baseline"] = baseline.name
    metrics["tcnn_gain"] = {k: {str(g): v for g, v in d.items()} for k, d in gains.items()}
    atomic_write_json(out / "metrics.json", metrics)
    atomic_write_json(out / "summary.json", summaries)
    for m, s in summaries.items():
        mce = "n/a" if s["mce"] is None else f"{s['mce']:.3f}"
        print(
            f"evaluate: {m}: clean {s['clean_accuracy']:.4f}  mean corruption acc {s['mca']:.4f}  mCE {mce}"
        )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv)


if __name__ == "__main__":
    sys.exit(main())
