"""Data-parallel training (PyTorch DDP) inside an existing process group.

tcnn never builds a process group by hand: a launcher does (torchrun under ``dvc repro`` -- see
``stages.harness.runner`` -- or Ray Train's ``TorchTrainer`` in a sweep trial -- see ``pipelines.ddp``), and these helpers
only read it. Without a group, or with one process, every helper is the single-process identity, so the
training loop has one code path.

Semantics, for a global batch B on W ranks (core.data.BatchLoader shards each global batch by rank):
- Each rank's loss is the mean over its B/W samples and DDP averages the gradients, so the update equals the
  single-process update on the whole global batch, up to float summation order -- except for BatchNorm,
  whose batch statistics cover one rank's shard ("ghost" batches of B/W). On CUDA the BNs become
  ``SyncBatchNorm`` (statistics over the global batch, as timm's ``--sync-bn``); torch has no CPU
  SyncBatchNorm, so CPU runs keep per-shard statistics (tests/test_ddp.py checks both facts).
- Rank 0 writes every checkpoint; the model's state dict is the unwrapped module's, so a checkpoint loads
  at any world size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's rank and the world size of the initialized default process group (else 0 of 1)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def env_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun, Ray Train) sets it for its workers; 1 when absent."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@contextlib.contextmanager
def process_group_from_env(device: torch.device) -> Iterator[World]:
    """Join the process group a launcher described in the environment (torchrun's ``env://`` rendezvous:
    MASTER_ADDR/PORT, RANK, WORLD_SIZE); gloo on CPU, NCCL on CUDA (each rank on cuda:LOCAL_RANK).
    Does nothing when the group exists already (Ray Train made it) or there is one process."""
    if dist.is_initialized() or env_world_size() <= 1:
        yield world()
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        yield world()
    finally:
        dist.destroy_process_group()


def device_for_rank(device: torch.device) -> torch.device:
    """cuda:LOCAL_RANK for a CUDA rank (one GPU per process), the device unchanged otherwise."""
    if device.type == "cuda" and device.index is None and env_world_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP around `model` when the world has several ranks (SyncBatchNorm on CUDA), else `model` itself.
    DDP broadcasts rank 0's parameters and buffers at construction, so every rank starts equal."""
    if not world().parallel:
        return model
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    return nn.parallel.DistributedDataParallel(model)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over ranks (a new tensor; `t` itself when alone)."""
    if not world().parallel:
        return t
    out = t.detach().clone()
    if out.device.type == "cpu" and dist.get_backend() == "nccl":
        out = out.cuda()
    dist.all_reduce(out)
    return out.to(t.device)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on one (a stop signal seen by any rank stops all at the same
    step boundary)."""
    if not world().parallel:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    w = world()
    if not w.parallel:
        return [obj]
    out: list[Any] = [None] * w.size
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world().parallel:
        dist.barrier()
