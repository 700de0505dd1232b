"""The price of the sized CIFAR-10 study (pipelines/studies/cifar10_power.yaml's design) run on the released
ResNet-20 instead of resnet12_cifar_os16 (issue 48, item 6): seconds per trial and hours for the study, from
rates measured side by side on this CPU.

    .venv/bin/python benchmarks/trial_cost_resnet20.py [--rounds 5] [--threads 2] [--weights PATH]
        [--gpsa-path cpp|reference]

``--gpsa-path``: the T-CNN's GPSA attention through the C++ kernel (`core.nn.gated_attention_cpp`, TcnnGPSA's
default where it builds) or the reference path (autograd's graph of the plain ops, the price before issue 58).

Measured in one run, forms interleaved round by round (median of rounds; round 0 warms up): fp32 fine-tuning
steps (AdamW with the gate lr, batch 128, 32 px) of the released ResNet-20 (core.models.he_cifar:resnet20 with
../shared/pretrained/resnet20-12fca82f.th, sha256-checked and loaded strictly the way pretrain.source imports
it) as the control arm, and of its T-CNN converted as the preset converts it (pipelines/presets/
resnet20_cifar10.yaml, reparam: stages [-1], stride_mode exact, alpha = lambda = 1: layer3's six 3x3 convs on
8x8 maps -> GPSA), in the fine-tuning stage's layout (channels-last on CPU, stages/harness/fine_tuning.py) and, for
reference, NCHW. Stochastic depth (drop_path 0.1) is a no-op here: he_cifar's blocks have no drop_path.
Evaluation img/s at batch 500 of each form a trial runs: the training loop's per-epoch validation and final
test (eager, channels-last) and the evaluate stage's (core.training.inference.inference_model). Random
inputs; data loading, corruption generation and process start-up are not in it.

The trial is the design of cifar10_power.yaml with issue 48's data.val_from: test_half (the release trained
on all 50,000 training images, so validation is a fixed half of the test split): 50,000 training images x up
to 12 epochs per arm, 5,000 validation images per epoch and arm, the 5,000-image clean test half and
19 corruptions x 5 severities = 95 corrupted sets (trial_cost.corrupted_sets of cifar10_power.yaml) of all 5,000 test-half images (CIFAR-10-C's size within the
half) for the T-CNN, the control and the CNN. The study's size comes from pipelines.studies.sizing on the
first CIFAR-10 study's per-seed differences (pipelines/studies/cifar10_lr/results.csv). Compare ratios from
one run on one machine; the CPU is printed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch
from tcnn_eval import interleaved
from trial_cost import STUDIES, corrupted_sets, step_rates

from core.config import SourceConfig
from core.models.conversion import to_tcnn
from core.models.factory import build, set_stochastic_depth
from core.models.importing import import_cnn
from core.nn.gated_attention_cpp import available as cpp_available
from core.training.inference import _ChannelsLast, inference_model
from core.training.optim import build_adamw
from core.utils.machine import cpu_model
from pipelines.studies.sizing import half_width, sd_upper, seeds_needed, sizing

ARCH = "core.models.he_cifar:resnet20"
WEIGHTS = Path("../shared/pretrained/resnet20-12fca82f.th")
SHA256 = "12fca82f0bebc4135bf1f32f6e3710e61d5108578464b84fd6d7f5c1b04036c8"
FIRST_STUDY = Path("pipelines/studies/cifar10_lr")  # its results.csv: the pilot SD the sizing reads
# The design (cifar10_power.yaml + data.val_from: test_half): training images, epochs at most, validation
# per epoch and arm, clean test half, corrupted sets (the preset's robustness.corruptions x severities: 19 x 5)
# of the whole test half.
TRAIN, EPOCHS, VAL, TEST, PER_SET = 50_000, 12, 5_000, 5_000, 5_000
SETS = corrupted_sets(STUDIES / "cifar10_power.yaml")
PILOT_SEEDS, GRID, BRACKET_ROUNDS = 3, 3, 2  # sweep.grid seed x finetune.lr; sweep.select.bracket.max_rounds
BUDGET_H = 20.0


def networks(weights: Path) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """The released ResNet-20 (or, without the file, the same network untrained) and its T-CNN."""
    if weights.is_file():
        cnn = import_cnn(ARCH, SourceConfig(weights=str(weights), sha256=SHA256), 10, 3).model
        note = f"released weights {weights.name} (sha256 checked, loaded strictly)"
    else:
        cnn = build("cnn", ARCH, 10, in_chans=3)
        note = f"{weights} not found: untrained weights (the cost does not depend on them)"
    tcnn = to_tcnn(cnn.eval(), alpha_init=1.0, lambda_init=1.0, stages=[-1], stride_mode="exact")
    return cnn.eval(), tcnn.eval(), note


def train_rates(models: dict[str, torch.nn.Module], batch: int, steps: int, rounds: int) -> dict:
    """Fine-tuning img/s of each form (full AdamW steps at the study's batch-128 lrs), interleaved."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    xcl = x.contiguous(memory_format=torch.channels_last)
    opts = {k: build_adamw(m, lr=1.25e-4, gate_lr=0.0125, weight_decay=0.05) for k, m in models.items()}
    inputs = {k: xcl if "channels-last" in k else x for k in models}
    return step_rates(models, opts, inputs, y, steps, rounds)


def trial_seconds(tr: dict, ev: dict, epochs: int, cnn_share: float) -> dict[str, float]:
    """Seconds per part of one trial of ``epochs`` epochs per arm; ``cnn_share``: the fraction of the CNN's
    evaluation this trial pays (1 / trials sharing it)."""
    evaluated = TEST + SETS * PER_SET
    out = {
        "fine-tune T-CNN": TRAIN * epochs / tr["T-CNN"],
        "fine-tune control": TRAIN * epochs / tr["control"],
        "validation + final test (both arms, eager)": (epochs * VAL + TEST) * (1 / ev["tcnn_cl"] + 1 / ev["cnn_cl"]),
        "evaluate T-CNN": evaluated / ev["tcnn"],
        "evaluate control": evaluated / ev["cnn"],
        "evaluate CNN": cnn_share * evaluated / ev["cnn"],
    }  # fmt: skip
    out["trial"] = sum(out.values())
    return out


# Issue 57's design (pipelines/studies/cifar10_resnet20.yaml, its own params read): the lr of each arm by a
# search on one seed (validation only, no evaluate stage), then main seeds one at a time (3 at least, 10 at most).
DESIGN = STUDIES / "cifar10_resnet20.yaml"
AVX2_RATES = {"train": {"control": 238.0, "T-CNN": 82.0},  # issue 57: the idle AVX2 EPYC (Zen 3) of 9f9610d
              "eval": {"tcnn_cl": 173.0, "cnn_cl": 691.0, "tcnn": 310.0, "cnn": 1091.0}}  # fmt: skip


def design_price(tr: dict, ev: dict, design: Path = DESIGN) -> list[tuple[str, float]]:
    """Hours of the search-then-sequential-seeds design at the rates ``tr`` (training img/s per arm) and ``ev``
    (evaluation img/s): the search at its best (ASHA stops every trial it may at the first rung, the minimum of
    finished trials per arm runs to the end) and worst (no trial stopped), each main seed (clean test half and
    every corrupted set for the T-CNN, its control and the CNN), and the study at 3, 5 and 10 main seeds."""
    import yaml

    p = yaml.safe_load(design.read_text())
    epochs, search = int(p["finetune"]["epochs"]), p["sweep"]["search"]
    points, keep = int(search["num_samples"]), int(search.get("min_finished", 3))
    grace, per_set = int(p["sweep"]["scheduler"]["grace_period"]), int(p["robustness"]["n_images"])
    epoch_s = TRAIN / tr["control"] + TRAIN / tr["T-CNN"] + VAL * (1 / ev["tcnn_cl"] + 1 / ev["cnn_cl"])
    best = (keep * epochs + (points - keep) * grace) * epoch_s
    worst = points * epochs * epoch_s
    evaluated = TEST + corrupted_sets(design) * per_set
    seed = (epochs * epoch_s + TEST * (1 / ev["tcnn_cl"] + 1 / ev["cnn_cl"])
            + evaluated * (1 / ev["tcnn"] + 2 / ev["cnn"]))  # fmt: skip
    rows = [("search, best case (ASHA stops all it may at the first rung)", best),
            ("search, worst case (no trial stopped)", worst), ("one main seed", seed)]  # fmt: skip
    for n in (3, 5, 10):
        rows.append((f"study, worst-case search + {n} main seeds", worst + n * seed))
    return [(name, sec / 3600) for name, sec in rows]


def print_design(tr: dict, ev: dict, where: str) -> None:
    print(
        f"\n| issue 57's design ({DESIGN.name}), {where} | 2-core hours | fits {BUDGET_H:.0f} h |\n|---|---:|---|"
    )
    for name, h in design_price(tr, ev):
        print(f"| {name} | {h:.2f} | {'yes' if h <= BUDGET_H or not name.startswith('study') else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="training steps per round and form")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument(
        "--design-only",
        action="store_true",
        help="price issue 57's design at the AVX2 EPYC's rates only (no measurement)",
    )
    ap.add_argument("--gpsa-path", choices=("cpp", "reference"), default="cpp")
    args = ap.parse_args()
    if args.design_only:
        print_design(AVX2_RATES["train"], AVX2_RATES["eval"], "at the idle AVX2 EPYC's rates (issue 57)")
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {args.threads} threads, "
          f"capability {torch.backends.cpu.get_cpu_capability()}; {ARCH}, fp32, batch {args.batch}, 32 px")  # fmt: skip
    cnn, tcnn, note = networks(args.weights)
    n_gpsa = sum(type(m).__name__.endswith("GPSA") for m in tcnn.modules())
    if args.gpsa_path == "cpp" and not cpp_available():
        raise SystemExit(
            "trial_cost_resnet20: --gpsa-path cpp, but the C++ attention did not build (log above)"
        )
    for m in tcnn.modules():
        if hasattr(m, "cpp_attention"):
            m.cpp_attention = args.gpsa_path == "cpp"
    print(f"network: {note}; T-CNN: {n_gpsa} GPSA layers (reparam.stages [-1], exact stride), "
          f"GPSA attention path: {args.gpsa_path}")  # fmt: skip
    forms = {}
    for arm, net in (("control", cnn), ("T-CNN", tcnn)):
        for layout in ("channels-last", "NCHW"):
            m = copy.deepcopy(net).train()
            set_stochastic_depth(m, 0.1)
            if layout == "channels-last":
                m.to(memory_format=torch.channels_last)
            forms[f"{arm}, {layout}"] = m
    train = train_rates(forms, args.batch, args.steps, args.rounds)
    tr = {"control": train["control, channels-last"], "T-CNN": train["T-CNN, channels-last"]}
    x = torch.randn(args.eval_batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ev_forms = {
        "T-CNN eager, channels-last": _ChannelsLast(
            copy.deepcopy(tcnn).to(memory_format=torch.channels_last)
        ),
        "CNN eager, channels-last": _ChannelsLast(copy.deepcopy(cnn).to(memory_format=torch.channels_last)),
    }
    fast = {k: inference_model(copy.deepcopy(m), x) for k, m in (("T-CNN", tcnn), ("CNN", cnn))}
    for k, (f, how) in fast.items():
        ev_forms[f"{k} evaluate ({how})"] = f
    evr = {k: statistics.median(v) for k, v in interleaved(ev_forms, x, args.rounds).items()}
    names = list(evr)
    ev = {"tcnn_cl": evr[names[0]], "cnn_cl": evr[names[1]], "tcnn": evr[names[2]], "cnn": evr[names[3]]}
    print("\ntraining img/s (median of rounds): " + ", ".join(f"{k} {v:.0f}" for k, v in train.items()))
    print(f"T-CNN / CNN training speed: x{tr['T-CNN'] / tr['control']:.2f} channels-last (the stage's layout), "
          f"x{train['T-CNN, NCHW'] / train['control, NCHW']:.2f} NCHW")  # fmt: skip
    print("evaluation img/s (batch 500): " + ", ".join(f"{k} {v:.0f}" for k, v in evr.items()))

    cases = {
        f"{EPOCHS} epochs, CNN eval shared by {GRID} (pilot)": trial_seconds(tr, ev, EPOCHS, 1 / GRID),
        f"{EPOCHS} epochs, CNN eval own (main)": trial_seconds(tr, ev, EPOCHS, 1.0),
        "3 epochs (earliest stop), main": trial_seconds(tr, ev, 3, 1.0),
    }
    parts = list(next(iter(cases.values())))
    print(f"\n| part (s per trial; {TRAIN:,} train, {VAL:,} val/epoch, {TEST:,} clean test + {SETS} sets x "
          f"{PER_SET:,}) | " + " | ".join(cases) + " |")  # fmt: skip
    print("|---|" + "---:|" * len(cases))
    for n in parts:
        print(
            f"| {n} | "
            + " | ".join(f"{c[n]:,.0f} ({100 * c[n] / c['trial']:.0f}%)" for c in cases.values())
            + " |"
        )
    pilot_t, main_t, _ = (c["trial"] for c in cases.values())
    print(f"\ntrial (both arms, {EPOCHS} epochs, no early stop): {main_t / 3600:.2f} h; training alone "
          f"{(cases[list(cases)[1]]['fine-tune T-CNN'] + cases[list(cases)[1]]['fine-tune control']) / 3600:.2f} h")  # fmt: skip

    # The size: seeds for a 95% half-width <= 0.5 pp on clean accuracy AND mCA, from the first study's SDs.
    rows = sizing(FIRST_STUDY)
    print(
        f"\nsizing from {FIRST_STUDY}/results.csv (the first CIFAR-10 study, resnet12_cifar_os16, 3 seeds):"
    )
    for r in rows:
        print(f"  {r['metric']}: SD {100 * r['sd']:.2f} pp -> {r['n']} seeds (half-width "
              f"{100 * r['half_width']:.2f} pp); SD's 80% upper bound {100 * r['sd_upper']:.2f} pp -> "
              f"{r['n_upper']} seeds")  # fmt: skip
    n = max(r["n"] for r in rows)
    n_hi = max(r["n_upper"] for r in rows)
    assert n == seeds_needed(max(r["sd"] for r in rows)) and half_width(1e-3, 3) > 0 and sd_upper(1e-3, 3) > 0
    imp = 2 * VAL / ev["cnn_cl"]  # the import: the CNN evaluated on validation and test once
    lo_pilot, hi_pilot = PILOT_SEEDS * GRID, PILOT_SEEDS * (GRID + 2 * BRACKET_ROUNDS)
    print(f"\n| study (2-core hours, {EPOCHS} epochs unless said) | pilot trials | main trials | hours | fits "
          f"{BUDGET_H:.0f} h |\n|---|---:|---:|---:|---|")  # fmt: skip
    scen = [
        ("SD as measured, grid of 3, no bracketing", lo_pilot, n - PILOT_SEEDS, 1.0),
        ("SD as measured, 2 bracketing rounds at both edges", hi_pilot, n - PILOT_SEEDS, 1.0),
        ("SD at its 80% upper bound, grid of 3", lo_pilot, n_hi - PILOT_SEEDS, 1.0),
        ("SD as measured, grid of 3, early stop at epoch 3 (floor)", lo_pilot, n - PILOT_SEEDS, 3 / EPOCHS),
    ]
    for name, p, m, frac in scen:
        ep = round(EPOCHS * frac)
        pt = trial_seconds(tr, ev, ep, 1 / GRID)["trial"]
        mt = trial_seconds(tr, ev, ep, 1.0)["trial"]
        h = (imp + p * pt + m * mt) / 3600
        print(f"| {name} | {p} | {m} | {h:.1f} | {'yes' if h <= BUDGET_H else 'no'} |")

    # Epochs per arm at which the base case fits the budget (a trial's cost is affine in its epochs).
    def base(ep: int) -> float:
        pilot = lo_pilot * trial_seconds(tr, ev, ep, 1 / GRID)["trial"]
        return imp + pilot + (n - PILOT_SEEDS) * trial_seconds(tr, ev, ep, 1.0)["trial"]

    print_design(tr, ev, "at the rates measured above")
    print_design(AVX2_RATES["train"], AVX2_RATES["eval"], "at the idle AVX2 EPYC's rates (issue 57)")
    f0, per_epoch = base(0), base(1) - base(0)
    fit = (BUDGET_H * 3600 - f0) / per_epoch
    print(f"\nbase case: evaluation and import alone (0 epochs) {f0 / 3600:.1f} h; each epoch of both arms in "
          f"all {lo_pilot + n - PILOT_SEEDS} trials adds {per_epoch / 3600:.1f} h; "
          + (f"fits {BUDGET_H:.0f} h if early stopping ends the arms after {fit:.1f} epochs on average"
             if fit > 0 else f"does not fit {BUDGET_H:.0f} h even with no training"))  # fmt: skip


if __name__ == "__main__":
    main()
