"""Data: importers into Parquet shards + manifest, class-balanced splits and fractions, batch loaders.

Layer: imports ``core.utils`` only. Public API: what the stages and tools call, importable from here
(``from core.data import load_split``) and loaded from its submodule on first use, so that importing this
package loads nothing heavy (the configuration reads `core.data.catalog`'s names without numpy or torch).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Datasets", "first_batch", "load_datasets", "make_loader"), "core.data.datasets"),
    "DATASETS": "core.data.catalog",
    "import_imagefolder": "core.data.imagefolder",
    **dict.fromkeys(("MANIFEST", "DataError", "ImportResult", "atomic_output_dir", "import_cifar",
                     "import_dataset", "import_fashion_mnist", "parse_idx"), "core.data.importers"),
    **dict.fromkeys(("BatchLoader", "Mixing"), "core.data.loader"),
    **dict.fromkeys(("ShardDataset", "load_labels", "load_split", "manifest_fingerprint", "read_manifest",
                     "verify_split"), "core.data.shard_reader"),
    **dict.fromkeys(("SplitPlan", "Splits", "VAL_FROM", "capped_test_positions", "fraction_indices", "half_split",
                     "load_splits", "plan_splits", "positions_of_test", "role_of_test", "roles_text", "split_roles",
                     "split_train_val", "training_text", "train_val_indices"), "core.data.splits"),
    "StreamLoader": "core.data.stream",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'core.data' has no attribute {name!r}")
