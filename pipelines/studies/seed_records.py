"""What the main seeds' committed trial records (``<out>/trials/<name>-seed<k>/*.json``, written by `tcnn study
snapshot`) add to a study's block (pipelines.studies.study_block.markdown):

- which images played which role, as the fine-tuning recorded them (core.data.roles_text);
- how each arm started and where it ended: the T-CNN right after the reparameterization at the recorded
  alpha / lambda init (T-CNN, d'Ascoli et al. 2021, Sec. 2: "on the verge of locality" at 1), the fine-tuning
  epochs, and each arm's validation gain in its last epoch (still rising or flat);
- T-CNN - control over test images *and* seeds: the interval over seeds (pipelines.studies.run.answer) holds the
  test images fixed, so it says how much fine-tuning noise moves the answer on these images; a paired bootstrap
  over test images (core.robustness.paired_bootstrap, the evaluate stage's own) of the seeds' averaged
  per-image correctness says how far the answer carries to other images of the same distribution.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.studies.study_tables import StudyError

#: Bootstrap replicates and seed of the interval over test images (the evaluate stage's count, robustness.bootstrap).
REPLICATES = 1000
BOOTSTRAP_SEED = 0
#: The CE baseline of mCE: the CNN as imported, as in every trial of the study (robustness.baseline).
BASELINE = "cnn"


def load(trials: Path, name: str, seeds: list[int]) -> dict[int, dict[str, dict[str, str]]] | None:
    """Each main seed's finished trial record's files ({seed: {path: {"text"|"base64": ...}}}); None unless
    every seed has exactly one finished record (a study still running, or records not snapshotted here)."""
    out = {}
    for seed in seeds:
        folder = trials / f"{name}-seed{seed}"
        found = [_record(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        finished = [r["files"] for r in found if r.get("state") == "finished"]
        if len(finished) != 1:
            return None
        out[seed] = finished[0]
    return out


def _record(path: Path) -> dict[str, Any]:
    try:
        rec = json.loads(path.read_text())
    except ValueError as err:
        raise StudyError(f"{path}: not a trial record ({err})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict):
        raise StudyError(f"{path}: not a trial record (no files)")
    return rec


def _json(files: dict[str, dict[str, str]], rel: str) -> Any:
    return json.loads(files[rel]["text"])


def _parquet(files: dict[str, dict[str, str]], rel: str) -> pa.Table:
    """A recorded parquet file, read from memory on this thread: Arrow's thread pool, used on an in-memory
    source, can abort the process at exit (SIGABRT, "terminate called without an active exception"; 3-5 runs
    in 48 on this project's 2-core machines under load, none with use_threads=False; apache/arrow#34314)."""
    return pq.read_table(io.BytesIO(base64.b64decode(files[rel]["base64"])), use_threads=False)


def _val_curve(files: dict[str, dict[str, str]], stage: str) -> list[float]:
    from stages.harness import chain

    rows = csv.DictReader(io.StringIO(files[chain.output(stage, "history.csv")]["text"]))
    return [float(r["val_acc"]) for r in rows if r.get("val_acc")]


def roles(records: dict[int, dict[str, dict[str, str]]]) -> str | None:
    """The images' roles line (core.data.training_text, roles_text) when every seed recorded the same roles."""
    from core.data import roles_text, training_text
    from stages.harness import chain

    found = [_json(f, chain.output("finetune", "metrics.json")).get("data_roles") for f in records.values()]
    if not found[0] or any(r != found[0] for r in found):
        return None
    return f"{training_text(found[0])}; {roles_text(found[0])}"


def recovery(records: dict[int, dict[str, dict[str, str]]]) -> dict[str, Any]:
    """Means over seeds: the T-CNN's test accuracy, max |logit diff| and agreement with its CNN right after the
    conversion (runs/reparam/equivalence.json), each arm's validation accuracy at epoch 0 and at its last epoch,
    and its gain in that last epoch; the fine-tuning epochs and the init."""
    from stages.harness import chain

    eq = [_json(f, chain.output("reparam", "equivalence.json")) for f in records.values()]
    curves = {arm: [_val_curve(f, arm) for f in records.values()] for arm in ("finetune", "control")}
    epochs = {len(c) - 1 for arm in curves.values() for c in arm}

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs))

    return {
        "alpha_init": eq[0]["alpha_init"], "lambda_init": eq[0]["lambda_init"],
        "epochs": sorted(epochs), "cnn_test": mean([e["test_acc_cnn"] for e in eq]),
        "tcnn_test_at_reparam": mean([e["test_acc_tcnn"] for e in eq]),
        "max_logit_diff": max(e["max_abs_logit_diff"] for e in eq),
        "agreement": mean([e["prediction_agreement"] for e in eq]),
        **{f"{'tcnn' if arm == 'finetune' else arm}_val": {
            "start": mean([c[0] for c in cs]), "end": mean([c[-1] for c in cs]),
            "last_gain": mean([c[-1] - c[-2] for c in cs])} for arm, cs in curves.items()},
    }  # fmt: skip


def averaged_per_image(records: dict[int, dict[str, dict[str, str]]]) -> pa.Table:
    """The seeds' per-image tables (results/per_image.parquet) with ``correct`` averaged over seeds: every seed
    evaluates the same test images and corrupted sets, so each (model, set, image) row lines up."""
    keys = ("model", "corruption", "severity", "index")
    tables = [_parquet(f, "results/per_image.parquet") for f in records.values()]
    cols = [{k: t.column(k).cast(pa.string()) if k in ("model", "corruption") else t.column(k) for k in keys}
            for t in tables]  # fmt: skip
    if any(not all(c[k].equals(cols[0][k]) for k in keys) for c in cols[1:]):
        raise ValueError(
            "the seeds' per-image tables do not cover the same models, sets and images in one order"
        )
    correct = np.mean(
        [t.column("correct").to_numpy(zero_copy_only=False).astype(np.float64) for t in tables], 0
    )
    return pa.table({**cols[0], "correct": correct})


def over_images(records: dict[int, dict[str, dict[str, str]]]) -> dict[str, dict[str, float]]:
    """T-CNN - control of the seeds' averaged predictions ({metric: {"diff", "low", "high"}}) with its paired
    bootstrap 95% interval over test images (one draw for every model and set, the CE baseline redrawn with
    it): core.robustness.paired_bootstrap as the evaluate stage runs it on one seed."""
    from core.robustness.baseline import Baseline
    from core.robustness.metrics import flat_metrics, summarize
    from core.robustness.paired_bootstrap import bootstrap_metrics, comparisons, evaluation_rows

    per_image = averaged_per_image(records)
    table = _parquet(next(iter(records.values())), "results/robustness.parquet")
    rows = evaluation_rows(table, per_image)
    base = Baseline.from_table(pa.Table.from_pylist(rows), model=BASELINE, name=BASELINE)
    points = {m: flat_metrics(summarize(rows, base, model=m)) for m in ("cnn", "control", "tcnn")}
    samples = bootstrap_metrics(table, per_image, BASELINE, replicates=REPLICATES, seed=BOOTSTRAP_SEED)
    diffs = comparisons(points, samples, [("control", "tcnn")])["tcnn-control"]
    return {
        m: {k: float(diffs[m][k]) for k in ("diff", "low", "high")} for m in ("clean_accuracy", "mca", "mce")
    }


def evidence(trials: Path, name: str, seeds: list[int]) -> dict[str, Any] | None:
    """The three additions above for the study's main seeds, or None where their records are not all here."""
    records = load(trials, name, seeds)
    if records is None:
        return None
    try:
        return {"roles": roles(records), "recovery": recovery(records), "images": over_images(records)}
    except (KeyError, IndexError, TypeError, ValueError, pa.ArrowException) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        what = f"no {err}" if isinstance(err, KeyError) else first
        raise StudyError(
            f"{trials}/{name}-seed*: a main seed's trial record cannot give the block ({what})"
        ) from None
