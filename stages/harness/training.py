"""Plumbing shared by the training stages (pretrain, reparam, finetune): data, loaders, knobs, publishing."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from pydantic import BaseModel

from core.config import Params, SourceConfig
from core.data import Datasets, load_datasets, make_loader
from core.models.kinds import ModelKind
from core.models.spec import pretraining_spec
from core.training import distributed as D
from core.training.checkpoint import CheckpointError, atomic_save, load, model_from
from core.training.environment import select_device
from core.training.history import csv_text, history_rows_flat
from core.training.model_eval import evaluate
from core.utils.atomic import atomic_write_json, atomic_write_text, remove_stale_temps
from core.utils.errors import first_line
from stages.harness.runner import EXIT_PREEMPTED, RANK_STATUS_ENV, STAGE_SIGNALS, StageError

EVAL_BATCH = 500


# Keys that change how a run is carried out, not what it computes: left out of the resume identity.
OPERATIONAL_KEYS = ("checkpoint_every_steps", "num_workers")


def section_identity(section: BaseModel) -> dict[str, Any]:
    return {k: v for k, v in section.model_dump(mode="json").items() if k not in OPERATIONAL_KEYS}


# Where the data lives and how it is sharded: its content is an input of the identity (the manifest's hash),
# so a moved or re-sharded copy of the same images names the same result.
DATA_LOCATION_KEYS = ("dir", "source", "shard_rows")


def data_identity(params: Params) -> dict[str, Any]:
    """What the data section means for a training run (stages.harness.identity): no location, no operational
    keys; ``limit`` (the smoke size) only where it is set and ``val_from`` only where it is not "train", so
    the identities of other runs are those they had before the keys existed."""
    out = {k: v for k, v in section_identity(params.data).items() if k not in DATA_LOCATION_KEYS}
    if out.get("limit") is None:
        out.pop("limit", None)
    if out.get("val_from") == "train":
        out.pop("val_from")
    return out


def input_normalization(params: Params) -> dict[str, Any] | None:
    """The normalization an imported CNN expects (`core.models.importing.normalization`: pretrain.source's
    mean / std, timm's pretrained_cfg, torchvision's ImageNet statistics), used by every stage for that model;
    None: the dataset's own statistics (its manifest), as for a CNN trained here."""
    if params.pretrain.source is None:
        return None
    from core.models.importing import normalization

    return normalization(params.model.arch, params.pretrain.source) or None


def datasets(params: Params, root: Path = Path(".")) -> Datasets:
    """The train/val/test arrays of `root / data.dir` (root: the repo under DVC, a trial dir under Ray),
    normalized as the model expects (:func:`input_normalization`)."""
    ds = _load_datasets(params, root)
    norm = input_normalization(params)
    if norm is None:
        return ds
    if len(norm["mean"]) != ds.in_chans:
        raise StageError(f"pretrain.source: normalization has {len(norm['mean'])} channels ({norm['from']}), "
                         f"the dataset {ds.in_chans}")  # fmt: skip
    return dataclasses.replace(ds, mean=list(norm["mean"]), std=list(norm["std"]))


def _load_datasets(params: Params, root: Path) -> Datasets:
    try:
        return load_datasets(
            Path(root) / params.data.dir,
            val_size=params.data.val_size,
            sample_fraction=params.data.sample_fraction,
            seed=params.cnn_seed,  # the split belongs to the CNN (pretrain.seed)
            stream_size=params.data.image_size if params.data.stream else None,
            limit=params.data.caps(),
            val_from=params.data.val_from,
        )
    except (OSError, ValueError, KeyError) as err:
        msg = first_line(err)
        raise StageError(f"data.dir: {params.data.dir}: {msg}") from None


@dataclass
class Loaders:
    train: Any
    val: Any | None
    test: Any


def loaders(
    ds: Datasets, *, batch_size: int, seed: int, augment: Any, size: int | None, num_workers: int
) -> Loaders:
    """Train/val/test loaders (``num_workers``: data.num_workers); under data parallelism each yields this rank's
    shard of every global batch."""
    nw = num_workers
    w = D.world()
    if batch_size % w.size:
        raise StageError(f"batch size {batch_size} is not divisible by the {w.size} data-parallel workers")
    shard = {"rank": w.rank, "world_size": w.size, "device": training_device()}  # device: pinned memory
    train = make_loader(
        ds,
        "train",
        batch_size=batch_size,
        train=True,
        seed=seed,
        augment=augment,
        image_size=size,
        num_workers=nw,
        **shard,
    )
    ev = {"batch_size": EVAL_BATCH, "train": False, "seed": seed, "image_size": size, "num_workers": nw,
          **shard}  # fmt: skip
    val = make_loader(ds, "val", **ev) if len(ds.val_y) else None
    test = make_loader(ds, "test", **ev)
    return Loaders(train, val, test)


def _torchrun(name: str, workers: int, argv: list[str]) -> None:
    """Run the stage as `workers` torchrun processes (DDP on one node) and exit with their status: torchrun
    makes the process group and forwards a stop signal to every rank (which checkpoints and stops); this
    process forwards the signals it gets to torchrun, waits, and exits 75 when every rank stopped resumably
    (torchrun itself reports 1 for any failing rank). Each rank records its status in $TCNN_RANK_STATUS_DIR
    (stages.harness.runner.stage_main)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
    print(f"{name}: {workers} data-parallel workers (torchrun)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="tcnn-ranks-") as status_dir:
        env = {**os.environ, RANK_STATUS_ENV: status_dir}
        proc = subprocess.Popen([*cmd, "-m", f"stages.{name}", *argv], env=env)
        forwarded = {s: signal.signal(s, lambda sig, _f: proc.send_signal(sig)) for s in STAGE_SIGNALS}
        try:
            code = proc.wait()
        finally:
            for s, prev in forwarded.items():
                signal.signal(s, prev)
        ranks = [int(p.read_text()) for p in Path(status_dir).glob("rank-*") if p.read_text().strip()]
    if code != 0 and len(ranks) == workers and set(ranks) == {EXIT_PREEMPTED}:
        code = EXIT_PREEMPTED
    raise SystemExit(code)


@contextlib.contextmanager
def data_parallel(params: Params, name: str, argv: list[str]) -> Iterator[None]:
    """A training stage's command line with `workers_per_trial` > 1 relaunches itself under torchrun; each
    torchrun (or Ray Train) worker joins the process group the launcher described (WORLD_SIZE set)."""
    if params.workers_per_trial > 1 and "WORLD_SIZE" not in os.environ:
        _torchrun(name, params.workers_per_trial, argv)
    with D.process_group_from_env(select_device()):
        yield


def training_device() -> torch.device:
    """The device a training stage runs on (core.training.environment.select_device; cuda:LOCAL_RANK per DDP rank)."""
    return D.device_for_rank(select_device())


def execution_identity(params: Params, workers: int | None = None) -> dict[str, Any]:
    """How a training run executes, where it changes the result: the precision (when not "auto") and the
    data-parallel world size (when > 1: BatchNorm statistics, per shard on CPU, and the ranks' random streams
    depend on it; default: this process's world). Empty for the default run, so its identity is unchanged."""
    size = D.world().size if workers is None else workers
    return {
        **({"precision": params.precision} if params.precision != "auto" else {}),
        **({"workers": size} if size > 1 else {}),
    }


def evaluate_split(model: nn.Module, loader: Any, device: torch.device, channels_last: bool, params: Params
                   ) -> dict[str, float]:  # fmt: skip
    """Loss and accuracy over a whole evaluation split (summed over data-parallel ranks)."""
    return evaluate(model, loader.batches(0), device=device, channels_last=channels_last,
                    precision=params.precision)  # fmt: skip


def checkpoint_every_steps(params: Params, stage: str) -> int:
    """Mid-epoch checkpoint cadence: env TCNN_CHECKPOINT_EVERY_STEPS, else `<stage>.checkpoint_every_steps`
    (the finetune section for fine-tuning and its control, the pretrain section otherwise). 0 = only at epoch
    ends."""
    env = os.environ.get("TCNN_CHECKPOINT_EVERY_STEPS")
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise StageError(f"TCNN_CHECKPOINT_EVERY_STEPS: expected an integer, got {env!r}") from None
    return (params.finetune if stage == "finetune" else params.pretrain).checkpoint_every_steps


def use_channels_last(device: torch.device) -> bool:
    """channels_last pays for convolutions on both CUDA and oneDNN CPU kernels; env TCNN_CHANNELS_LAST=0 off."""
    env = os.environ.get("TCNN_CHANNELS_LAST")
    if env is not None:
        return env.lower() in ("1", "true", "yes")
    return True


def extra_state(spec: dict[str, Any], ds: Datasets, image_size: int | None) -> dict[str, Any]:
    """What every checkpoint carries besides weights: how to rebuild and feed the model."""
    return {
        "model_spec": spec,
        "normalization": {"mean": list(ds.mean), "std": list(ds.std)},
        "image_size": int(image_size or ds.image_size),
    }


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}


def mean_rate(history: list[dict[str, Any]]) -> float | None:
    images = sum(r["images_per_s"] * r["train_time_s"] for r in history if r.get("train_time_s"))
    secs = sum(r["train_time_s"] for r in history if r.get("train_time_s"))
    return images / secs if secs > 0 else None


def fit_metrics(
    result: Any, test: dict[str, float], model: nn.Module, device: torch.device, t_wall: float, *,
    last: dict[str, Any], trained: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The metrics.json fields of every training run (pretraining, fine-tuning and its control): the published
    epoch's (``last``) train / validation loss and accuracy, the test split's, and the run's steps, size, world,
    resumption and speed over the ``trained`` epochs' rows (``wall_s`` since ``t_wall``)."""
    return {
        "train_loss": last.get("train_loss"),
        "train_acc": last.get("train_acc"),
        "val_loss": last.get("val_loss"),
        "val_acc": last.get("val_acc"),
        "test_loss": test["loss"],
        "test_acc": test["acc"],
        "steps": result.global_step,
        "params_count": sum(t.numel() for t in model.parameters()),
        "device": device.type,
        "workers": D.world().size,
        "resumed": result.resumed_from is not None,
        "images_per_s": mean_rate(trained),
        "train_time_s": sum(r["train_time_s"] for r in trained),
        "wall_s": time.perf_counter() - t_wall,
    }


def require_checkpoint(path: Path, what: str) -> None:
    """A stage's pre-flight check (before any run opens): the checkpoint it will read exists."""
    if not path.is_file():
        raise StageError(f"{path}: no such checkpoint (the {what})")


def require_dataset(params: Params, root: Path) -> None:
    """A training stage's pre-flight check: the prepared dataset's manifest is readable (its shards are
    verified where they are read)."""
    from core.data import DataError, read_manifest

    try:
        read_manifest(root / params.data.dir)
    except (DataError, FileNotFoundError, ValueError) as err:
        raise StageError(f"data.dir: {err} (run the prepare stage)") from None


def load_checkpoint(path: Path, require: tuple[str, ...], what: str) -> dict[str, Any]:
    try:
        return load(path, require=require)
    except CheckpointError as err:
        raise StageError(f"{err} (the {what})") from None


def rebuild(ckpt: dict[str, Any], path: Path) -> nn.Module:
    """The model of a checkpoint a stage read from ``path`` (`core.training.checkpoint.model_from`: rebuilt
    from its spec, weights loaded); StageError in one line when it cannot be."""
    try:
        return model_from(ckpt, path)
    except CheckpointError as err:
        raise StageError(str(err)) from None


@dataclass(frozen=True)
class CnnWanted:
    """The pretrained network the params make, read of them once (:meth:`of`): what
    :func:`check_cnn_checkpoint` holds a checkpoint to. ``kind`` is model.kind's record, looked up here and
    nowhere after; ``source`` is pretrain.source (an imported CNN: its file's sha256), None for a CNN trained
    here."""

    kind: ModelKind
    arch: str
    options: dict[str, Any]
    image_size: int
    source: SourceConfig | None

    @classmethod
    def of(cls, params: Params) -> CnnWanted:
        m = params.model
        return cls(m.record, m.arch, m.options, params.data.image_size, params.pretrain.source)


def check_cnn_checkpoint(ckpt: dict[str, Any], want: CnnWanted, path: Path) -> dict[str, Any]:
    """The pretrained CNN a stage reads (reparam's t1 checkpoint, evaluate's ``cnn-final.pt``) is the one the
    params make (``want``), not a file of another run put in its place: an import of the configured source (its
    sha256), and a network of the spec the params pretrain (kind, arch, options, image size;
    `core.models.spec.pretraining_spec`). Returns that spec: the params' own, checked with them by the config,
    so its network builds without checking it again (`core.models.spec.network`)."""
    source = want.source
    if source is not None:
        imported = ckpt.get("source") or {}
        if source.is_file and imported.get("sha256") != source.sha256:
            raise StageError(f"{path}: holds an import of sha256 {imported.get('sha256')}, pretrain.source.sha256 "
                             f"is {source.sha256} (rerun pretrain)")  # fmt: skip
    held = ckpt.get("model_spec") or {}
    want_spec = pretraining_spec(want.kind, want.arch, want.options, held.get("num_classes"),
                                 held.get("in_chans"), want.image_size)  # fmt: skip
    differ = sorted(k for k in set(held) | set(want_spec) if held.get(k) != want_spec.get(k))
    if differ:
        raise StageError(
            f"{path}: holds a {held.get('kind')}/{held.get('arch')} network, the params pretrain "
            f"{want_spec['kind']}/{want_spec['arch']} (it differs in {', '.join(differ)}; rerun pretrain)"
        )
    return want_spec


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.publish")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def publish(
    work_dir: Path | None,
    out_dir: Path,
    *,
    checkpoints: dict[str, Path] | None = None,
    stale_glob: str | None = None,
    objects: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
    csvs: dict[str, list[dict[str, Any]]] | None = None,
    metrics: dict[str, Any] | None = None,
) -> None:
    """Write a stage's outputs into `out_dir` (each file atomically, metrics.json last), then drop the work
    dir. Files are hard-linked out of the work dir, so a kill while publishing leaves the resume state whole.
    Under data parallelism only rank 0 publishes (the other ranks hold the same model)."""
    if not D.world().main:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir, (".*.tmp", ".*.publish"))  # left by a publish that was killed mid-write
    checkpoints = checkpoints or {}
    if stale_glob:
        for f in out_dir.glob(stale_glob):
            if f.name not in checkpoints:
                f.unlink()
    for name, src in checkpoints.items():
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(Path(src), out_dir / name)
    for name, obj in (objects or {}).items():
        atomic_save(obj, out_dir / name)
    if history is not None:
        atomic_write_text(out_dir / "history.csv", csv_text(history_rows_flat(history)))
        atomic_write_json(out_dir / "history.json", history)
    for name, rows in (csvs or {}).items():
        atomic_write_text(out_dir / name, csv_text(rows))
    if metrics is not None:
        atomic_write_json(out_dir / "metrics.json", metrics)
    if work_dir is not None and work_dir.exists():
        shutil.rmtree(work_dir)
        with contextlib.suppress(OSError):
            work_dir.parent.rmdir()  # runs/.partial when no other stage is in progress
