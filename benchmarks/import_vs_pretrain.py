"""Importing a released CNN next to pretraining it here (issue 35): for each checkpoint, the import's time
(sha256, build, strict load), its test accuracy on a prepared dataset, the max |logit diff| of its T-CNN at
alpha = lambda = 50 (T-CNN, d'Ascoli et al. 2021, Sec. 2: the conversion then computes the CNN's function)
and at the paper's alpha = lambda = 1, and the measured time of SGD training steps of the same network, scaled
to the release's schedule (``--epochs`` over ``--train-images`` at ``--batch``).

    .venv/bin/python benchmarks/import_vs_pretrain.py --data-dir data/cifar10-jpeg \\
        --arch core.models.he_cifar:resnet20 --weights ../shared/pretrained/resnet20-12fca82f.th \\
        [--arch ... --weights ...] --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225 --epochs 200

The accuracy is the imported network's on the test split, normalised as the source says; the training rate is
the median of ``--rounds`` timed rounds of ``--steps`` steps on real training batches (compare only on one
machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.config import SourceConfig
from core.data import load_datasets, make_loader
from core.models.conversion import to_tcnn
from core.models.importing import import_cnn
from core.training.model_eval import evaluate
from core.training.optim import build_sgd
from core.utils.hashing import file_digest


def _train_rate(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], rounds: int
) -> float:
    opt = build_sgd(model.train(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        rates.append(sum(len(y) for _, y in batches) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--arch", action="append", required=True)
    ap.add_argument("--weights", action="append", required=True)
    ap.add_argument("--mean", type=float, nargs="+", required=True)
    ap.add_argument("--std", type=float, nargs="+", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--train-images", type=int, default=50000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ds = load_datasets(args.data_dir, val_size=5000, sample_fraction=1.0, seed=0)
    ds.mean, ds.std = list(args.mean), list(args.std)
    test = make_loader(ds, "test", batch_size=500, train=False, seed=0)
    probe = torch.cat(
        [x for x, _ in make_loader(ds, "val", batch_size=256, train=False, seed=0).batches(0)][:1]
    )
    train = make_loader(ds, "train", batch_size=args.batch, train=True, seed=0)
    batches = [b for _, b in zip(range(args.steps), train.batches(0))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; test split {len(ds.test_y)} images")
    print(
        "| network | import (s) | test acc (%) | max abs logit diff, T-CNN a=l=50 | same, a=l=1 | "
        f"train img/s | {args.epochs} epochs x {args.train_images} images here (h) | import / pretraining |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arch, weights in zip(args.arch, args.weights):
        source = SourceConfig(weights=weights, sha256=file_digest(weights), mean=args.mean, std=args.std)
        t0 = time.perf_counter()
        cnn = import_cnn(arch, source, ds.num_classes, ds.in_chans).model.eval()
        t_import = time.perf_counter() - t0
        acc = evaluate(cnn, test.batches(0), device=torch.device("cpu"))["acc"]
        with torch.no_grad():
            ref = cnn(probe)
            diffs = [(to_tcnn(cnn, alpha_init=a, lambda_init=a).eval()(probe) - ref).abs().max().item()
                     for a in (50.0, 1.0)]  # fmt: skip
        rate = _train_rate(cnn, batches, args.rounds)  # the last use of cnn: training changes it
        hours = args.epochs * args.train_images / rate / 3600
        print(
            f"| {arch} | {t_import:.2f} | {100 * acc:.2f} | {diffs[0]:.2e} | {diffs[1]:.2f} | {rate:.0f} | "
            f"{hours:.1f} | 1 : {hours * 3600 / t_import:,.0f} |"
        )


if __name__ == "__main__":
    main()
