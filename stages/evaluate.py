"""Stage `evaluate`: accuracy of the pretrained CNN, the matched control and the T-CNN, clean and corrupted,
and every difference between them with a paired bootstrap interval.

    python -m stages.evaluate [--params params.yaml]

Models (names used in tables, metrics and MLflow): ``cnn`` = the pretrained CNN (``runs/pretrain/cnn-final.pt``),
``control`` = the same checkpoint fine-tuned with the T-CNN's recipe without attention
(``runs/control/model/control-final.pt``; absent when the control is off) and ``tcnn`` = the fine-tuned
model of ``model.kind`` (``runs/finetune/tcnn-final.pt``). All are evaluated at one resolution
(`Params.test_image_size`) on the full clean test split (its test half under ``data.val_from: test_half``:
the validation half never tests) and on the corrupt stage's sets (``robustness.dir``). Writes under
``results/``:

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
  the relative gain per category / severity ([TCNN21] Fig. 3);
- ``headline/``: the headline (core.robustness.headline), one small JSON per row -- each model's clean
  accuracy and mCA, and T-CNN minus control with its interval -- the stage's only DVC metrics, so that
  `dvc metrics show` and `dvc exp show` stay readable (``metrics.json`` is a plain cached out);
- ``robustness_by_category.csv`` / ``robustness_by_severity.csv``: mean corruption accuracy per group and
  model (DVC plots), and ``plots/robustness_gain.png``: the T-CNN's relative improvement over the control and
  over the pretrained CNN per category and severity, with intervals ([TCNN21] Fig. 3).

metrics.json also says how long the stage took (``wall_s``) and how it had the pretrained CNN's evaluation
(``cnn_evaluation``): ``source: own`` evaluated here like the other models (the DVC path); in a sweep
(``run(..., shared=<store>)``) the CNN's evaluation on the generated sets is shared by identity, as its
pretraining is (stages.cnn_evaluation): ``computed`` (this trial made it for the others; over a damaged
store, with the ``reason``, which the sweep driver repeats), ``shared`` (read,
after this process predicted the first clean test images as the store says), ``recomputed`` (the check
disagreed: evaluated here, ``reason`` says why); ``key`` names the store's entry, ``seconds`` the time spent
evaluating the CNN here. ``test_split`` says which test images all of it is measured on
(core.data.role_of_test).

The models, sets and their evaluation: stages.robustness_bench (on core.robustness.bench); the scores and the
files written from them: stages.robustness_scores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from core.config import Params
from core.robustness.baseline import Baseline
from core.utils.atomic import atomic_write_json
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main
from stages.published_check import check_public_sets
from stages.robustness_bench import (
    LABELS,
    check_generated_sets,
    evaluate_models,
    model_paths,
)
from stages.robustness_scores import say_all, write_headline, write_main, write_public

NAME = "evaluate"


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
    metrics, summaries, comps = write_main(params, out, main_name, *results[main_name], list(paths))
    for name, (ptable, pimage) in list(results.items())[1:]:  # the published benchmark next to the main sets
        metrics["public"] = write_public(params, out, name, ptable, pimage, list(paths))
    metrics["cnn_evaluation"] = note
    metrics["test_split"] = tested_images(params, root)
    metrics["wall_s"] = round(time.perf_counter() - t_start, 3)
    write_headline(out, metrics)
    atomic_write_json(out / "metrics.json", metrics)
    atomic_write_json(out / "summary.json", summaries)
    say_all("", summaries, comps)
    return metrics


def tested_images(params: Params, root: Path) -> dict[str, Any]:
    """Which test images the clean accuracy and the corrupted sets are measured on (``data.val_from``: the whole
    split or its test half, then ``data.limit.test``; core.data.role_of_test, from the labels alone)."""
    from core.data import load_labels, role_of_test

    labels = load_labels(root / params.data.dir, "test")
    return role_of_test(labels, val_from=params.data.val_from, limit=params.data.caps())


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run is opened or any model evaluated: the CE baseline can be read (a baseline JSON path, not
    a model of this run or "alexnet"), and the model checkpoints exist."""
    spec = params.robustness.baseline
    if spec != "alexnet" and spec not in LABELS:  # a model of this run, or a baseline file
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
            T.check_cnn_checkpoint(ckpt, T.CnnWanted.of(params), path)
    pub = params.robustness.public
    if pub is None or pub.use != "replace":
        check_generated_sets(params, root)
    if pub is not None:
        check_public_sets(params, root)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
