"""The training loop shared by CNN pretraining and T-CNN fine-tuning, with exact resume.

`fit` trains a model over a range of (global) epochs with a `core.training.optim.WarmupCosine` schedule stepped per
optimizer step. Its work directory holds `resume.pt`, written atomically at every epoch end, every
`checkpoint_every_steps` steps, and when SIGTERM / SIGUSR1 / SIGUSR2 arrives (then `Preempted` is raised).
A resume restores model, optimizer, scheduler, grad scaler, epoch, step, the running epoch sums and every
RNG state (torch, numpy, python, CUDA); the data order, crops, flips and mixing come from
`BatchLoader.batches(epoch, start_step)`, a pure function of (seed, epoch, step). So on CPU a run killed
at any moment and resumed ends bitwise equal to one never interrupted (timing fields aside).

Epoch labels: data epoch `e` (0-based, what the loader sees) completes as epoch label `e + 1`, so
`ckpt-epoch-006.pt` is the state after six epochs and label 0 is the state before any step (t1 = 0).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.training import distributed as D
from core.training import early_stop as ES
from core.training.checkpoint import CheckpointError, atomic_save, capture_rng, load, restore_rng
from core.training.optim import WarmupCosine, optimizer_param_names, state_to_parameter_devices
from core.training.precision import autocast, grad_scaler

RESUME_FILE = "resume.pt"
STATE_FORMAT = "tcnn-train-state/1"
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "try again later" -- the run resumes when started again
STOP_SIGNALS = tuple(
    s
    for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"))
    if s is not None
)
TIMING_KEYS = ("images_per_s", "train_time_s", "wall_s")  # machine-dependent fields of histories/metrics


class Preempted(Exception):
    """A stop signal arrived; the state was checkpointed at a step boundary and the run can resume."""

    def __init__(self, signum: int, checkpoint: Path, epoch: int, step: int) -> None:
        self.signum, self.checkpoint, self.epoch, self.step = signum, checkpoint, epoch, step
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(
            f"stopped by {name} at epoch {epoch + 1} step {step}; state saved to {checkpoint}; "
            "run the same command again to resume"
        )


class TrainingError(RuntimeError):
    """Training cannot go on (loss became NaN/inf)."""


# ---------------------------------------------------------------------------------------------------------
# Environment: device, quiet mode, determinism
# ---------------------------------------------------------------------------------------------------------


def is_quiet() -> bool:
    """No progress bars when TCNN_QUIET=1, CI=true, or stderr is not a terminal."""
    if os.environ.get("TCNN_QUIET", "").lower() in ("1", "true", "yes"):
        return True
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return True
    return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())


def select_device(name: str | None = None) -> torch.device:
    """`name`, else env TCNN_DEVICE, else CUDA when available, else CPU."""
    name = name or os.environ.get("TCNN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels on CPU (bitwise resume); on CUDA keep the fast cuDNN autotuner instead."""
    if device.type == "cpu":
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)
    else:
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = before


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (model init, stochastic depth, dropout)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------
# Model helpers
# ---------------------------------------------------------------------------------------------------------


class TrainLoss(nn.Module):
    """Cross-entropy for hard labels (with optional label smoothing) or soft targets (mixup / cutmix)."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if target.ndim == 2:
            return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)


def _hard(target: torch.Tensor) -> torch.Tensor:
    return target.argmax(dim=-1) if target.ndim == 2 else target


def _to_device(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    x = x.to(device, non_blocking=True)
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device | None = None,
    channels_last: bool = False,
    precision: str = "auto",
) -> dict[str, float]:
    """Mean cross-entropy and top-1 accuracy of `model` (put in eval mode, restored after) over `batches`,
    computed under `precision` (core.training.precision). Under data parallelism `batches` is this rank's
    shard and the sums are added over ranks, so every rank returns the whole set's figures."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    try:
        for x, y in batches:
            x = _to_device(x, device, channels_last)
            y = _hard(y.to(device))
            with autocast(device, precision):
                logits = model(x)
            loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += int(y.numel())
    finally:
        model.train(was_training)
    if D.world().parallel:
        sums = D.all_sum(torch.tensor([loss_sum, correct, n], dtype=torch.float64))
        loss_sum, correct, n = float(sums[0]), int(sums[1]), int(sums[2])
    if n == 0:
        return {"loss": float("nan"), "acc": float("nan"), "n": 0}
    return {"loss": loss_sum / n, "acc": correct / n, "n": n}


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, *, device: torch.device | None = None) -> torch.Tensor:
    """fp32 logits of `model` in eval mode (for equivalence checks)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return model(x.to(device)).float().cpu()
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------------------
# Stop signals
# ---------------------------------------------------------------------------------------------------------


class StopSignals:
    """Turn SIGTERM (SLURM time limit), SIGHUP, SIGUSR1 (SLURM --signal) and SIGUSR2 (submitit) into a flag read
    at step boundaries. After the checkpoint is written, a handler that was installed before (e.g.
    submitit's SIGUSR2 requeue handler) is called, then `Preempted` is raised. Outside the main thread
    (some Ray workers) signals cannot be caught and this does nothing."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> StopSignals:
        for s in self.signals:
            with contextlib.suppress(ValueError, OSError):  # not the main thread: no signal handling
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, prev in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def chain(self) -> None:
        """Call the handler that was installed before ours for the received signal, if it was Python's."""
        if self.received is None:
            return
        prev = self._previous.get(self.received)
        # The stage process's own handler (stages.harness.runner.stop_on_signals) would only raise: Preempted says it.
        if (
            callable(prev)
            and prev is not signal.default_int_handler
            and not getattr(prev, "tcnn_stage_handler", False)
        ):
            prev(self.received, None)


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What `on_step` callbacks see after each optimizer step."""

    epoch: int  # data epoch (0-based)
    step: int  # steps done within the epoch
    global_step: int
    loss: torch.Tensor
    stop: StopSignals


@dataclass
class FitResult:
    history: list[dict[str, Any]]
    epoch_checkpoints: dict[int, Path]
    resumed_from: tuple[int, int] | None  # (data epoch, step) of the checkpoint the run resumed from
    global_step: int
    work_dir: Path
    notes: list[str] = field(default_factory=list)
    early_stop: dict[str, Any] | None = None  # core.training.early_stop's state when the rule was on


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: WarmupCosine,
    train_loader: Any,
    *,
    epochs: range,
    work_dir: str | os.PathLike,
    run_hash: str,
    loss_fn: nn.Module | None = None,
    val_loader: Any | None = None,
    device: torch.device | None = None,
    channels_last: bool = False,
    precision: str = "auto",
    scaler: torch.amp.GradScaler | None = None,
    checkpoint_every_steps: int = 0,
    epoch_checkpoints: Iterable[int] = (),
    extra_state: dict[str, Any] | None = None,
    epoch_stats: Callable[[nn.Module, int], dict[str, Any]] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    history_start: list[dict[str, Any]] | None = None,
    early_stop: Any | None = None,
    desc: str = "train",
    log: Callable[[str], None] = _log,
) -> FitResult:
    """Train `model` over the data epochs `epochs` (e.g. range(0, E); range(t1, E) for "continue").

    `train_loader` follows core.data.BatchLoader: `len()` steps per epoch, `batches(epoch, start_step)`.
    `val_loader` (optional) is evaluated at every epoch end. `epoch_checkpoints` are epoch labels
    (completed-epoch counts; `epochs.start` means the state before the first step) whose full training
    state is kept as `work_dir/ckpt-epoch-XXX.pt`. `extra_state` is merged into every checkpoint (model_spec,
    normalization, ...). `epoch_stats(model, label)` adds columns to each history row; `history_start`
    rows (e.g. the state before training) open the history of a fresh run. `early_stop` ({patience,
    min_delta_images}, e.g. core.config.StopConfig; needs `val_loader`) stops on a validation plateau
    (core.training.early_stop) and leaves the best-validation epoch's weights in `model`.

    Resumes from `work_dir/resume.pt` when its `run_hash` matches (else starts fresh and says so).
    Raises `Preempted` after checkpointing when a stop signal arrives, `TrainingError` on a NaN/inf loss.
    """
    work_dir = Path(work_dir)
    device = device or next(model.parameters()).device
    loss_fn = loss_fn or TrainLoss()
    scaler = scaler or grad_scaler(device, precision)
    world = D.world()
    if not world.main:  # one voice: rank 0 logs and draws the progress bar
        log = _silent
    spe = len(train_loader)
    if spe <= 0:
        raise TrainingError(f"{desc}: the training set yields no full batch (steps per epoch = 0)")
    keep = {int(e) for e in epoch_checkpoints if epochs.start <= int(e) <= epochs.stop}
    extra_state = dict(extra_state or {})
    param_names = optimizer_param_names(optimizer, model)
    resume_path = work_dir / RESUME_FILE
    notes: list[str] = []

    history: list[dict[str, Any]] = []
    saved: dict[int, Path] = {}
    epoch, step, global_step = epochs.start, 0, 0
    accum = _new_accum()
    resumed_from = None
    if early_stop is not None and val_loader is None:
        raise TrainingError(f"{desc}: early stopping needs a validation split")
    plateau = {"rule": ES.new_state(), "best_model": None} if early_stop is not None else None

    model.to(device)  # before loading optimizer state, which follows its parameters' device
    state_to_parameter_devices(optimizer)  # state loaded before the move (carried "continue" momentum)
    state = _try_resume(resume_path, run_hash, log, notes)
    if len(set(D.gather(state is None))) > 1:  # every rank read the same file: they must agree
        raise TrainingError(f"{desc}: the ranks disagree on whether {resume_path} can be resumed")
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        _restore_rank_rng(state, world)
        epoch, step, global_step = state["epoch"], state["step"], state["global_step"]
        # the checkpoint holds the ranks' summed epoch accumulators: rank 0 carries them, the others add to 0
        accum = _accum_from_state(state["accum"] if world.main else _zero_accum(state["accum"]), device)
        history = list(state["history"])
        saved = {int(k): work_dir / v for k, v in state["epoch_checkpoints"].items()}
        resumed_from = (epoch, step)
        plateau = state.get("early_stop") if plateau is not None else None
        if plateau is None and early_stop is not None:  # the run_hash covers the rule: cannot happen
            raise TrainingError(f"{desc}: {resume_path} holds no early-stopping state")
        log(
            f"{desc}: resuming from {resume_path} at epoch {epoch + 1} step {step} (global step {global_step})"
        )
    else:
        D.barrier()  # every rank has read the old state before rank 0 clears it
        if world.main:
            if work_dir.exists():
                shutil.rmtree(work_dir)
            work_dir.mkdir(parents=True, exist_ok=True)
        if world.parallel and not world.main:  # own dropout / drop-path draws per rank, fixed by (seed, rank)
            seed_everything(torch.initial_seed() + 1_000_003 * world.rank)
        accum = _new_accum(device)
        history = [dict(r) for r in history_start or []]

    def snapshot(ep: int, st: int) -> dict[str, Any]:
        """The full training state; a collective under DDP (every rank calls it, rank 0 writes it)."""
        rng_ranks = D.gather(capture_rng())
        return {
            "format": STATE_FORMAT,
            "run_hash": run_hash,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "param_names": param_names,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": ep,
            "step": st,
            "global_step": global_step,
            "steps_per_epoch": spe,
            "rng": rng_ranks[0],
            **({"rng_ranks": rng_ranks} if world.parallel else {}),
            "accum": _accum_to_state(_reduced(accum)),
            "history": history,
            "epoch_checkpoints": {k: p.name for k, p in saved.items()},
            **({"early_stop": plateau} if plateau is not None else {}),
            **extra_state,
        }

    def save(snap: dict[str, Any], path: Path) -> None:
        if world.main:
            atomic_save(snap, path)
        D.barrier()  # no rank runs ahead of a checkpoint (a kill then loses at most the current step)

    def save_epoch_checkpoint(label: int) -> None:
        path = work_dir / f"ckpt-epoch-{label:03d}.pt"
        snap = snapshot(label, 0)
        snap["kind"] = "epoch"
        save(snap, path)
        saved[label] = path

    if channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()
    net = D.wrap(model, device)  # DDP when several ranks: averages gradients in backward

    with StopSignals() as stop:
        if state is None and epochs.start in keep:
            save_epoch_checkpoint(epochs.start)
        while epoch < epochs.stop and not _stopped(plateau):
            bar = _progress(desc, epoch, epochs.stop, spe, step) if world.main else None
            t_start = time.perf_counter()
            n_timed = 0
            for x, y in train_loader.batches(epoch, step):
                x = _to_device(x, device, channels_last)
                y = y.to(device, non_blocking=True)
                with autocast(device, precision):
                    logits = net(x)
                loss = loss_fn(logits, y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                accum["lr"] = float(optimizer.param_groups[0]["lr"])  # the lr this step used
                scheduler.step()
                step += 1
                global_step += 1
                b = int(y.shape[0])
                accum["loss_sum"] += loss.detach().double() * b
                accum["correct"] += (logits.detach().argmax(-1) == _hard(y)).sum()
                accum["images"] += b
                n_timed += b
                if on_step is not None:
                    on_step(StepInfo(epoch, step, global_step, loss.detach(), stop))
                if bar is not None:
                    _bar_update(bar, step, loss, n_timed, t_start, accum)
                stopping = D.any_rank(stop.received is not None, device)
                if step < spe and (
                    stopping or (checkpoint_every_steps > 0 and global_step % checkpoint_every_steps == 0)
                ):
                    accum["time_s"] += time.perf_counter() - t_start
                    t_start, n_timed = time.perf_counter(), 0
                    save(snapshot(epoch, step), resume_path)
                    if stopping:
                        if bar is not None:
                            bar.close()
                        stop.chain()
                        raise Preempted(_signum(stop), resume_path, epoch, step)
            accum["time_s"] += time.perf_counter() - t_start
            if bar is not None:
                bar.close()

            label = epoch + 1
            row = _epoch_row(label, global_step, _reduced(accum), scheduler)
            if not math.isfinite(row["train_loss"]):
                raise TrainingError(f"{desc}: training loss became {row['train_loss']} in epoch {label}")
            if val_loader is not None:
                val = evaluate(
                    model,
                    val_loader.batches(0),
                    device=device,
                    channels_last=channels_last,
                    precision=precision,
                )
                row["val_loss"], row["val_acc"] = val["loss"], val["acc"]
            if epoch_stats is not None:
                row.update(epoch_stats(model, label))
            history.append(row)
            log(_epoch_line(desc, row, epochs.stop))
            if plateau is not None:
                plateau = _plateau_step(plateau, model, label, val, early_stop, desc, log)
            epoch, step = epoch + 1, 0
            accum = _new_accum(device)
            if label in keep:
                save_epoch_checkpoint(label)
            save(snapshot(epoch, 0), resume_path)
            if (
                D.any_rank(stop.received is not None, device)
                and epoch < epochs.stop
                and not _stopped(plateau)
            ):
                stop.chain()
                raise Preempted(_signum(stop), resume_path, epoch, 0)

    if plateau is not None:  # the best-validation epoch's weights
        model.load_state_dict(plateau["best_model"])
    rule = plateau["rule"] if plateau is not None else None
    return FitResult(history, dict(sorted(saved.items())), resumed_from, global_step, work_dir, notes, rule)


def _stopped(plateau: dict[str, Any] | None) -> bool:
    return plateau is not None and bool(plateau["rule"]["stopped"])


def _plateau_step(
    plateau: dict[str, Any], model: nn.Module, label: int, val: dict[str, Any], rule: Any, desc: str, log: Any
) -> dict[str, Any]:
    """The early-stopping state after epoch `label` (val: `evaluate`'s figures); keeps a CPU copy of the
    weights when the epoch is the best so far."""
    kw = {"patience": rule.patience, "min_delta_images": rule.min_delta_images}
    state = ES.update(plateau["rule"], label, round(val["acc"] * val["n"]), **kw)
    best = plateau["best_model"]
    if ES.is_best(state, label):
        best = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if state["stopped"]:
        log(
            f"{desc}: stopping after epoch {label}: {ES.reason(state, **kw)}; keeping epoch {state['best_epoch']}"
        )
    return {"rule": state, "best_model": best}


def _try_resume(path: Path, run_hash: str, log: Callable[[str], None], notes: list[str]) -> dict | None:
    if not path.exists():
        return None
    try:
        state = load(path)
    except CheckpointError as err:
        msg = f"ignoring unreadable in-progress checkpoint ({err}); starting fresh"
        log(msg)
        notes.append(msg)
        return None
    if state.get("format") != STATE_FORMAT or state.get("run_hash") != run_hash:
        msg = f"in-progress checkpoint {path} belongs to other params or inputs; starting fresh"
        log(msg)
        notes.append(msg)
        return None
    return state


def _silent(msg: str) -> None:
    pass


def _signum(stop: StopSignals) -> int:
    """The signal that stopped this rank, or SIGTERM for a rank stopped because another one was signalled."""
    return stop.received if stop.received is not None else int(signal.SIGTERM)


def _restore_rank_rng(state: dict[str, Any], world: D.World) -> None:
    """Each rank's own RNG states when the checkpoint comes from the same world size; otherwise rank 0
    takes the saved (rank 0) states and the others re-seed from them and their rank (deterministic)."""
    ranks = state.get("rng_ranks")
    if ranks is not None and len(ranks) == world.size:
        restore_rng(ranks[world.rank])
        return
    restore_rng(state["rng"])
    if not world.main:
        seed_everything(torch.initial_seed() + 1_000_003 * world.rank + int(state["global_step"]))


def _reduced(a: dict[str, Any]) -> dict[str, Any]:
    """The epoch accumulators summed over ranks (loss, correct, images); this rank's time and lr."""
    if not D.world().parallel:
        return a
    counts = D.all_sum(torch.tensor([float(a["images"])], dtype=torch.float64, device=a["loss_sum"].device))
    return {
        **a,
        "loss_sum": D.all_sum(a["loss_sum"]),
        "correct": D.all_sum(a["correct"]),
        "images": int(counts.item()),
    }


def _zero_accum(a: dict[str, Any]) -> dict[str, Any]:
    return {**a, "loss_sum": torch.zeros_like(a["loss_sum"]), "correct": torch.zeros_like(a["correct"]),
            "images": 0}  # fmt: skip


def _new_accum(device: torch.device | None = None) -> dict[str, Any]:
    return {
        "loss_sum": torch.zeros((), dtype=torch.float64, device=device),
        "correct": torch.zeros((), dtype=torch.int64, device=device),
        "images": 0,
        "time_s": 0.0,
        "lr": float("nan"),
    }


def _accum_to_state(a: dict[str, Any]) -> dict[str, Any]:
    return {**a, "loss_sum": a["loss_sum"].cpu(), "correct": a["correct"].cpu()}


def _accum_from_state(a: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {**a, "loss_sum": a["loss_sum"].to(device), "correct": a["correct"].to(device)}


def _epoch_row(label: int, global_step: int, a: dict[str, Any], scheduler: WarmupCosine) -> dict[str, Any]:
    n = max(1, a["images"])
    return {
        "epoch": label,
        "step": global_step,
        "lr": a["lr"],  # lr of the epoch's last step (the schedule is per step)
        "train_loss": float(a["loss_sum"]) / n,
        "train_acc": int(a["correct"]) / n,
        "images_per_s": a["images"] / a["time_s"] if a["time_s"] > 0 else float("nan"),
        "train_time_s": a["time_s"],
    }


def _epoch_line(desc: str, row: dict[str, Any], total: int) -> str:
    parts = [f"{desc} epoch {row['epoch']}/{total}", f"lr {row['lr']:.3g}", f"loss {row['train_loss']:.4f}"]
    parts.append(f"acc {row['train_acc']:.4f}")
    if "val_acc" in row:
        parts.append(f"val_loss {row['val_loss']:.4f} val_acc {row['val_acc']:.4f}")
    parts.append(f"{row['images_per_s']:.0f} img/s")
    return " | ".join(parts)


def _progress(desc: str, epoch: int, total: int, spe: int, start: int) -> Any:
    if is_quiet():
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=spe,
        initial=start,
        desc=f"{desc} {epoch + 1}/{total}",
        unit="step",
        leave=False,
        dynamic_ncols=True,
    )


def _bar_update(bar: Any, step: int, loss: torch.Tensor, n: int, t0: float, accum: dict) -> None:
    bar.update(step - bar.n)
    if step % 10 == 0 or step == bar.total:
        dt = time.perf_counter() - t0
        bar.set_postfix(loss=f"{float(loss):.3f}", img_s=f"{n / dt:.0f}" if dt > 0 else "-", refresh=False)


# ---------------------------------------------------------------------------------------------------------
# Data plumbing shared by the training stages
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# GPSA dynamics ([TCNN21] Fig. 4): flat per-layer means of core.analysis.dissect.layer_stats (1/alpha, sigma(lambda), nonlocality)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# History files (DVC plots: CSV with one row per epoch; JSON keeps nested per-head values)
# ---------------------------------------------------------------------------------------------------------
