"""Where a CIFAR-10 study trial's compute goes, before and after the evaluation changes of issue 36 (the
pretrained CNN evaluated once per seed instead of once per trial; the T-CNN evaluated in its traced, frozen,
sub-batched form instead of eager channels-last), as seconds per trial from rates measured side by side.

    .venv/bin/python benchmarks/trial_cost.py [--rounds 3] [--threads 2] [--trials-per-seed 3]
    .venv/bin/python benchmarks/trial_cost.py --from-results benchmarks/results/trial_cost_epyc_avx2.txt

Measured in one run, forms interleaved round by round (median of rounds): fp32 fine-tuning steps of the
study network (resnet12_cifar_os16, 32 px, batch 128, AdamW with the gate lr, stochastic depth 0.1; the
T-CNN at the paper's init alpha = lambda = 1, [TCNN21] Sec. 3) for the T-CNN and the control (the CNN), and
evaluation img/s of each evaluation form (core/training/inference.py) at batch 500. Then a trial of the first
study's preset (pipelines/studies/cifar10_lr.yaml: 45,000 training images x 6 epochs per arm, 5,000
validation images per epoch and arm, the clean test split and its corrupted sets of 2,000, or of 10,000 at
CIFAR-10-C's size) costs sum(images / rate) per part. The corrupted sets a trial evaluates are the study's
robustness.corruptions x robustness.severities (:func:`corrupted_sets`: by default core.robustness.suite's 19
corruptions x 5 severities = 95 sets), each for the T-CNN, the control and the CNN. Random inputs (the networks' cost does not depend on
the pixels); data loading, corruption generation and process start-up are not in it (the sweep's cost.csv
records a real trial's stages). Compare ratios from one run on one machine; the CPU is printed.

``--from-results FILE`` measures nothing: it reads the rates a run recorded in FILE (its ``CPU:`` and
``img/s:`` lines, rounded to 1 img/s there) and prints the same report from them, so a committed table can be
recomputed when the composition changes without re-measuring.
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tcnn_eval import interleaved

from core.config import RobustnessConfig
from core.models.conversion import to_tcnn
from core.models.factory import build, set_drop_path
from core.training.inference import _ChannelsLast, inference_model
from core.training.optim import build_adamw
from core.utils.machine import cpu_model

ARCH = "resnet12_cifar_os16"
STUDIES = Path(__file__).resolve().parents[1] / "pipelines" / "studies"
TRAIN, EPOCHS, VAL, TEST = 45_000, 6, 5_000, 10_000


def corrupted_sets(params_file: Path) -> int:
    """The corrupted sets the evaluate stage evaluates per model for the study ``params_file``: its
    robustness.corruptions x robustness.severities, validated as the stages validate them (defaults:
    core.robustness.suite's corruptions x 1..5). Only that section is read: the data need not be present."""
    rob = RobustnessConfig.model_validate(yaml.safe_load(params_file.read_text()).get("robustness") or {})
    return len(rob.corruptions) * len(rob.severities)


def train_rates(cnn: torch.nn.Module, tcnn: torch.nn.Module, batch: int, steps: int, rounds: int) -> dict:
    """Fine-tuning img/s of each arm (full AdamW steps), interleaved round by round."""
    models = {"control": copy.deepcopy(cnn).train(), "T-CNN": copy.deepcopy(tcnn).train()}
    for m in models.values():
        set_drop_path(m, 0.1)
    opts = {k: build_adamw(m, lr=1e-5, gate_lr=1e-3, weight_decay=0.05) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return step_rates(models, opts, {k: x for k in models}, y, steps, rounds)


def step_rates(models: dict[str, torch.nn.Module], opts: dict, inputs: dict[str, torch.Tensor], y: torch.Tensor,
               steps: int, rounds: int) -> dict[str, float]:  # fmt: skip
    """img/s of full optimizer steps of each model on its input, interleaved round by round (round 0 warms
    up), the median over rounds."""
    rates: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):
        for name, m in models.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = F.cross_entropy(m(inputs[name]), y)
                opts[name].zero_grad(set_to_none=True)
                loss.backward()
                opts[name].step()
            if r:
                rates[name].append(steps * len(y) / (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in rates.items()}


def trial_seconds(train: dict, ev: dict, corrupted: int, cnn_share: float, sets: int, epochs: int = EPOCHS,
                  n_train: int = TRAIN, n_val: int = VAL) -> dict[str, float]:  # fmt: skip
    """Seconds per part of one trial; ``ev``: eval img/s of "cnn", "tcnn", "control" (the evaluate stage's
    forms) and "tcnn_val" (the training loop's per-epoch validation runs the eager T-CNN); ``corrupted``:
    images per corrupted set, ``sets``: corrupted sets per model (:func:`corrupted_sets`); ``cnn_share``: the
    fraction of the CNN's evaluation a trial pays (1: every trial; 1/k: once per seed of k trials)."""
    evaluated = TEST + sets * corrupted
    out = {
        "fine-tune T-CNN": n_train * epochs / train["T-CNN"],
        "fine-tune control": n_train * epochs / train["control"],
        "validation (both arms)": epochs * n_val * (1 / ev["tcnn_val"] + 1 / ev["control"]),
        "evaluate T-CNN": evaluated / ev["tcnn"],
        "evaluate control": evaluated / ev["control"],
        "evaluate CNN": cnn_share * evaluated / ev["cnn"],
    }
    out["trial"] = sum(out.values())
    return out


# A run's rates: its CPU line, training and evaluation img/s, trials per seed sharing the CNN's evaluation.
RateSet = tuple[str, dict[str, float], dict[str, float], int]


def measure(args: argparse.Namespace) -> RateSet:
    """The rates of this run, on this CPU."""
    torch.set_num_threads(args.threads)
    cpu = (f"CPU: {cpu_model()}; torch {torch.__version__}, {args.threads} threads, "
           f"capability {torch.backends.cpu.get_cpu_capability()}; {ARCH}, fp32")  # fmt: skip
    print(cpu, flush=True)
    torch.manual_seed(0)
    cnn = build("cnn", ARCH, 10).eval()
    tcnn = to_tcnn(cnn, alpha_init=1.0, lambda_init=1.0).eval()
    train = train_rates(cnn, tcnn, args.batch, args.steps, args.rounds)
    x = torch.randn(args.eval_batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    forms = {
        "T-CNN before (eager, channels-last)": _ChannelsLast(copy.deepcopy(tcnn).to(memory_format=torch.channels_last)),
        "T-CNN after": inference_model(copy.deepcopy(tcnn), x)[0],
        "CNN": inference_model(copy.deepcopy(cnn), x)[0],
    }  # fmt: skip
    ev = {k: statistics.median(v) for k, v in interleaved(forms, x, args.rounds).items()}
    return cpu, train, ev, args.trials_per_seed


RATE = re.compile(r"(train|eval) (.+?) ([0-9.]+)(?=, (?:train|eval) |$)")


def recorded(path: Path, trials_per_seed: int) -> RateSet:
    """The rates a run of this script recorded in ``path`` (its "CPU:" and "img/s:" lines; the trials per seed
    from its table's header when it has one)."""
    text = path.read_text()
    cpu = next(line for line in text.splitlines() if line.startswith("CPU: "))
    rates = next(line for line in text.splitlines() if line.startswith("img/s: "))
    found = RATE.findall(rates.removeprefix("img/s: "))
    train = {k: float(v) for kind, k, v in found if kind == "train"}
    ev = {k: float(v) for kind, k, v in found if kind == "eval"}
    shared = re.search(r"CNN evaluation shared by (\d+) trials", text)
    return cpu, train, ev, int(shared.group(1)) if shared else trials_per_seed


def cases(train: dict, ev: dict, k: int) -> dict[str, dict[str, float]]:
    """The trials the report compares: before / after issue 36 at the first study's design, and the sized
    study's (each with its own preset's corrupted sets)."""
    eager = ev["T-CNN before (eager, channels-last)"]
    before_ev = {"tcnn": eager, "tcnn_val": eager, "control": ev["CNN"], "cnn": ev["CNN"]}
    after_ev = {"tcnn": ev["T-CNN after"], "tcnn_val": eager, "control": ev["CNN"], "cnn": ev["CNN"]}
    first, power = corrupted_sets(STUDIES / "cifar10_lr.yaml"), corrupted_sets(STUDIES / "cifar10_power.yaml")
    return {
        "before, 2,000 per set": trial_seconds(train, before_ev, 2_000, 1.0, first),
        "after, 2,000 per set": trial_seconds(train, after_ev, 2_000, 1 / k, first),
        "after, 10,000 per set": trial_seconds(train, after_ev, 10_000, 1 / k, first),
        "cifar10_power.yaml (40,000 x up to 12 epochs, 10,000 val)": trial_seconds(
            train, after_ev, 10_000, 1 / k, power, epochs=12, n_train=40_000, n_val=10_000
        ),
    }


def report(rates: RateSet) -> None:
    """The rates, the table of seconds per part and the ratios and hours read from it."""
    _, train, ev, k = rates
    print("img/s: " + ", ".join(f"train {n} {v:.0f}" for n, v in train.items())
          + ", " + ", ".join(f"eval {n} {v:.0f}" for n, v in ev.items()))  # fmt: skip
    sets = corrupted_sets(STUDIES / "cifar10_lr.yaml")
    print(f"corrupted sets per model and trial: {sets} (robustness.corruptions x robustness.severities of "
          "pipelines/studies/cifar10_lr.yaml; cifar10_power.yaml: "
          f"{corrupted_sets(STUDIES / 'cifar10_power.yaml')})")  # fmt: skip
    table = cases(train, ev, k)
    names = list(next(iter(table.values())))
    print(f"\n| part (s per trial; CNN evaluation shared by {k} trials after) | " + " | ".join(table) + " |")
    print("|---|" + "---:|" * len(table))
    for n in names:
        cells = [f"{c[n]:,.0f} ({100 * c[n] / c['trial']:.0f}%)" for c in table.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    b, a, a10, power = (c["trial"] for c in table.values())
    print(f"\ntrial before / after: x{b / a:.2f} (2,000 per set); after at 10,000 per set costs x{a10 / b:.2f} "
          f"of before at 2,000")  # fmt: skip
    ev_b = sum(v for n, v in table["before, 2,000 per set"].items() if n.startswith("evaluate"))
    ev_a = sum(v for n, v in table["after, 2,000 per set"].items() if n.startswith("evaluate"))
    print(f"evaluation alone before / after: x{ev_b / ev_a:.2f}")
    pre = 25 * 40_000 / train["control"]  # the CNN's pretraining (SGD steps cost about what AdamW steps do)
    print(f"cifar10_power.yaml: a trial without early stopping {power / 3600:.1f} h, the CNN's pretraining "
          f"{pre / 3600:.1f} h on this CPU")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="training steps per round and arm")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trials-per-seed", type=int, default=3, help="trials sharing one CNN evaluation")
    ap.add_argument("--from-results", type=Path, default=None, metavar="FILE",
                    help="measure nothing: recompute the report from the rates recorded in FILE")  # fmt: skip
    args = ap.parse_args(argv)
    if args.from_results is None:
        report(measure(args))
        return
    rates = recorded(args.from_results, args.trials_per_seed)
    print(f"# recomputed by benchmarks/trial_cost.py --from-results {args.from_results.as_posix()} from the "
          "rates recorded there (no measurement)")  # fmt: skip
    print(rates[0])
    report(rates)


if __name__ == "__main__":
    main()
