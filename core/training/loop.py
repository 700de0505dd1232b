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

import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from core.training import distributed as D
from core.training import early_stop as ES
from core.training import progress as P
from core.training.checkpoint import atomic_save, capture_rng
from core.training.environment import seed_everything
from core.training.epoch_sums import (
    accum_from_state,
    accum_to_state,
    epoch_line,
    epoch_row,
    new_accum,
    reduced_accum,
    zero_accum,
)
from core.training.model_eval import TrainLoss, evaluate, hard_labels, to_device
from core.training.optim import WarmupCosine, optimizer_param_names, state_to_parameter_devices
from core.training.precision import autocast, grad_scaler
from core.training.resume_file import RESUME_FILE, STATE_FORMAT, restore_rank_rng, try_resume
from core.training.stop_signals import Preempted, StopSignals, stop_signum

TIMING_KEYS = ("images_per_s", "train_time_s", "wall_s")  # machine-dependent fields of histories/metrics


class TrainingError(RuntimeError):
    """Training cannot go on (loss became NaN/inf)."""


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
    device = device or next(model.parameters()).device
    job = _Job(
        model=model, optimizer=optimizer, scheduler=scheduler, train_loader=train_loader, epochs=epochs,
        work_dir=Path(work_dir), run_hash=run_hash, loss_fn=loss_fn or TrainLoss(), val_loader=val_loader,
        device=device, channels_last=channels_last, precision=precision,
        scaler=scaler or grad_scaler(device, precision), checkpoint_every_steps=checkpoint_every_steps,
        epoch_checkpoints=epoch_checkpoints, extra_state=dict(extra_state or {}), epoch_stats=epoch_stats,
        on_step=on_step, early_stop=early_stop, desc=desc, log=log,
    )  # fmt: skip
    run = _start(job, history_start)
    net = _training_net(job)
    with StopSignals() as stop:
        if run.resumed_from is None and epochs.start in job.keep:
            _save_epoch_checkpoint(job, run, epochs.start)
        while run.epoch < epochs.stop and not _stopped(run.plateau):
            _train_epoch(job, run, net, stop)
            _end_epoch(job, run, stop)
    return _finish(job, run)


@dataclass
class _Job:
    """What one `fit` call trains with and where it keeps its state: `fit`'s arguments with their defaults
    filled in, plus what follows from them. Fixed for the whole call; `__post_init__` refuses a job that
    cannot run (no full batch per epoch; early stopping without a validation split)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: WarmupCosine
    train_loader: Any
    epochs: range
    work_dir: Path
    run_hash: str
    loss_fn: nn.Module
    val_loader: Any | None
    device: torch.device
    channels_last: bool
    precision: str
    scaler: torch.amp.GradScaler
    checkpoint_every_steps: int
    epoch_checkpoints: Iterable[int]
    extra_state: dict[str, Any]
    epoch_stats: Callable[[nn.Module, int], dict[str, Any]] | None
    on_step: Callable[[StepInfo], None] | None
    early_stop: Any | None
    desc: str
    log: Callable[[str], None]
    world: D.World = field(init=False)
    spe: int = field(init=False)  # optimizer steps per epoch
    keep: set[int] = field(init=False)  # the epoch labels whose ckpt-epoch-XXX.pt is kept
    param_names: list[str] = field(init=False)  # what the optimizer state's indices stand for
    resume_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.world = D.world()
        if not self.world.main:  # one voice: rank 0 logs and draws the progress bar
            self.log = _silent
        self.spe = len(self.train_loader)
        if self.spe <= 0:
            raise TrainingError(f"{self.desc}: the training set yields no full batch (steps per epoch = 0)")
        start, stop = self.epochs.start, self.epochs.stop
        self.keep = {int(e) for e in self.epoch_checkpoints if start <= int(e) <= stop}
        self.param_names = optimizer_param_names(self.optimizer, self.model)
        self.resume_path = self.work_dir / RESUME_FILE
        if self.early_stop is not None and self.val_loader is None:
            raise TrainingError(f"{self.desc}: early stopping needs a validation split")


@dataclass
class _Run:
    """Where the loop stands: what `resume.pt` holds besides the model, optimizer, scheduler, scaler and RNG
    states, plus what the call reports (`resumed_from`, `notes`)."""

    epoch: int  # data epoch (0-based) in progress
    step: int  # steps done within it
    global_step: int
    accum: dict[str, Any]  # the epoch's running sums (new_accum)
    history: list[dict[str, Any]]
    saved: dict[int, Path]  # epoch label -> its ckpt-epoch-XXX.pt
    plateau: dict[str, Any] | None  # early stopping's rule state and best weights, when the rule is on
    resumed_from: tuple[int, int] | None
    notes: list[str]


def _start(job: _Job, history_start: list[dict[str, Any]] | None) -> _Run:
    """The loop's starting point: `resume.pt` when it belongs to this run (same `run_hash`), else a fresh
    start in an emptied work directory. Under DDP every rank must reach the same verdict."""
    job.model.to(job.device)  # before loading optimizer state, which follows its parameters' device
    state_to_parameter_devices(job.optimizer)  # state loaded before the move (carried "continue" momentum)
    notes: list[str] = []
    state = try_resume(job.resume_path, job.run_hash, job.log, notes)
    if len(set(D.gather(state is None))) > 1:  # every rank read the same file: they must agree
        raise TrainingError(f"{job.desc}: the ranks disagree on whether {job.resume_path} can be resumed")
    if state is not None:
        return _resume(job, state, notes)
    return _fresh(job, history_start, notes)


def _resume(job: _Job, state: dict[str, Any], notes: list[str]) -> _Run:
    """Load the checkpointed model, optimizer, scheduler, scaler and RNG states; the loop goes on from the
    checkpoint's (epoch, step) with its epoch sums, history, epoch checkpoints and early-stopping state."""
    world = job.world
    job.model.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["scaler"])
    restore_rank_rng(state, world)
    epoch, step, global_step = state["epoch"], state["step"], state["global_step"]
    # the checkpoint holds the ranks' summed epoch accumulators: rank 0 carries them, the others add to 0
    accum = accum_from_state(state["accum"] if world.main else zero_accum(state["accum"]), job.device)
    history = list(state["history"])
    saved = {int(k): job.work_dir / v for k, v in state["epoch_checkpoints"].items()}
    plateau = state.get("early_stop") if job.early_stop is not None else None
    if plateau is None and job.early_stop is not None:  # the run_hash covers the rule: cannot happen
        raise TrainingError(f"{job.desc}: {job.resume_path} holds no early-stopping state")
    job.log(
        f"{job.desc}: resuming from {job.resume_path} at epoch {epoch + 1} step {step} (global step {global_step})"
    )
    return _Run(epoch, step, global_step, accum, history, saved, plateau, (epoch, step), notes)


def _fresh(job: _Job, history_start: list[dict[str, Any]] | None, notes: list[str]) -> _Run:
    """A start from the first epoch of `job.epochs` with an emptied work directory; `history_start` opens the
    history."""
    world = job.world
    D.barrier()  # every rank has read the old state before rank 0 clears it
    if world.main:
        if job.work_dir.exists():
            shutil.rmtree(job.work_dir)
        job.work_dir.mkdir(parents=True, exist_ok=True)
    if world.parallel and not world.main:  # own dropout / drop-path draws per rank, fixed by (seed, rank)
        seed_everything(torch.initial_seed() + 1_000_003 * world.rank)
    history = [dict(r) for r in history_start or []]
    plateau = {"rule": ES.new_state(), "best_model": None} if job.early_stop is not None else None
    return _Run(job.epochs.start, 0, 0, new_accum(job.device), history, {}, plateau, None, notes)


def _training_net(job: _Job) -> nn.Module:
    """`job.model` in train mode (channels-last when asked), wrapped for data parallelism: what the steps
    call. Under several ranks it is DDP, which averages the gradients in backward."""
    if job.channels_last:
        job.model.to(memory_format=torch.channels_last)
    job.model.train()
    return D.wrap(job.model, job.device)


def _finish(job: _Job, run: _Run) -> FitResult:
    """The call's result; with early stopping on, the best-validation epoch's weights go back into the model."""
    if run.plateau is not None:
        job.model.load_state_dict(run.plateau["best_model"])
    rule = run.plateau["rule"] if run.plateau is not None else None
    saved = dict(sorted(run.saved.items()))
    return FitResult(run.history, saved, run.resumed_from, run.global_step, job.work_dir, run.notes, rule)


def _snapshot(job: _Job, run: _Run, epoch: int, step: int) -> dict[str, Any]:
    """The full training state at (data epoch `epoch`, `step`); a collective under DDP (every rank calls it,
    rank 0 writes it)."""
    rng_ranks = D.gather(capture_rng())
    return {
        "format": STATE_FORMAT,
        "run_hash": job.run_hash,
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "param_names": job.param_names,
        "scheduler": job.scheduler.state_dict(),
        "scaler": job.scaler.state_dict(),
        "epoch": epoch,
        "step": step,
        "global_step": run.global_step,
        "steps_per_epoch": job.spe,
        "rng": rng_ranks[0],
        **({"rng_ranks": rng_ranks} if job.world.parallel else {}),
        "accum": accum_to_state(reduced_accum(run.accum)),
        "history": run.history,
        "epoch_checkpoints": {k: p.name for k, p in run.saved.items()},
        **({"early_stop": run.plateau} if run.plateau is not None else {}),
        **job.extra_state,
    }


def _save(job: _Job, snap: dict[str, Any], path: Path) -> None:
    if job.world.main:
        atomic_save(snap, path)
    D.barrier()  # no rank runs ahead of a checkpoint (a kill then loses at most the current step)


def _save_epoch_checkpoint(job: _Job, run: _Run, label: int) -> None:
    """Keep the state after `label` epochs as `ckpt-epoch-XXX.pt` (an epoch-start state, step 0)."""
    path = job.work_dir / f"ckpt-epoch-{label:03d}.pt"
    snap = _snapshot(job, run, label, 0)
    snap["kind"] = "epoch"
    _save(job, snap, path)
    run.saved[label] = path


def _train_epoch(job: _Job, run: _Run, net: nn.Module, stop: StopSignals) -> None:
    """The rest of data epoch `run.epoch`, from step `run.step`. Writes `resume.pt` every
    `checkpoint_every_steps` global steps and, when a stop signal arrived on any rank, raises `Preempted`
    after writing it (an epoch's last step is left to `_end_epoch`, which checkpoints anyway)."""
    bar = _progress(job, run) if job.world.main else None
    t_start = time.perf_counter()
    n_timed = 0
    every = job.checkpoint_every_steps
    for x, y in job.train_loader.batches(run.epoch, run.step):
        loss, b = _train_step(job, run, net, x, y)
        n_timed += b
        if job.on_step is not None:
            job.on_step(StepInfo(run.epoch, run.step, run.global_step, loss.detach(), stop))
        if bar is not None:
            _bar_update(bar, run.step, loss, n_timed, t_start, run.accum)
        stopping = D.any_rank(stop.received is not None, job.device)
        if run.step < job.spe and (stopping or (every > 0 and run.global_step % every == 0)):
            run.accum["time_s"] += time.perf_counter() - t_start
            t_start, n_timed = time.perf_counter(), 0
            _save(job, _snapshot(job, run, run.epoch, run.step), job.resume_path)
            if stopping:
                if bar is not None:
                    bar.close()
                stop.chain()
                raise Preempted(stop_signum(stop), job.resume_path, run.epoch, run.step)
    run.accum["time_s"] += time.perf_counter() - t_start
    if bar is not None:
        bar.close()


def _train_step(
    job: _Job, run: _Run, net: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """One optimizer step on the batch (x, y), then one scheduler step; adds the batch to the epoch sums.
    Returns the loss and the batch size."""
    x = to_device(x, job.device, job.channels_last)
    y = y.to(job.device, non_blocking=True)
    with autocast(job.device, job.precision):
        logits = net(x)
    loss = job.loss_fn(logits, y)
    job.optimizer.zero_grad(set_to_none=True)
    job.scaler.scale(loss).backward()
    job.scaler.step(job.optimizer)
    job.scaler.update()
    run.accum["lr"] = float(job.optimizer.param_groups[0]["lr"])  # the lr this step used
    job.scheduler.step()
    run.step += 1
    run.global_step += 1
    b = int(y.shape[0])
    run.accum["loss_sum"] += loss.detach().double() * b
    run.accum["correct"] += (logits.detach().argmax(-1) == hard_labels(y)).sum()
    run.accum["images"] += b
    return loss, b


def _end_epoch(job: _Job, run: _Run, stop: StopSignals) -> None:
    """Close data epoch `run.epoch`: its history row (train figures, validation, `epoch_stats`), the
    early-stopping rule, the epoch checkpoint when kept, and `resume.pt` at the next epoch's start. A stop
    signal then raises `Preempted`, unless the run has nothing left to train."""
    label = run.epoch + 1
    row = epoch_row(label, run.global_step, reduced_accum(run.accum), job.scheduler)
    if not math.isfinite(row["train_loss"]):
        raise TrainingError(f"{job.desc}: training loss became {row['train_loss']} in epoch {label}")
    if job.val_loader is not None:
        val = evaluate(
            job.model,
            job.val_loader.batches(0),
            device=job.device,
            channels_last=job.channels_last,
            precision=job.precision,
        )
        row["val_loss"], row["val_acc"] = val["loss"], val["acc"]
    if job.epoch_stats is not None:
        row.update(job.epoch_stats(job.model, label))
    run.history.append(row)
    job.log(epoch_line(job.desc, row, job.epochs.stop))
    if run.plateau is not None:
        run.plateau = _plateau_step(run.plateau, job.model, label, val, job.early_stop, job.desc, job.log)
    run.epoch, run.step = run.epoch + 1, 0
    run.accum = new_accum(job.device)
    if label in job.keep:
        _save_epoch_checkpoint(job, run, label)
    _save(job, _snapshot(job, run, run.epoch, 0), job.resume_path)
    more = run.epoch < job.epochs.stop and not _stopped(run.plateau)
    if D.any_rank(stop.received is not None, job.device) and more:
        stop.chain()
        raise Preempted(stop_signum(stop), job.resume_path, run.epoch, 0)


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


def _silent(msg: str) -> None:
    pass


def _progress(job: _Job, run: _Run) -> Any:
    """The epoch's progress (core.training.progress): tqdm's bar on a terminal, plain lines at a steady pace
    through the job's log elsewhere, nothing under TCNN_QUIET=1 or when the job logs nothing."""
    how = P.mode()
    if how == "off" or job.log is _silent:
        return None
    if how == "lines":
        last = next((r["val_acc"] for r in reversed(run.history) if r.get("val_acc") is not None), None)
        return P.LineProgress(
            job.desc, run.epoch, job.epochs.stop, job.spe, run.step, job.log, last_val_acc=last
        )
    from tqdm.auto import tqdm

    return tqdm(
        total=job.spe,
        initial=run.step,
        desc=f"{job.desc} {run.epoch + 1}/{job.epochs.stop}",
        unit="step",
        leave=False,
        dynamic_ncols=True,
    )


def _bar_update(bar: Any, step: int, loss: torch.Tensor, n: int, t0: float, accum: dict) -> None:
    bar.update(step - bar.n)
    if step % 10 == 0 or step == bar.total:
        dt = time.perf_counter() - t0
        bar.set_postfix(
            loss=f"{float(loss.detach()):.3f}", img_s=f"{n / dt:.0f}" if dt > 0 else "-", refresh=False
        )
