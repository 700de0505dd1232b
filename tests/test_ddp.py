"""Data-parallel training: DDP on 2 CPU workers (gloo) through both launchers.

- Ray Train (TorchTrainer, what a sweep trial uses): `fit` on 2 workers equals single-process `fit` on the
  same global batches to float tolerance -- exactly for a network without BatchNorm, and for a ResNet with
  BatchNorm against the single-process "ghost batch" reference (torch has no CPU SyncBatchNorm, so each rank
  normalizes its half; core.training.distributed).
- torchrun (what `dvc repro` uses for `workers_per_trial: 2`): a 2-worker pretraining stopped by SIGTERM and
  killed by SIGKILL resumes to outputs bitwise equal to an unbroken 2-worker run, and its checkpoints load
  in a single process (the reparam stage).
A sweep with `workers_per_trial: 2` on the one-node SLURM cluster, and the same sweep with the workers on two
nodes, are in tests/test_slurm_multinode.py.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from _train_helpers import (
    assert_same_outputs,
    fmnist_slice,
    run_stage,
    stage_cmd,
    stage_env,
    tiny_params,
    write_dataset,
    write_params,
)

from core.data import BatchLoader
from core.training.resume_file import RESUME_FILE

MEAN, STD = [0.29], [0.35]
STEPS_EPOCHS = 2


# ------------------------------------------------------------------------------------------ the loader


@pytest.mark.parametrize("world", [2, 4])
def test_rank_shards_together_are_the_single_process_batch(world: int) -> None:
    from core.config import AugmentConfig

    x, y = fmnist_slice(64, 1)["train"]
    aug = AugmentConfig(crop_padding=2, hflip=True, randaugment="rand-m9-mstd0.5-inc1")
    kw = {"batch_size": 16, "train": True, "seed": 3, "mean": MEAN, "std": STD, "augment": aug}
    whole = BatchLoader(x, y, **kw)
    ranks = [BatchLoader(x, y, rank=r, world_size=world, **kw) for r in range(world)]
    assert len(ranks[0]) == len(whole)  # steps per epoch are global
    for step in range(len(whole)):
        xs, ys = zip(*(r.batch(1, step) for r in ranks))
        wx, wy = whole.batch(1, step)
        assert all(len(b) == 16 // world for b in ys)
        assert torch.equal(torch.cat(xs), wx) and torch.equal(torch.cat(ys), wy)
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel workers"):
        BatchLoader(x, y, rank=0, world_size=3, **kw)


def test_eval_shards_cover_a_ragged_last_batch_once() -> None:
    x, y = fmnist_slice(1, 23)["test"]
    kw = {"batch_size": 10, "train": False, "seed": 0, "mean": MEAN, "std": STD}
    got = [
        torch.cat([b for _, b in BatchLoader(x, y, rank=r, world_size=2, **kw).batches(0)]) for r in (0, 1)
    ]
    assert sorted(torch.cat(got).tolist()) == sorted(y.tolist())


# ------------------------------------------------------------------------------ Ray Train equivalence


def _nets() -> dict[str, nn.Module]:
    """A network without batch statistics, and the project's ResNet (BatchNorm, affine drawn as trained)."""
    from core.models import kinds
    from core.models.spec import build_from_spec, pretraining_spec

    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    resnet = build_from_spec(pretraining_spec(kinds.get("cnn"), "resnet10_cifar", {}, 10, 1, 28))
    return {"plain": plain, "resnet": resnet}


def _fit(net: nn.Module, x: np.ndarray, y: np.ndarray, work: Path, rank: int = 0, world: int = 1) -> dict:
    from core.config import AugmentConfig
    from core.training.loop import fit
    from core.training.optim import WarmupCosine

    loader = BatchLoader(x, y, batch_size=32, train=True, seed=5, mean=MEAN, std=STD, rank=rank,
                         world_size=world, augment=AugmentConfig(crop_padding=2, hflip=True))  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = WarmupCosine(opt, total_steps=STEPS_EPOCHS * len(loader), warmup_steps=2)
    res = fit(net, opt, sched, loader, epochs=range(STEPS_EPOCHS), work_dir=work, run_hash="ddp",
              device=torch.device("cpu"), log=lambda m: None)  # fmt: skip
    return {"state": {k: v.clone() for k, v in net.state_dict().items()}, "history": res.history}


def _ray_worker(config: dict) -> None:
    """One Ray Train worker: both networks trained under DDP; rank 0 writes the results."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    nets = _nets()
    out = {
        n: _fit(m, config["x"], config["y"], Path(config["tmp"]) / f"w-{n}", rank, world)
        for n, m in nets.items()
    }
    out["world"] = world
    if rank == 0:
        Path(config["tmp"], "ddp.pkl").write_bytes(pickle.dumps(out))


def _ghost_batch_reference(net: nn.Module, x: np.ndarray, y: np.ndarray, world: int) -> dict:
    """What DDP computes on CPU, by hand in one process: each global batch split in `world` shards, each
    shard's loss through BatchNorm in train mode on its own statistics, gradients averaged; the running
    statistics those of shard 0 (DDP broadcasts rank 0's buffers)."""
    from core.config import AugmentConfig
    from core.training.optim import WarmupCosine

    loader = BatchLoader(x, y, batch_size=32, train=True, seed=5, mean=MEAN, std=STD,
                         augment=AugmentConfig(crop_padding=2, hflip=True))  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = WarmupCosine(opt, total_steps=STEPS_EPOCHS * len(loader), warmup_steps=2)
    net.train()
    for epoch in range(STEPS_EPOCHS):
        for xb, yb in loader.batches(epoch):
            opt.zero_grad()
            buffers = None
            for i, (xs, ys) in enumerate(zip(xb.chunk(world), yb.chunk(world))):
                (nn.functional.cross_entropy(net(xs), ys) / world).backward()
                if i == 0:
                    buffers = {k: v.clone() for k, v in net.named_buffers()}
            with torch.no_grad():
                for k, v in net.named_buffers():
                    v.copy_(buffers[k])
            opt.step()
            sched.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.mark.slow
def test_ray_train_ddp_equals_single_process_training(tmp_path: Path) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    x, y = fmnist_slice(256, 1)["train"]
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # ray.init installs Ray's SIGTERM handler in pytest's process: conftest's autouse fixture restores ours
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        TorchTrainer(
            _ray_worker,
            train_loop_config={"x": x, "y": y, "tmp": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="ddp", storage_path=str(tmp_path / "ray")),
        ).fit()
    finally:
        ray.shutdown()
    got = pickle.loads((tmp_path / "ddp.pkl").read_bytes())
    assert got["world"] == 2

    # the references on one thread, as each worker: the kernels' summation order then matches, which matters
    # for BatchNorm nets (2 threads instead of 1 alone moves this ResNet's weights by ~7e-4 in 16 steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _fit(_nets()["plain"], x, y, tmp_path / "single")
        ghost = _ghost_batch_reference(_nets()["resnet"], x, y, 2)
        full = _fit(_nets()["resnet"], x, y, tmp_path / "full")["state"]
    finally:
        torch.set_num_threads(threads)
    diff = _max_diff(got["plain"]["state"], single["state"])
    print(f"DDP(2 gloo workers) vs one process, no BatchNorm: max |weight diff| = {diff:.2e}")
    assert diff < 1e-5
    for a, b in zip(got["plain"]["history"], single["history"]):  # the loss/accuracy summed over ranks
        assert a["train_acc"] == b["train_acc"] and abs(a["train_loss"] - b["train_loss"]) < 1e-5

    d_ghost, d_full = _max_diff(got["resnet"]["state"], ghost), _max_diff(got["resnet"]["state"], full)
    print(
        f"ResNet (BatchNorm): vs ghost-batch reference {d_ghost:.2e}; vs one process on the full batch {d_full:.2e}"
    )
    assert d_ghost < 1e-6
    assert d_full > 100 * max(d_ghost, 1e-7)  # the difference is BatchNorm's, and the test can see it


# ---------------------------------------------------------------------------------- torchrun: kill, resume


def _wait_for_step(path: Path, proc: subprocess.Popen, after: float) -> None:
    deadline = time.monotonic() + 300
    while not (path.exists() and path.stat().st_mtime > after):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_two_worker_pretraining_resumes_exactly(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", 1600, 200)
    params = write_params(
        tmp_path / "params.yaml",
        tiny_params(data, workers_per_trial=2, pretrain={"epochs": 3, "augment": {"label_smoothing": 0.1}},
                    reparam={"epoch": 1}),
    )  # fmt: skip  # 30 steps an epoch: the kills land mid-run
    env = {"TCNN_CHECKPOINT_EVERY_STEPS": "2"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    done = run_stage("pretrain", params, ref, **env)
    assert done.returncode == 0, done.stderr
    assert "2 data-parallel workers (torchrun)" in done.stderr

    resume = run / "runs" / ".partial" / "pretrain" / RESUME_FILE
    for sig in (signal.SIGTERM, signal.SIGKILL):
        t0 = time.time()
        proc = subprocess.Popen(stage_cmd("pretrain", params), cwd=run, env=stage_env(**env),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        _wait_for_step(resume, proc, t0)
        time.sleep(random.Random(sig).uniform(0.0, 0.1))
        if sig == signal.SIGTERM:
            proc.send_signal(sig)  # torchrun forwards it to both ranks, which checkpoint and stop
        else:  # the node dies: torchrun and its workers (each in its own session) all at once
            import psutil

            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):  # a child may exit between listing and kill
                    p.kill()
        out, _ = proc.communicate(timeout=120)
        # SIGTERM: both ranks checkpoint and exit 75, and the launching process exits 75 with them
        assert proc.returncode == (75 if sig == signal.SIGTERM else -signal.SIGKILL), out
        assert resume.exists(), out
    done = run_stage("pretrain", params, run, **env)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stderr
    assert_same_outputs(run / "runs" / "pretrain", ref / "runs" / "pretrain")

    # rank 0's checkpoints load in one process: the single-process reparam stage converts them exactly
    rep = run_stage("reparam", params, ref)
    assert rep.returncode == 0, rep.stderr
    eq = json.loads((ref / "runs" / "reparam" / "equivalence.json").read_text())
    (large,) = [i for i in eq["inits"] if i["init"] == "large"]  # the function-preserving init
    assert large["max_abs_logit_diff"] < 1e-4 and large["prediction_agreement"] == 1.0
