"""How fast does evaluate run the T-CNN ([TCNN21] Sec. 2: the last stage's 3x3 convs as GPSA, Eq. 7), and is
the fast form the same function? Evaluation img/s of the T-CNN in its old form (eager, channels-last: what
core/training/inference.py ``inference_model`` used to pick for a model with GPSA layers) against the form it
picks now, and against the CNN's picked form, side by side in interleaved rounds (ratio = median of the
per-round ratios), then how many predictions of the new form equal the eager model's.

    .venv/bin/python benchmarks/tcnn_eval.py [--arch resnet12_cifar_os16] [--rounds 7] [--threads 2]
    .venv/bin/python benchmarks/tcnn_eval.py --arch core.models.he_cifar:resnet20 \
        --weights ../shared/pretrained/resnet20-12fca82f.th --data ../shared/datasets/cifar10-jpeg.tar.gz [--bf16]

Without ``--weights`` the networks are randomly initialised (seed 0); with ``--data`` (the CIFAR-10 JPEG
archive) the inputs are its test images, else Gaussian noise. The T-CNN is `to_tcnn` of the CNN at the paper's
init alpha = lambda = 1 (``--alpha``). Compare ratios from one run on one machine; the CPU is printed.

``--bf16`` (needs ``--weights`` and ``--data``): the share of images whose top-1 prediction under bf16
autocast equals the fp32 one, for the released CIFAR-10 ResNet-20 (He et al. 2016), its T-CNN at
alpha = lambda = 1 (paper init) and at alpha = lambda = 50 (the conv to float precision), on the clean test
split and a few corrupted sets, and bf16's eval speed against fp32. Evaluation stays fp32 unless bf16 agrees
on at least 99.9% of the images of every model and set AND is faster. Measured (AMD EPYC, Zen 3: AVX2, no
native bf16; 2 threads; clean: the 10,000 test images; corrupted: 2,000 each of gaussian_noise-5,
motion_blur-3, fog-3, contrast-5), bf16 == fp32 on:

    CNN                     clean 99.56%   corrupted 98.85-99.45%
    T-CNN alpha=lambda=1    clean 99.23%   corrupted 99.10-99.55%
    T-CNN alpha=lambda=50   clean 99.56%   corrupted 98.85-99.45%  (the CNN's counts)

all below the bar, and bf16 autocast ran at 0.13-0.25x the fp32 speed of the same eager channels-last form
(oneDNN has no bf16 kernels for that CPU: it falls back to slow_conv2d). So evaluation stays fp32; there is no
bf16 evaluation option.

Measured (AMD EPYC, AVX2, 2 threads; resnet12_cifar_os16 at the paper's init, batch 500, 5 interleaved rounds,
Gaussian inputs): inference_model picks the traced, frozen graph in sub-batches of 64 for the T-CNN (of 128 for
the CNN); T-CNN 164 -> 355 img/s, x2.17 (the T-CNN at 0.25x -> 0.52x the CNN's 702 img/s); predictions equal
to the eager T-CNN's on 10,000 / 10,000 images (max |logit difference| 4.5e-08). Choosing the form took 66 s
(T-CNN) and 28 s (CNN) once per evaluate run.

Why the new form is faster (torch.profiler on the study network, batch 500): the old form ran eager with batch
norm unfolded; the traced, frozen graph folds it and packs the weights, and in sub-batches of a few dozen
images the [heads, L, L] attention maps and activations stay in cache (at 500 images one GPSA layer's
attention is 74 MB, which every softmax / mix / matmul pass re-reads from memory).
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from core.models.conversion import to_tcnn
from core.models.factory import build
from core.training.inference import _ChannelsLast, inference_model
from core.utils.machine import cpu_model

#: He et al.'s released CIFAR-10 ResNets expect ImageNet statistics (../shared/pretrained/README.md).
RELEASE_NORM = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
RESNET20_SHA256 = "12fca82f0bebc4135bf1f32f6e3710e61d5108578464b84fd6d7f5c1b04036c8"
#: Corrupted sets of the --bf16 check (core.robustness, CIFAR band): noise, blur, weather, digital.
BF16_SETS = (("gaussian_noise", 5), ("motion_blur", 3), ("fog", 3), ("contrast", 5))


def test_images(archive: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` test images (uint8 [n, 32, 32, 3], evenly spaced over the class-sorted split) and their labels,
    read from the ImageFolder archive (``test/<class>/<image>.jpg``)."""
    from PIL import Image

    files: dict[str, bytes] = {}
    with tarfile.open(archive, mode="r|*") as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            if m.isfile() and name.startswith("test/") and (fh := tar.extractfile(m)) is not None:
                files[name] = fh.read()
    names = sorted(files)
    classes = sorted({p.split("/")[1] for p in names})
    pick = np.linspace(0, len(names) - 1, min(n, len(names))).round().astype(int)
    images = np.stack([np.asarray(Image.open(io.BytesIO(files[names[i]])).convert("RGB")) for i in pick])
    labels = np.array([classes.index(names[i].split("/")[1]) for i in pick])
    return images, labels


def to_input(images: np.ndarray, norm: tuple = RELEASE_NORM) -> torch.Tensor:
    """uint8 [N, H, W, C] -> the normalised float batch [N, C, H, W] (as core.robustness feeds the models)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in norm)
    return ((x - mean) / std).contiguous()


def load_cnn(arch: str, weights: Path | None) -> torch.nn.Module:
    """The CNN ``arch``: random (seed 0), or with the released weights at ``weights`` (sha256-checked)."""
    torch.manual_seed(0)
    model = build("cnn", arch, 10)
    if weights is not None:
        from core.models.importing import read_weights

        missing, unexpected = model.load_state_dict(read_weights(weights, RESNET20_SHA256), strict=False)
        if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):  # the release has none
            raise SystemExit(f"{weights}: does not fit {arch} (missing {missing}, unexpected {unexpected})")
    return model.eval()


def _best_time(fn: Callable[[], object], calls: int = 2) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, rounds: int
) -> dict:
    """img/s of each form per round (each form's best of two calls, forms interleaved within a round)."""
    rates: dict[str, list[float]] = {k: [] for k in forms}
    with torch.no_grad():
        for f in forms.values():
            f(x)
        for _ in range(rounds):
            for name, f in forms.items():
                rates[name].append(len(x) / _best_time(lambda f=f: f(x)))
    return rates


def ratio(rates: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of rate(a) / rate(b)."""
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


@torch.no_grad()
def predictions(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: int, bf16: bool = False):
    """Top-1 predictions and logits of ``fn`` over ``x`` in batches (bf16: under CPU bf16 autocast)."""
    out = []
    for part in x.split(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out.append(fn(part).float())
    logits = torch.cat(out)
    return logits.argmax(1), logits


def speed(args: argparse.Namespace, x: torch.Tensor) -> None:
    """T-CNN eval img/s: old form vs new form vs the CNN's form, and the new form's prediction agreement."""
    cnn = load_cnn(args.arch, args.weights)
    tcnn = to_tcnn(cnn, alpha_init=args.alpha, lambda_init=args.alpha).eval()
    example = x[: args.batch]
    old = "T-CNN old (eager, channels-last)"
    forms: dict[str, Callable] = {
        old: _ChannelsLast(copy.deepcopy(tcnn).to(memory_format=torch.channels_last))
    }
    for name, model in (("T-CNN new", tcnn), ("CNN", cnn)):
        t0 = time.perf_counter()
        form, kind = inference_model(copy.deepcopy(model), example)
        print(f"{name}: inference_model picks {kind!r} ({time.perf_counter() - t0:.0f} s to choose)")
        forms[name] = form
    rates = interleaved(forms, example, args.rounds)
    for name, r in rates.items():
        print(f"  {name:34s} {statistics.median(r):7.0f} img/s")
    print(f"  ratio T-CNN new / old  x{ratio(rates, 'T-CNN new', old):.2f}")
    print(
        f"  ratio T-CNN new / CNN  x{ratio(rates, 'T-CNN new', 'CNN'):.2f}   (old / CNN x{ratio(rates, old, 'CNN'):.2f})"
    )
    new_pred, new_logits = predictions(forms["T-CNN new"], x, args.batch)
    ref_pred, ref_logits = predictions(tcnn, x, args.batch)
    same = int((new_pred == ref_pred).sum())
    print(f"  predictions of the new form equal the eager T-CNN's on {same} / {len(x)} images "
          f"(max |logit difference| {(new_logits - ref_logits).abs().max().item():.1e})")  # fmt: skip


def bf16_agreement(args: argparse.Namespace) -> None:
    """Share of top-1 predictions under bf16 autocast equal to fp32's, per model and set, and bf16's speed."""
    from core.robustness.corruptions import corrupt_batch

    images, labels = test_images(args.data, args.n)
    sub = np.linspace(0, len(images) - 1, min(args.n_corrupt, len(images))).round().astype(int)
    sets = {"clean": images} | {
        f"{c}-{s}": corrupt_batch(images[sub], c, s, seed=0, indices=sub) for c, s in BF16_SETS
    }
    cnn = load_cnn(args.arch, args.weights)
    models = {"CNN": cnn} | {
        f"T-CNN alpha=lambda={a:g}": to_tcnn(cnn, alpha_init=a, lambda_init=a).eval() for a in (1.0, 50.0)
    }
    for name, model in models.items():
        cl = _ChannelsLast(copy.deepcopy(model).to(memory_format=torch.channels_last)).eval()
        fp32, kind = inference_model(model, to_input(images[: args.batch]))
        for set_name, imgs in sets.items():
            x = to_input(imgs)
            p32, _ = predictions(fp32, x, args.batch)
            p16, _ = predictions(cl, x, args.batch, bf16=True)
            same = int((p32 == p16).sum())
            y = torch.from_numpy(labels if set_name == "clean" else labels[sub])
            print(f"{name:22s} {set_name:17s} bf16 == fp32 on {same}/{len(x)} = {same / len(x):.4%}  "
                  f"(top-1 fp32 {(p32 == y).float().mean():.2%}, bf16 {(p16 == y).float().mean():.2%})", flush=True)  # fmt: skip
        x = to_input(images[: args.batch])
        rates = interleaved(
            {"fp32": cl, "fp32 new": fp32, "bf16": lambda z, cl=cl: predictions(cl, z, len(z), True)},
            x, max(2, args.rounds // 2),
        )  # fmt: skip
        print(f"{name:22s} eval speed bf16 / fp32 (both eager, channels-last) x{ratio(rates, 'bf16', 'fp32'):.2f}; "
              f"bf16 / fp32 {kind} x{ratio(rates, 'bf16', 'fp32 new'):.2f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet12_cifar_os16")
    ap.add_argument("--weights", type=Path, default=None, help="released ResNet-20 checkpoint (he_cifar)")
    ap.add_argument("--data", type=Path, default=None, help="CIFAR-10 JPEG archive (test images as inputs)")
    ap.add_argument("--n", type=int, default=10000, help="images for the agreement checks")
    ap.add_argument("--n-corrupt", type=int, default=2000, help="images per corrupted set (--bf16)")
    ap.add_argument("--batch", type=int, default=500, help="evaluation batch (robustness.batch_size)")
    ap.add_argument("--alpha", type=float, default=1.0, help="alpha = lambda of the T-CNN (paper init: 1)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast agreement and speed instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"capability {torch.backends.cpu.get_cpu_capability()}; {args.arch}, batch {args.batch}")  # fmt: skip
    if args.bf16:
        if args.weights is None or args.data is None:
            ap.error("--bf16 needs --weights and --data (trained weights, real images)")
        bf16_agreement(args)
        return
    if args.data is not None:
        x = to_input(test_images(args.data, args.n)[0])
    else:
        x = torch.randn(args.n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    speed(args, x)


if __name__ == "__main__":
    main()
