"""The evaluate stage's models and sets, checked and evaluated: which checkpoints it compares
(:func:`model_paths`), on which corrupted sets (:func:`suites`: the corrupt stage's, a published benchmark's)
and with which clean split and options (:func:`bench`, core.robustness.bench), each model's counts and
per-image tables (:func:`evaluate_models`), the pretrained CNN's shared by identity in a sweep
(stages.cnn_evaluation), and the checks `stages.evaluate.check` runs on the sets before any model does (a published
benchmark's: stages.published_check).

Every model is evaluated on the same images at one resolution, so each difference between two models is paired
image by image ([TCNN21] Fig. 3). Failures are `StageError`s that name the param to fix.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core.config import Params
from core.data import DataError, read_manifest
from core.data.shard_reader import load_labels
from core.data.splits import capped_test_positions, load_test
from core.robustness.bench import Bench, Suite, example_batch
from core.robustness.evaluation import array_batches, evaluate_model, predictions
from core.training.checkpoint import CheckpointError, load_model
from core.training.environment import select_device
from core.training.inference import inference_model
from stages import cnn_evaluation
from stages.harness import chain
from stages.harness import training as T
from stages.harness.fine_tuning import control_checkpoint, control_disabled_reason
from stages.harness.runner import StageError

#: The models' names in logs and plots.
LABELS = {"cnn": "pretrained CNN", "control": "control (CNN fine-tuned, no attention)", "tcnn": "T-CNN"}


def model_paths(params: Params, root: Path) -> dict[str, Path]:
    """The checkpoints of the models this config compares, in report order (stages.evaluate's docstring)."""
    paths = {
        "cnn": root / chain.output("pretrain", "cnn-final.pt"),
        "control": control_checkpoint(root),
        "tcnn": root / chain.output("finetune", "tcnn-final.pt"),
    }
    if control_disabled_reason(params) is not None:
        del paths["control"]
    return paths


def suites(params: Params, root: Path, n_clean: int) -> tuple[Suite, Suite | None]:
    """(the suite the main results come from, the published suite evaluated next to it or None)."""
    from core.robustness.public_sets import PublicSets

    rob = params.robustness
    generated = Suite("generated", root / rob.dir, tuple(rob.corruptions), tuple(rob.severities))
    pub = rob.public
    if pub is None:
        return generated, None
    try:
        sets = PublicSets(pub.kind, root / pub.dir, params.public_images(), n_clean)
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


def bench(params: Params, root: Path) -> Bench:
    """The :class:`Bench` of this config: the test split of ``root / data.dir`` (its test half under
    ``data.val_from: test_half``; capped at ``data.limit.test``), the device TCNN_DEVICE names."""
    try:
        manifest = read_manifest(root / params.data.dir)
        images, labels = load_test(root / params.data.dir, params.data.caps(), val_from=params.data.val_from)
        cap = capped_test_positions(load_labels(root / params.data.dir, "test"), val_from=params.data.val_from,
                                    limit=params.data.caps())  # fmt: skip
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(str(err)) from None
    norm = T.input_normalization(params) or {"mean": manifest["mean"], "std": manifest["std"]}
    device = select_device()  # env TCNN_DEVICE, else CUDA when available
    return Bench(
        images, labels, manifest, params.test_image_size(), norm, params.robustness.batch_size, device, cap
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
        # the whole split (a published set's positions)
        n_test = int(b.manifest["splits"]["test"]["num_rows"])
        suites_ = [s for s in suites(params, root, n_test) if s is not None]
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
    return inference_model(model, example_batch(b.images, b.norm, b.size, min(b.batch_size, len(b.images))))


def generated_index(b: Bench, suite: Suite) -> Any:
    """Where the clean images sit in the split the corrupt stage's sets index (a ``data.limit`` cap;
    :attr:`Bench.clean_index`): the generated suite's pairing. A published suite indexes its own positions
    (core.robustness.public_sets)."""
    return b.clean_index if suite.name == cnn_evaluation.SUITE else None


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
                batch_size=b.batch_size, model_name=name, per_image=True, clean_index=generated_index(b, suite), **b.options(),
            )  # fmt: skip
        except (FileNotFoundError, ValueError) as err:  # a missing or damaged (checksum) set: says what to do
            where = "robustness.dir" if suite.name == "generated" else "robustness.public"
            raise StageError(f"{where}: {err}") from None
        n = sum(out[suite.name][0].column("n").to_pylist())
        dt = time.perf_counter() - t0
        print(f"evaluate: {name}: {n} images in {dt:.1f} s ({n / max(dt, 1e-9):.0f} img/s)")
    return out


def check_generated_sets(params: Params, root: Path = Path(".")) -> None:
    """Every corrupted set evaluate will read was made for these params: as many images as
    ``robustness.n_images`` asks for (capped at ``data.limit.test``), with this config's corruption seed (the sets' stored metadata, read
    without the images; their checksums are verified where the images are read)."""
    from core.robustness.corruption_store import read_set_meta, set_path

    rob = params.robustness
    for c in rob.corruptions:
        for sev in rob.severities:
            path = set_path(root / rob.dir, c, sev)
            meta = read_set_meta(path)
            if meta is None:
                raise StageError(f"robustness.dir: {path} is missing or damaged (run the corrupt stage)")
            n = params.corrupted_images()
            if meta.get("n") != n or meta.get("seed") != params.cnn_seed:
                raise StageError(
                    f"robustness.dir: {path} holds {meta.get('n')} images of seed {meta.get('seed')}; the params "
                    f"ask for {n} of seed {params.cnn_seed} (run the corrupt stage)"
                )
