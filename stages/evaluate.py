"""Stage `evaluate`: accuracy of the pretrained CNN, the matched control and the T-CNN, clean and corrupted,
and every difference between them with a paired bootstrap interval.

    python -m stages.evaluate [--params params.yaml]

Models (names used in tables, metrics and MLflow): ``cnn`` = the pretrained CNN (``runs/pretrain/cnn-final.pt``),
``control`` = the same checkpoint fine-tuned with the T-CNN's recipe without attention
(``runs/control/model/control-final.pt``; absent when the control is off) and ``tcnn`` = the fine-tuned
model of ``model.kind`` (``runs/finetune/tcnn-final.pt``). All are evaluated at one resolution
(`Params.test_image_size`) on the full clean test split and on the corrupt stage's sets
(``robustness.dir``). Writes under ``results/``:

- ``robustness.parquet``: one row per model x corruption x severity (clean row: severity 0) with n,
  correct, accuracy, error and the meaningful flag (core.robustness.TABLE_SCHEMA);
- ``per_image.parquet``: the correctness of every model on every image of every set
  (core.robustness.PER_IMAGE_SCHEMA), what the intervals resample;
- ``baseline.json``: the frozen CE baseline's 19 x 5 errors and clean error (``robustness.baseline``: "cnn" =
  this run's pretrained CNN, the default, one normaliser for every model; "alexnet" = AlexNet's ImageNet-C
  table; or a baseline JSON);
- ``metrics.json``: per model the flat robustness metrics (clean accuracy, mCA, mCE, relative mCE, per
  category / severity / corruption); ``comparisons``: T-CNN minus control (what attention buys), T-CNN minus
  the pretrained CNN and control minus the pretrained CNN, each metric with its paired-bootstrap 95%
  interval over test images (``robustness.bootstrap`` replicates, seeded by ``seed``; core.robustness.intervals) and
  the relative gain per category / severity ([TCNN21] Fig. 3) -- DVC metrics;
- ``robustness_by_category.csv`` / ``robustness_by_severity.csv``: mean corruption accuracy per group and
  model (DVC plots), and ``plots/robustness_gain.png``: the T-CNN's relative improvement over the control and
  over the pretrained CNN per category and severity, with intervals ([TCNN21] Fig. 3).

metrics.json also says how long the stage took (``wall_s``) and how it had the pretrained CNN's evaluation
(``cnn_evaluation``): ``source: own`` evaluated here like the other models (the DVC path); in a sweep
(``run(..., shared=<store>)``) the CNN's evaluation on the generated sets is shared by identity, as its
pretraining is (stages.cnn_evaluation): ``computed`` (this trial made it for the others), ``shared`` (read,
after this process predicted the first clean test images as the store says), ``recomputed`` (the check
disagreed: evaluated here, ``reason`` says why); ``key`` names the store's entry, ``seconds`` the time spent
evaluating the CNN here.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from core.config import Params
from core.data import DataError, load_split, read_manifest
from core.robustness.intervals import CONFIDENCE
from core.robustness.metrics import (
    Baseline,
    array_batches,
    bootstrap_metrics,
    comparisons,
    evaluate_model,
    flat_metrics,
    predictions,
    summarize,
)
from core.training.checkpoint import CheckpointError, load_model
from core.training.inference import inference_model
from core.training.loop import select_device
from core.utils.atomic import atomic_write_json, atomic_write_parquet, atomic_write_text
from core.utils.hashing import derive_seed
from core.viz.plots import plot_gains
from stages import cnn_evaluation
from stages.fine_tuning import control_checkpoint, control_disabled_reason
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main

NAME = "evaluate"


#: The differences evaluate reports (b - a for (a, b)): first what attention buys (T-CNN vs its matched
#: control), then each fine-tuned model vs the pretrained CNN.
PAIRS = (("control", "tcnn"), ("cnn", "tcnn"), ("cnn", "control"))


def model_paths(params: Params, root: Path) -> dict[str, Path]:
    """The checkpoints of the models this config compares, in report order (see the module docstring)."""
    paths = {
        "cnn": root / chain.output("pretrain", "cnn-final.pt"),
        "control": control_checkpoint(root),
        "tcnn": root / chain.output("finetune", "tcnn-final.pt"),
    }
    if control_disabled_reason(params) is not None:
        del paths["control"]
    return paths


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


LABELS = {"cnn": "pretrained CNN", "control": "control (CNN fine-tuned, no attention)", "tcnn": "T-CNN"}


@dataclass(frozen=True)
class Suite:
    """One family of corrupted sets every model is evaluated on: the corrupt stage's (``robustness.dir``) or a
    published benchmark (``robustness.public``, core.robustness.public_sets.PublicSets)."""

    name: str  # "generated" | the published kind
    source: Any  # a directory of stored sets, or a callable (corruption, severity) -> StoredSet
    corruptions: tuple[str, ...]
    severities: tuple[int, ...]


def suites(params: Params, root: Path, n_clean: int) -> tuple[Suite, Suite | None]:
    """(the suite the main results come from, the published suite evaluated next to it or None)."""
    from core.robustness.public_sets import PublicSets

    rob = params.robustness
    generated = Suite("generated", root / rob.dir, tuple(rob.corruptions), tuple(rob.severities))
    pub = rob.public
    if pub is None:
        return generated, None
    try:
        sets = PublicSets(pub.kind, root / pub.dir, pub.n_images or rob.n_images, n_clean)
    except (FileNotFoundError, ValueError) as err:
        raise StageError(f"robustness.public: {err}") from None
    have = set(sets.available)
    corrs = tuple(c for c in rob.corruptions if all((c, s) in have for s in rob.severities))
    if not corrs:
        raise StageError(
            f"robustness.public: {pub.dir} holds none of robustness.corruptions at every severity"
        )
    published = Suite(pub.kind, sets.load, corrs, tuple(rob.severities))
    return (published, None) if pub.use == "replace" else (generated, published)


@dataclass(frozen=True)
class Bench:
    """What every model is evaluated on, and how: the full clean test split, at `Params.test_image_size`, with
    the normalization the models expect, in batches of ``robustness.batch_size``, on one device."""

    images: Any
    labels: Any
    manifest: dict[str, Any]
    size: int | None
    norm: dict[str, Any]
    batch_size: int
    device: torch.device

    def options(self) -> dict[str, Any]:
        """The options of core.robustness.metrics's evaluation functions."""
        return {"mean": self.norm["mean"], "std": self.norm["std"], "device": self.device,
                "image_size": self.size}  # fmt: skip


def bench(params: Params, root: Path) -> Bench:
    """The :class:`Bench` of this config: the test split of ``root / data.dir``, the device TCNN_DEVICE names."""
    try:
        manifest = read_manifest(root / params.data.dir)
        images, labels = load_split(root / params.data.dir, "test")
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(str(err)) from None
    norm = T.input_normalization(params) or {"mean": manifest["mean"], "std": manifest["std"]}
    device = select_device()  # env TCNN_DEVICE, else CUDA when available
    return Bench(
        images, labels, manifest, params.test_image_size(), norm, params.robustness.batch_size, device
    )


def evaluate_models(
    params: Params,
    root: Path,
    paths: dict[str, Path],
    suites_: Sequence[Suite] | None = None,
    *,
    shared: Path | None = None,
) -> tuple[dict[str, tuple[pa.Table, pa.Table]], dict[str, Any]]:
    """{suite name: (counts table, per-image table)} of every model on the full clean test split and each
    suite's corrupted sets (default: the suites of :func:`suites`), all at `Params.test_image_size`, and how
    the pretrained CNN's evaluation was had (:func:`cnn_tables`; ``shared``: the store of its shared one)."""
    b = bench(params, root)
    if suites_ is None:
        suites_ = [s for s in suites(params, root, len(b.images)) if s is not None]
    by_model: dict[str, dict[str, tuple[pa.Table, pa.Table]]] = {}
    note: dict[str, Any] = {}
    for name, path in paths.items():
        if name == "cnn":
            by_model[name], note = cnn_tables(params, root, b, path, suites_, shared)
        else:
            by_model[name] = evaluate_suites(b, name, prepared(b, path), suites_)
    out = {s.name: tuple(pa.concat_tables([by_model[m][s.name][i] for m in paths]) for i in (0, 1))
           for s in suites_}  # fmt: skip
    return out, note  # type: ignore[return-value]


def cnn_tables(
    params: Params, root: Path, b: Bench, path: Path, suites_: Sequence[Suite], shared: Path | None
) -> tuple[dict[str, tuple[pa.Table, pa.Table]], dict[str, Any]]:
    """The pretrained CNN's tables per suite and how they were had (``cnn_evaluation`` in metrics.json): with a
    store (``shared``), the generated suite's from its shared evaluation (stages.cnn_evaluation, checked
    against this process's predictions); else, and for a published suite, evaluated here (``source: own``)."""
    model = functools.cache(lambda: prepared(b, path))
    generated = [s for s in suites_ if s.name == cnn_evaluation.SUITE]
    if shared is None or not generated:
        out, seconds = cnn_evaluation.timed(lambda: evaluate_suites(b, "cnn", model(), suites_))
        return out, {"source": "own", "seconds": round(seconds, 3)}
    try:
        ident = cnn_evaluation.identity(params, root, path, b.manifest, b.norm, b.device.type)
    except (FileNotFoundError, ValueError) as err:  # a missing set: said where it is evaluated
        raise StageError(f"robustness.dir: {err}") from None
    tables, note = cnn_evaluation.shared(
        shared, ident, compute=lambda: evaluate_suites(b, "cnn", model(), generated)[cnn_evaluation.SUITE],
        check=lambda: check_record(b, model()[0]),
    )  # fmt: skip
    print(f"evaluate: cnn: {note['source']} evaluation {note['key']} ({shared})")
    rest = [s for s in suites_ if s.name != cnn_evaluation.SUITE]
    return {cnn_evaluation.SUITE: tables, **(evaluate_suites(b, "cnn", model(), rest) if rest else {})}, note


def check_record(b: Bench, model: Any) -> dict[str, Any]:
    """The CNN's predictions on the first clean test images (stages.cnn_evaluation.check_size), computed as
    its evaluation computes them: the same batches, options and model form."""
    n = cnn_evaluation.check_size(len(b.images), b.batch_size)
    images, labels = np.asarray(b.images[:n]), np.asarray(b.labels[:n])
    predicted = predictions(model, array_batches(images, labels, b.batch_size), **b.options())
    return cnn_evaluation.check_record(images, labels, predicted)


def prepared(b: Bench, path: Path) -> tuple[Any, str]:
    """The model of a checkpoint in its fastest equivalent form for inference on CPU
    (core.training.inference; eager elsewhere), and that form's name."""
    try:
        model = load_model(path, map_location=b.device)
    except CheckpointError as err:
        raise StageError(str(err)) from None
    if b.device.type != "cpu":
        return model, "eager"
    return inference_model(model, _example_batch(b.images, b.norm, b.size, min(b.batch_size, len(b.images))))


def evaluate_suites(
    b: Bench, name: str, model: tuple[Any, str], suites_: Sequence[Suite]
) -> dict[str, tuple[pa.Table, pa.Table]]:
    """{suite name: (counts, per-image)} of one model (``(module, form name)``: :func:`prepared`)."""
    out = {}
    for suite in suites_:
        t0 = time.perf_counter()
        print(
            f"evaluate: {name} on {len(b.images)} clean + {len(suite.corruptions)} x {len(suite.severities)} "
            f"{suite.name} corrupted sets at {b.size} px ({model[1]})"
        )
        try:
            out[suite.name] = evaluate_model(
                model[0], (b.images, b.labels), suite.source, suite.corruptions, suite.severities,
                batch_size=b.batch_size, model_name=name, per_image=True, **b.options(),
            )  # fmt: skip
        except (FileNotFoundError, ValueError) as err:  # a missing or damaged (checksum) set: says what to do
            where = "robustness.dir" if suite.name == "generated" else "robustness.public"
            raise StageError(f"{where}: {err}") from None
        n = sum(out[suite.name][0].column("n").to_pylist())
        dt = time.perf_counter() - t0
        print(f"evaluate: {name}: {n} images in {dt:.1f} s ({n / max(dt, 1e-9):.0f} img/s)")
    return out


def _example_batch(images: Any, norm: dict[str, Any], size: int | None, n: int) -> torch.Tensor:
    """The first `n` clean images as the models see them (normalised, resized like count_correct does)."""
    x = torch.from_numpy(np.ascontiguousarray(images[:n])).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(norm["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(norm["std"], dtype=torch.float32).view(1, -1, 1, 1)
    x = (x - mean) / std
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.contiguous()


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


def run(params: Params, *, root: Path = Path("."), shared: Path | str | None = None) -> dict[str, Any]:
    """Evaluate and score every model, write the outputs (module docstring); returns metrics.json's content.
    Its inputs are what `check` found readable (the DVC and sweep paths run it first).
    ``shared``: the store of the pretrained CNN's shared evaluation (stages.cnn_evaluation; a sweep's), else
    the CNN is evaluated here as every other model."""
    t_start = time.perf_counter()
    root = Path(root)
    paths = model_paths(params, root)  # each checked by `check` first (DVC and sweep paths alike)
    results, note = evaluate_models(params, root, paths, shared=Path(shared) if shared else None)
    out = root / chain.run_dir(NAME)
    main_name = next(iter(results))
    metrics, summaries, comps = _write_main(params, out, main_name, *results[main_name], list(paths))
    for name, (ptable, pimage) in list(results.items())[1:]:  # the published benchmark next to the main sets
        metrics["public"] = _write_public(params, out, name, ptable, pimage, list(paths))
    metrics["cnn_evaluation"] = note
    metrics["wall_s"] = round(time.perf_counter() - t_start, 3)
    atomic_write_json(out / "metrics.json", metrics)
    atomic_write_json(out / "summary.json", summaries)
    _say_all("", summaries, comps)
    return metrics


def _write_main(
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


def _write_public(
    params: Params, out: Path, name: str, table: pa.Table, per_image: pa.Table, models: list[str]
) -> dict[str, Any]:
    """Score the published benchmark evaluated next to the main sets and write its tables; returns
    metrics.json's ``public`` entry."""
    pub = score(params, table, per_image, models)
    (out / "public").mkdir(exist_ok=True)
    atomic_write_parquet(out / "public" / "robustness.parquet", table)
    atomic_write_parquet(out / "public" / "per_image.parquet", per_image)
    _say_all(f"{name}: ", pub["summaries"], pub["comparisons"])
    return {"kind": name, "dir": str(params.robustness.public.dir), "baseline": pub["baseline"].name,
            "images": _set_sizes(table), **pub["points"], "comparisons": pub["comparisons"]}  # fmt: skip


def _say_all(prefix: str, summaries: dict[str, Any], comps: dict[str, Any]) -> None:
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


def _set_sizes(table: pa.Table) -> dict[str, int]:
    """Images per set: the clean test split and (the largest) corrupted set."""
    rows = table.to_pylist()
    return {
        "clean": max((r["n"] for r in rows if r["corruption"] == "clean"), default=0),
        "per_corrupted_set": max((r["n"] for r in rows if r["corruption"] != "clean"), default=0),
    }


def _say(diffs: dict[str, Any], key: str) -> str:
    d = diffs[key]
    return f"{key} {100 * d['diff']:+.2f} pp [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run is opened or any model evaluated: the CE baseline can be read (a baseline JSON path, not
    a model of this run or "alexnet"), and the model checkpoints exist."""
    spec = params.robustness.baseline
    if spec != "alexnet" and spec not in ("cnn", "control", "tcnn"):
        try:
            Baseline.load(root / spec)
        except (FileNotFoundError, ValueError) as err:
            raise StageError(f"robustness.baseline: {err}") from None
    paths = model_paths(params, root)
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise StageError(
            f"missing model checkpoint(s): {', '.join(missing)} (run pretrain, finetune and control)"
        )
    for name, path in paths.items():  # each read whole: its checksum verified
        ckpt = T.load_checkpoint(path, ("model", "model_spec"), LABELS[name])
        if name == "cnn":  # scored as the CNN and the mCE baseline: the params' own CNN
            T.check_cnn_checkpoint(ckpt, params, path)
    pub = params.robustness.public
    if pub is None or pub.use != "replace":
        check_generated_sets(params, root)
    if pub is not None:
        check_public_sets(params, root)


def check_public_sets(params: Params, root: Path = Path(".")) -> None:
    """A published benchmark's files fit this dataset before any model runs: its images have the clean test
    images' shape and channels, its labels are integers of the dataset's classes, one per image
    (core.robustness.public_sets.PublicSets.check; each failure names its file)."""
    from core.robustness.public_sets import PublicSets

    pub, rob = params.robustness.public, params.robustness
    try:
        manifest = read_manifest(root / params.data.dir)
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(f"data.dir: {err} (run the prepare stage)") from None
    n_clean = int(manifest["splits"]["test"]["num_rows"])
    try:
        sets = PublicSets(pub.kind, root / pub.dir, pub.n_images or rob.n_images, n_clean)
        names = sorted({c for c, _ in sets.available} & set(rob.corruptions))
        if manifest.get("image_shape") and manifest.get("num_classes"):  # a decoded dataset states both
            sets.check(names, manifest["image_shape"], int(manifest["num_classes"]))
    except (FileNotFoundError, ValueError) as err:
        raise StageError(f"robustness.public: {err}") from None


def check_generated_sets(params: Params, root: Path = Path(".")) -> None:
    """Every corrupted set evaluate will read was made for these params: as many images as
    ``robustness.n_images`` asks for, with this config's corruption seed (the sets' stored metadata, read
    without the images; their checksums are verified where the images are read)."""
    from core.robustness.corruption_store import read_set_meta, set_path

    rob = params.robustness
    for c in rob.corruptions:
        for sev in rob.severities:
            path = set_path(root / rob.dir, c, sev)
            meta = read_set_meta(path)
            if meta is None:
                raise StageError(f"robustness.dir: {path} is missing or damaged (run the corrupt stage)")
            if meta.get("n") != rob.n_images or meta.get("seed") != params.cnn_seed:
                raise StageError(
                    f"robustness.dir: {path} holds {meta.get('n')} images of seed {meta.get('seed')}; the params "
                    f"ask for {rob.n_images} of seed {params.cnn_seed} (run the corrupt stage)"
                )


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
