"""Stage `prepare`: import ``data.name`` from ``data.source`` into Parquet shards + manifest at ``data.dir``.

    python -m stages.prepare [--params params.yaml] [-S data.shard_rows=5000]

The import is skipped when ``data.dir`` already holds this exact import (same source fingerprint, shards
verified); DVC removes outs before running anyway, but direct calls and Ray trials benefit. The training
fraction and validation split are not applied here: they are chosen when loading
(``core.data.train_val_indices``), so a sweep over ``data.sample_fraction`` reuses one prepared dataset.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from core.config import Params
from core.data import DataError, import_dataset
from stages.harness.runner import StageError, stage_main


def _progress_bar() -> tuple[Any, Any]:
    """A rich progress bar (to stderr) and the callback the importers call as they advance."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("prepare: {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=False,
    )  # fmt: skip
    tasks: dict[str, Any] = {}

    def update(task: str, done: int, total: int) -> None:
        if task not in tasks:
            tasks[task] = bar.add_task(task, total=total)
        bar.update(tasks[task], completed=done, total=total)

    return bar, update


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Import the configured dataset into ``root / data.dir``; returns counts (images per split) and timing."""
    data = params.data
    out = Path(root) / data.dir
    bar, update = _progress_bar()
    try:
        with bar:
            result = import_dataset(
                data.name, data.source, out, shard_rows=data.shard_rows, progress=update,
                order="interleaved" if data.stream else "sorted",  # streamed batches then mix classes
            )  # fmt: skip
    except DataError as err:
        raise StageError(str(err)) from None
    m = result.manifest
    counts = {split: int(entry["num_rows"]) for split, entry in m["splits"].items()}
    state = "up to date, skipped" if result.skipped else f"imported in {result.seconds:.1f} s"
    shape = "x".join(str(s) for s in m["image_shape"]) if m.get("image_shape") else "variable"
    print(
        f"prepare: {m['dataset']} -> {out} ({state}): "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + f" images, {m['num_classes']} classes, {shape}, mean {m['mean']} std {m['std']}"
    )
    return {
        "dataset": m["dataset"],
        **{f"{k}_images": v for k, v in counts.items()},
        "num_classes": m["num_classes"],
        "skipped": result.skipped,
        "seconds": round(result.seconds, 3),
    }


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: data.dir may be (re)written, and an archive source reads to its end."""
    from core.data.imagefolder import check_archive
    from core.data.importers import check_output_dir

    try:
        check_output_dir(Path(root) / params.data.dir)
        if params.data.name == "imagefolder" and params.data.source is not None:
            check_archive(Path(params.data.source))
    except DataError as err:
        raise StageError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    return stage_main("prepare", run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
