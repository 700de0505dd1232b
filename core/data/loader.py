"""BatchLoader: augmented, normalized batches from in-memory uint8 arrays, resumable at any step.

Every batch is a pure function of (seed, epoch, step): the epoch's order comes from a generator seeded by
(seed, epoch), and each augmentation of step k draws from its own generator seeded by (seed, epoch, k,
stream). So ``batches(epoch, start_step=k)`` yields exactly the tail of ``batches(epoch)`` (exact resume),
and the result does not depend on the number of workers.

Why batch-level, hand-vectorized augmentation instead of torchvision's per-sample transforms: a random
crop with zero padding followed by a horizontal flip is one gather per batch here, ``padded[b, dy_b + i,
dx_b + j]`` with the column order reversed for flipped samples; this equals torchvision's
``RandomCrop(size, padding=p, fill=0)`` + ``RandomHorizontalFlip()`` sample by sample (tested) but costs a
few milliseconds per 256 images instead of a Python call chain per image, which is what lets the loader
outrun training by a wide margin on 2 cores. RandAugment (timm, PIL ops) stays per sample and only runs
when configured. Mixup/CutMix follow timm's ``Mixup(mode="batch", prob=1, switch_prob=0.5,
correct_lam=True)`` and use timm's ``mixup_target``; they are re-implemented only to draw lambda and the box
from the (seed, epoch, step) generator: timm's class draws from NumPy's global RNG and rejects odd batches.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the type only: data sits below the config in core's layers
    from core.config import AugmentConfig

_ORDER, _CROP, _RANDAUG, _MIX = 0, 1, 2, 3  # generator streams


def keyed_rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in keys])


@contextlib.contextmanager
def _global_rng_seeded(seed: int) -> Iterator[None]:
    """Seed Python's and NumPy's global RNGs (timm's RandAugment uses them), restoring both afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _posterize_safe(img: Any, bits_to_keep: int, **_: Any) -> Any:
    """timm's posterize, valid for 0 bits: Pillow >= 11 rejects ``ImageOps.posterize(img, 0)``, which
    timm's "inc1" RandAugment asks for at magnitude 10 (reached through ``mstd`` noise); keeping 0 bits
    is a black image, as older Pillow returned."""
    from PIL import Image, ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size, 0)
    return ImageOps.posterize(img, bits_to_keep)


def build_randaugment(spec: str, image_size: int, mean: Sequence[float]) -> Any:
    """timm's RandAugment for ``spec`` (e.g. "rand-m9-mstd0.5-inc1"), filling with the dataset mean."""
    from timm.data.auto_augment import rand_augment_transform

    hparams = {"translate_const": int(image_size * 0.45), "img_mean": tuple(round(255 * m) for m in mean)}
    try:
        transform = rand_augment_transform(spec, hparams)
    except (AssertionError, ValueError, KeyError) as err:
        raise ValueError(f"augment.randaugment: invalid RandAugment spec {spec!r} ({err})") from None
    for op in transform.ops:
        if op.name.startswith("Posterize"):
            op.aug_fn = _posterize_safe
    return transform


def crop_flip(x: np.ndarray, pad: int, dy: np.ndarray, dx: np.ndarray, flip: np.ndarray) -> np.ndarray:
    """Per-sample crop of the zero-padded batch at offsets (dy, dx) in [0, 2 pad], then optional h-flip.

    ``x`` is uint8 [B,H,W,C]; equals torchvision's pad(p, fill 0) -> crop(dy, dx, H, W) -> hflip per sample.
    """
    b, h, w, _ = x.shape
    if pad:
        xp = np.zeros((b, h + 2 * pad, w + 2 * pad, x.shape[3]), x.dtype)
        xp[:, pad : pad + h, pad : pad + w] = x
    else:
        xp = x
    rows = dy[:, None] + np.arange(h)
    cols = dx[:, None] + np.arange(w)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    return xp[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def mix_batch(
    x: torch.Tensor, y: torch.Tensor, rng: np.random.Generator, *, mixup: float, cutmix: float,
    num_classes: int, smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, float]:  # fmt: skip
    """Mixup (Zhang et al.) or CutMix (Yun et al.) of the batch with its reverse, one lambda per batch.

    Same rule as timm's batch-mode Mixup: with both enabled, CutMix with probability 1/2; lambda ~
    Beta(alpha, alpha); the CutMix box has area (1 - lambda) H W, clipped at the border, and lambda is
    corrected to the clipped area. Targets: ``timm.data.mixup.mixup_target`` (label smoothing included).
    Returns (x, soft targets [B, num_classes], lambda); modifies ``x`` in place.
    """
    from timm.data.mixup import mixup_target

    use_cutmix = cutmix > 0 and (mixup <= 0 or rng.random() < 0.5)
    alpha = cutmix if use_cutmix else mixup
    lam = float(rng.beta(alpha, alpha))
    if use_cutmix:
        h, w = x.shape[-2:]
        ratio = np.sqrt(1.0 - lam)
        cut_h, cut_w = int(h * ratio), int(w * ratio)
        cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
        yl, yh = int(np.clip(cy - cut_h // 2, 0, h)), int(np.clip(cy + (cut_h + 1) // 2, 0, h))
        xl, xh = int(np.clip(cx - cut_w // 2, 0, w)), int(np.clip(cx + (cut_w + 1) // 2, 0, w))
        x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
        lam = 1.0 - (yh - yl) * (xh - xl) / float(h * w)
    else:
        partner = x.flip(0).mul_(1.0 - lam)  # flip() copies: taken before x is scaled in place
        x.mul_(lam).add_(partner)
    return x, mixup_target(y, num_classes, lam, smoothing), lam


def mix_step(
    x: torch.Tensor, y: torch.Tensor, aug: AugmentConfig, num_classes: int, seed: int, epoch: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured Mixup/CutMix of batch `step` of `epoch`, drawn from the (seed, epoch, step) generator."""
    x, y, _ = mix_batch(x, y, keyed_rng(seed, _MIX, epoch, step), mixup=aug.mixup, cutmix=aug.cutmix,
                        num_classes=num_classes, smoothing=aug.label_smoothing)  # fmt: skip
    return x, y


class BatchLoader:
    """Batches ``(x float32 [B,C,S,S] normalized, y int64 [B] | soft targets [B,K])`` from uint8 arrays.

    Args:
        images: uint8 [N,H,W,C] (numpy or torch), e.g. from :func:`core.data.load_split`.
        labels: int [N].
        batch_size: images per batch.
        train: shuffle each epoch and augment (eval: file order, no augmentation, no mixing).
        seed: the experiment seed; with (epoch, step) it fixes every random choice.
        mean, std: per-channel normalization in [0, 1] units (the manifest's ``mean``/``std``).
        augment: crop padding, flip, RandAugment, mixup/cutmix, label smoothing (used only with mixing;
            without mixing, targets stay integers and the loss applies label smoothing). None = no aug.
        image_size: output side; resized (bilinear, antialiased when shrinking) after augmentation when it
            differs from the stored size, e.g. for higher-resolution fine-tuning ([TCNN21], Sec. 3).
        drop_last: drop the last incomplete batch (default: ``train``).
        num_workers: 0 (default) builds batches in this process; >0 uses a torch DataLoader over steps.
        num_classes: for soft targets (default: ``labels.max() + 1``).
        rank, world_size: data-parallel sharding. ``batch_size`` stays the *global* batch and the steps per
            epoch do not change; rank r yields the slice ``[r B/W, (r+1) B/W)`` of each global batch, with
            the crops and flips that sample gets at world size 1, so the ranks' shards together are exactly
            the single-process batch (the data order depends on the seed only). Mixup/CutMix pair samples
            within a shard (as timm does per rank), so with mixing the shards are not the 1-rank batch.
    """

    def __init__(
        self, images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor, *, batch_size: int,
        train: bool, seed: int, mean: Sequence[float], std: Sequence[float],
        augment: AugmentConfig | None = None, image_size: int | None = None, drop_last: bool | None = None,
        num_workers: int = 0, num_classes: int | None = None, rank: int = 0, world_size: int = 1,
    ) -> None:  # fmt: skip
        images = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
        labels = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 [N,H,W,C], got {images.dtype} {images.shape}")
        if labels.shape != (len(images),):
            raise ValueError(f"labels must be [N={len(images)}], got {labels.shape}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        if train and batch_size % world_size:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by the {world_size} data-parallel workers"
            )
        c = images.shape[3]
        if len(mean) != c or len(std) != c:
            raise ValueError(f"mean/std need {c} channel values, got {len(mean)}/{len(std)}")
        self.images, self.labels = images, labels.astype(np.int64, copy=False)
        self.batch_size, self.train, self.seed = int(batch_size), bool(train), int(seed)
        self.augment = augment if train else None
        self.drop_last = self.train if drop_last is None else bool(drop_last)
        self.num_workers = int(num_workers)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_classes = (
            int(num_classes) if num_classes is not None else int(self.labels.max(initial=-1)) + 1
        )
        self.stored_size = images.shape[1:3]
        self.image_size = int(image_size) if image_size is not None else None
        self.mean = tuple(float(m) for m in mean)
        std_a = np.asarray(std, np.float64).reshape(1, c, 1, 1)
        self._scale = (1.0 / (255.0 * std_a)).astype(np.float32)  # x_norm = x_uint8 * scale + shift
        self._shift = (-np.asarray(mean, np.float64).reshape(1, c, 1, 1) / std_a).astype(np.float32)
        aug = self.augment
        self._randaug = (
            build_randaugment(aug.randaugment, max(self.stored_size), self.mean)
            if aug and aug.randaugment
            else None
        )
        self._mixing = bool(aug and (aug.mixup > 0 or aug.cutmix > 0))
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        n, b = len(self.images), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order: a permutation seeded by (seed, epoch) when training, else 0..N-1."""
        cached = self._order_cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = len(self.images)
        order = keyed_rng(self.seed, _ORDER, epoch).permutation(n) if self.train else np.arange(n)
        order.setflags(write=False)
        self._order_cache = (epoch, order)
        return order

    def batch(
        self, epoch: int, step: int, order: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``epoch``: a pure function of (seed, epoch, step)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} outside 0..{len(self) - 1}")
        order = self.order(epoch) if order is None else order
        idx = order[step * self.batch_size : (step + 1) * self.batch_size]
        b = len(idx)  # the global batch: random draws are made for all of it, then this rank's slice kept
        mine = slice(self.rank * b // self.world_size, (self.rank + 1) * b // self.world_size)
        x = self.images[idx[mine]]
        y = torch.from_numpy(self.labels[idx[mine]])
        aug = self.augment
        if aug is not None and (aug.crop_padding > 0 or aug.hflip):
            rng = keyed_rng(self.seed, _CROP, epoch, step)
            p = aug.crop_padding
            dy, dx = rng.integers(0, 2 * p + 1, size=(2, b))
            flip = rng.random(b) < 0.5 if aug.hflip else np.zeros(b, bool)
            x = crop_flip(x, p, dy[mine], dx[mine], flip[mine])
        if self._randaug is not None:
            seeds = keyed_rng(self.seed, _RANDAUG, epoch, step).integers(0, 1 << 63, size=b)
            x = self._apply_randaugment(x, seeds[mine])
        # uint8 -> normalized float32 in NumPy: single-threaded and predictable, it leaves torch's threads
        # to the training step (torch's threaded elementwise ops slow down under contention; benchmarks/loader.py).
        xf = x.transpose(0, 3, 1, 2).astype(np.float32)
        xf *= self._scale
        xf += self._shift
        t = torch.from_numpy(xf)
        if self.image_size is not None and (self.image_size, self.image_size) != tuple(self.stored_size):
            shrink = self.image_size < min(self.stored_size)
            t = F.interpolate(
                t, size=(self.image_size,) * 2, mode="bilinear", align_corners=False, antialias=shrink
            )
        if self._mixing:
            assert aug is not None
            t, y = mix_step(t, y, aug, self.num_classes, self.seed, epoch, step)
        return t, y

    def _apply_randaugment(self, x: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        from PIL import Image

        out = np.empty_like(x)
        gray = x.shape[3] == 1
        for i in range(len(x)):
            img = Image.fromarray(x[i, :, :, 0] if gray else x[i], "L" if gray else "RGB")
            with _global_rng_seeded(int(seeds[i])):
                img = self._randaug(img)
            out[i] = np.asarray(img).reshape(out.shape[1:])
        return out

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the batches of ``epoch`` from ``start_step`` on (exact resume: the same as an unbroken run)."""
        if not 0 <= start_step <= len(self):
            raise ValueError(f"start_step {start_step} outside 0..{len(self)}")
        if self.num_workers == 0:
            order = self.order(epoch)
            for step in range(start_step, len(self)):
                yield self.batch(epoch, step, order)
            return
        loader = torch.utils.data.DataLoader(
            _EpochSteps(self, epoch), batch_size=None, sampler=range(start_step, len(self)),
            num_workers=self.num_workers, persistent_workers=False,
            generator=torch.Generator().manual_seed(self.seed),  # not torch's global RNG (drop-path draws)
        )  # fmt: skip
        yield from loader


class Mixing:
    """Mixup/CutMix over the batches of another loader (e.g. core.data.stream.StreamLoader), drawn from the
    (seed, epoch, step) generator exactly as BatchLoader mixes its own batches."""

    def __init__(self, loader: Any, augment: AugmentConfig, num_classes: int, seed: int) -> None:
        self.loader, self.augment, self.num_classes, self.seed = loader, augment, num_classes, seed

    def __len__(self) -> int:
        return len(self.loader)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step, (x, y) in enumerate(self.loader.batches(epoch, start_step), start_step):
            yield mix_step(x, y, self.augment, self.num_classes, self.seed, epoch, step)


class _EpochSteps(torch.utils.data.Dataset):
    """Dataset whose item k is batch k of one epoch (DataLoader workers build whole batches)."""

    def __init__(self, loader: BatchLoader, epoch: int) -> None:
        self.loader, self.epoch = loader, epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.batch(self.epoch, step)  # the epoch's order is cached per worker
