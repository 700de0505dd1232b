"""StreamLoader: ImageFolder-sized images decoded and augmented per sample from encoded shards, in workers.

:class:`~core.data.loader.BatchLoader` holds a split in memory as uint8 arrays, which works at 28-32 px and
cannot at 224-320 px (ImageNet is ~140 GB of JPEGs, ~190 GB as 224 px pixels). This loader keeps the JPEG
bytes in the Parquet shards and decodes each sample when its batch is built, with the same interface as
BatchLoader (``len()`` steps, ``batches(epoch, start_step)``) so the training loop takes either.

Determinism: the epoch order comes from a generator seeded by (seed, epoch), and each sample's crop and flip
from one seeded by (seed, epoch, position in the epoch), never from a worker's global RNG. So every batch is
a pure function of (seed, epoch, step): the same for any ``num_workers``, ``batches(epoch, k)`` is the exact
tail of ``batches(epoch)``, and the ranks of a data-parallel run together yield the world-size-1 batch.

Decoder: ``torchvision.io.decode_image`` (libjpeg-turbo, bundled with torchvision) into a uint8 tensor, then
torchvision's tensor ``resized_crop``, rather than PIL decode + PIL ``RandomResizedCrop`` (the textbook
ImageFolder path): decode_image returns the pixels channels-last, which torch's vectorized uint8 antialiased
bilinear resize reads directly, where PIL's resize of a large crop is the slow half of its pipeline
(``benchmarks/loader.py`` measures the two side by side; docs/scale.md gives the figures). Formats
torchvision does not decode (BMP, TIFF, ...) fall back to PIL. The tensor and PIL resizes differ by rounding.

Shuffle and I/O locality: a row group (~4 MiB, ~32 ImageNet JPEGs) is the unit Parquet reads, so a uniformly
random permutation would read a whole group per sample. The order is block-structured instead (as
WebDataset's and MosaicML's shuffle buffers): the row groups are permuted, and samples are shuffled within
windows of ``shuffle_window`` consecutive groups of that permutation. A worker keeps the window's groups
cached, so each group is read about once per worker that touches it. The price is correlation: a batch
draws from at most ``shuffle_window`` groups. A streamed ImageFolder dataset is therefore imported with its
classes interleaved (core.data.imagefolder, ``data.stream``: every row group holds as many classes as rows),
so a batch of 256 from 1000 classes spans about as many classes as a uniform shuffle's (~226; a sorted
import gives ~32; tests/test_data_stream.py measures both). Raise the window for more mixing (memory:
window x 4 MiB per worker); ``shuffle_window=0`` is a uniform permutation.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from core.data.loader import keyed_rng
from core.data.shard_reader import read_manifest, split_entry, verify_split

_ORDER, _AUG = 10, 11  # generator streams (distinct from BatchLoader's)
CROP_PCT = 0.875  # eval: resize the shorter side to size / 0.875, centre-crop size (timm's and DeiT's recipe)


def crop_params(
    height: int, width: int, rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:  # fmt: skip
    """``(top, left, h, w)``: torchvision's ``RandomResizedCrop.get_params``, drawing from ``rng`` instead
    of torch's global generator (10 tries at a random area and log-aspect, then the central fallback)."""
    area, log_ratio = height * width, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    if width / height < min(ratio):
        w, h = width, round(width / min(ratio))
    elif width / height > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def block_order(groups: np.ndarray, rng: np.random.Generator, window: int) -> np.ndarray:
    """Positions into ``groups`` (each row's row-group id): groups permuted, rows shuffled within windows
    of ``window`` consecutive permuted groups (0: one window, a uniform permutation)."""
    uniq, inverse = np.unique(groups, return_inverse=True)
    rank = np.empty(len(uniq), np.int64)
    rank[rng.permutation(len(uniq))] = np.arange(len(uniq))
    block = rank[inverse] // window if window > 0 else np.zeros(len(groups), np.int64)
    return np.lexsort((rng.random(len(groups)), block))


class StreamLoader:
    """Batches ``(x float32 [B,C,S,S] normalized, y int64 [B])`` decoded from an encoded shard dataset.

    Args:
        data_dir, split: a prepared ImageFolder dataset (``image_encoding`` "encoded") and its split.
        batch_size: the *global* batch; rank r of ``world_size`` yields ``[r b/W, (r+1) b/W)`` of each global
            batch of b images, with the augmentation those samples get at world size 1.
        train: block-shuffled order + ``RandomResizedCrop(image_size)`` + horizontal flip; else file order +
            ``Resize(int(image_size / 0.875))`` + ``CenterCrop(image_size)``.
        seed: with (epoch, position) it fixes every random choice.
        indices: positions in the split to use (e.g. from :func:`core.data.train_val_indices`); None = all.
        mean, std: normalization (default: the manifest's).
        shuffle_window: row groups per shuffle window (see the module docstring).
        num_workers: 0 builds batches in this process; >0 in a torch DataLoader's worker processes.
        device: pinned host memory when it is a CUDA device.
    """

    def __init__(
        self, data_dir: str | Path, split: str, *, batch_size: int, train: bool, seed: int,
        image_size: int = 224, indices: Sequence[int] | np.ndarray | None = None,
        mean: Sequence[float] | None = None, std: Sequence[float] | None = None, drop_last: bool | None = None,
        shuffle_window: int = 32, num_workers: int = 0, prefetch_factor: int = 2,
        persistent_workers: bool = False, device: str | torch.device | None = None, rank: int = 0,
        world_size: int = 1, verify: bool = True,
    ) -> None:  # fmt: skip
        self.data_dir = Path(data_dir)
        manifest = read_manifest(self.data_dir)
        entry = split_entry(manifest, split, self.data_dir)
        if manifest["image_encoding"] != "encoded":
            raise ValueError(f"{self.data_dir}: {manifest['image_encoding']!r} images; use BatchLoader")
        if batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size > 0 and 0 <= rank < world_size, got {batch_size}, {rank}")
        if train and batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
        n = int(entry["num_rows"])
        rows = np.arange(n) if indices is None else np.asarray(indices, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise ValueError(f"indices outside 0..{n - 1} of split {split!r}")
        if verify:
            verify_split(self.data_dir, split, manifest)
        self.rows, self.batch_size, self.train, self.seed = rows, int(batch_size), bool(train), int(seed)
        self.image_size, self.shuffle_window = int(image_size), int(shuffle_window)
        self.drop_last = self.train if drop_last is None else bool(drop_last)
        self.rank, self.world_size = int(rank), int(world_size)
        if len(rows) == 0:  # fewer images than a batch is len() == 0, as for BatchLoader: the stage says so
            raise ValueError(f"{self.data_dir}: split {split!r}: no images selected")
        self.gray = manifest.get("image_mode", "RGB") == "L"
        c = 1 if self.gray else 3
        mean_a = np.asarray(manifest["mean"] if mean is None else mean, np.float32).reshape(-1, 1, 1)
        std_a = np.asarray(manifest["std"] if std is None else std, np.float32).reshape(-1, 1, 1)
        if len(mean_a) != c or len(std_a) != c:
            raise ValueError(f"mean/std need {c} channel values, got {len(mean_a)}/{len(std_a)}")
        self._scale, self._shift = 1.0 / (255.0 * std_a), -mean_a / std_a  # x = u8 * scale + shift
        # every row group of the split: (file, group in file) and its first row, from the footers only
        self.files = [self.data_dir / r["name"] for r in entry["files"]]
        groups, starts, start = [], [], 0
        for f, path in enumerate(self.files):
            md = pq.read_metadata(path)
            for g in range(md.num_row_groups):
                groups.append((f, g))
                starts.append(start)
                start += md.row_group(g).num_rows
        self.groups, self.group_starts = groups, np.asarray(starts, np.int64)
        self.num_workers, self.prefetch_factor = int(num_workers), int(prefetch_factor)
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        self.pin = device is not None and torch.device(device).type == "cuda"
        self._handles: dict[int, pq.ParquetFile] = {}
        self._cache: OrderedDict[int, tuple[list[bytes], np.ndarray]] = OrderedDict()
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._loader: torch.utils.data.DataLoader | None = None

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own files
        return {**self.__dict__, "_handles": {}, "_cache": OrderedDict(), "_loader": None}

    def __len__(self) -> int:
        n, b = len(self.rows), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's rows (positions in the split): block-shuffled by (seed, epoch) when training."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = self.rows
        if self.train:
            group_of = np.searchsorted(self.group_starts, self.rows, side="right") - 1
            order = self.rows[block_order(group_of, keyed_rng(self.seed, _ORDER, epoch), self.shuffle_window)]
        self._order_cache = (epoch, order)
        return order

    def augment_params(self, epoch: int, position: int, height: int, width: int) -> tuple[int, ...]:
        """``(top, left, h, w, flip)`` of the sample at ``position`` in ``epoch`` (training only)."""
        rng = keyed_rng(self.seed, _AUG, epoch, position)
        return (*crop_params(height, width, rng), int(rng.random() < 0.5))

    def _row(self, row: int) -> tuple[bytes, int]:
        gid = int(np.searchsorted(self.group_starts, row, side="right")) - 1
        if gid not in self._cache:
            f, g = self.groups[gid]
            if f not in self._handles:
                self._handles[f] = pq.ParquetFile(self.files[f])
            t = self._handles[f].read_row_group(g, columns=["image", "label"])
            self._cache[gid] = (t.column("image").to_pylist(), t.column("label").to_numpy())
            while len(self._cache) > max(1, self.shuffle_window):
                self._cache.popitem(last=False)
        self._cache.move_to_end(gid)
        images, labels = self._cache[gid]
        local = row - int(self.group_starts[gid])
        return images[local], int(labels[local])

    def decode(self, data: bytes) -> torch.Tensor:
        """uint8 [C,H,W]: torchvision's decoder, PIL for the formats it does not read."""
        from torchvision.io import ImageReadMode, decode_image  # here: torchvision costs ~1 s to import

        try:
            mode = ImageReadMode.GRAY if self.gray else ImageReadMode.RGB
            return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
        except RuntimeError:
            from PIL import Image

            with Image.open(io.BytesIO(data)) as img:
                arr = np.asarray(img.convert("L" if self.gray else "RGB"))
            return torch.from_numpy(arr.reshape(*arr.shape[:2], -1).copy()).permute(2, 0, 1)

    def transform(self, img: torch.Tensor, epoch: int, position: int) -> torch.Tensor:
        """The sample's uint8 [C,S,S] crop: random resized crop + flip (train) or resize + centre crop."""
        from torchvision.transforms.v2 import functional as TF

        s = self.image_size
        if not self.train:
            return TF.center_crop(TF.resize(img, [int(s / CROP_PCT)], antialias=True), [s, s])
        top, left, h, w, flip = self.augment_params(epoch, position, *img.shape[-2:])
        out = TF.resized_crop(img, top, left, h, w, [s, s], antialias=True)
        return TF.horizontal_flip(out) if flip else out

    def batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of batch ``step`` of ``epoch``: a pure function of (seed, epoch, step)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} outside 0..{len(self) - 1}")
        order = self.order(epoch)
        start = step * self.batch_size
        b = min(self.batch_size, len(order) - start)
        lo, hi = start + self.rank * b // self.world_size, start + (self.rank + 1) * b // self.world_size
        x = torch.empty(hi - lo, 1 if self.gray else 3, self.image_size, self.image_size, dtype=torch.uint8)
        y = torch.empty(hi - lo, dtype=torch.int64)
        for i, pos in enumerate(range(lo, hi)):
            data, y[i] = self._row(int(order[pos]))
            x[i] = self.transform(self.decode(data), epoch, pos)
        out = torch.empty(x.shape, dtype=torch.float32)
        if torch.utils.data.get_worker_info() is not None:
            out.share_memory_()  # as default_collate does: sent to the main process without another copy
        xf = out.numpy()  # NumPy: faster than torch's float().mul_().add_() on one thread
        np.multiply(x.numpy(), self._scale, out=xf)
        xf += self._shift
        return out, y

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the batches of ``epoch`` from ``start_step`` on (exact resume: the same as an unbroken run)."""
        if not 0 <= start_step <= len(self):
            raise ValueError(f"start_step {start_step} outside 0..{len(self)}")
        if self.num_workers == 0:
            for step in range(start_step, len(self)):
                x, y = self.batch(epoch, step)
                yield (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)
            return
        loader = self._loader or self._data_loader()
        loader.sampler[:] = [(epoch, k) for k in range(start_step, len(self))]  # in place: it may persist
        self._loader = loader if self.persistent_workers else None
        yield from loader

    def _data_loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            _Batches(self), batch_size=None, sampler=[], num_workers=self.num_workers,
            pin_memory=self.pin, prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers, worker_init_fn=_one_thread,
            generator=torch.Generator().manual_seed(self.seed),  # not torch's global RNG (drop-path draws)
        )  # fmt: skip


def _one_thread(_: int) -> None:
    """Each worker decodes one image at a time: torch's intra-op threads would only oversubscribe the cores.
    File handles inherited through fork are dropped: each worker opens its own."""
    torch.set_num_threads(1)
    info = torch.utils.data.get_worker_info()
    if info is not None:
        info.dataset.loader._handles = {}


class _Batches(torch.utils.data.Dataset):
    """Item (epoch, step) is a whole batch: a worker builds it (its order and row groups are cached)."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.batch(*key)
