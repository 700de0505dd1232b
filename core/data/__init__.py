"""Data: importers into Parquet shards + manifest, class-balanced splits and fractions, batch loaders.

Layer: imports ``core.utils`` only. Public API (re-exported here): what the stages and tools call.
"""

from core.data.datasets import Datasets, first_batch, load_datasets, make_loader, manifest_fingerprint
from core.data.imagefolder import import_imagefolder
from core.data.importers import (
    DATASETS,
    MANIFEST,
    DataError,
    ImportResult,
    atomic_output_dir,
    import_cifar,
    import_dataset,
    import_fashion_mnist,
    parse_idx,
)
from core.data.loader import BatchLoader, Mixing
from core.data.splits import (
    ShardDataset,
    Splits,
    fraction_indices,
    load_labels,
    load_split,
    load_splits,
    read_manifest,
    split_train_val,
    train_val_indices,
    verify_split,
)
from core.data.stream import StreamLoader

__all__ = [
    "DATASETS", "MANIFEST", "BatchLoader", "DataError", "Datasets", "ImportResult", "ShardDataset", "Splits",
    "Mixing", "StreamLoader", "load_labels",
    "atomic_output_dir", "first_batch", "fraction_indices", "import_cifar", "import_dataset",
    "import_fashion_mnist", "import_imagefolder", "load_datasets", "load_split", "load_splits", "make_loader",
    "manifest_fingerprint", "parse_idx", "read_manifest", "split_train_val", "train_val_indices", "verify_split",
]  # fmt: skip
