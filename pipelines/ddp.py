"""Data-parallel training stages in a sweep trial: Ray Train's ``TorchTrainer`` inside the Tune trial.

With ``workers_per_trial`` W > 1 a training stage (pretrain, finetune, control) runs as W Ray Train workers,
and a single-process stage (reparam, evaluate) as one, each holding 1/W of the trial's CPUs and GPUs; the
trial process keeps a CPU share and no GPU, so a trial of W GPUs fits a node of W GPUs. Workers may sit on
other nodes than the trial itself. Ray Train makes the process group (gloo on CPU, NCCL on GPU) and every
worker calls the same stage function the DVC path calls (``stages.<name>.run``), which trains under DDP
(core.training.distributed) and publishes from rank 0. The stage's own resume state (``runs/.partial/``)
makes a retried trial resume exactly, as with one worker. W = 1 calls the stage in the trial's process, as
before.

Placement (``spec["placement"]``, ``tcnn sweep --worker-placement``): Ray's strategy for the workers' bundles,
``pack`` (default: as few nodes as possible, what GPU nodes want) or ``spread`` / ``strict_spread`` (one
worker per node where possible / always). Every run appends the nodes its ranks ran on to
``<root>/workers.jsonl`` (:data:`WORKERS`).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from core.config import Params
from core.utils.atomic import append_json_line, atomic_write_json
from stages.harness import chain

RESULT = "result-{}.json"  # rank 0's return value, handed to the trial through the trial directory
NODES = "nodes-{}.json"  # the ranks' nodes, gathered by rank 0
WORKERS = "workers.jsonl"  # one line per data-parallel stage run: {"stage", "nodes" (by rank), ...}
PLACEMENTS = ("pack", "spread", "strict_pack", "strict_spread")  # Ray's placement strategies, lower case


def node_name() -> str:
    """The node this process runs on: SLURM's name for it inside a SLURM job, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def run_stage(
    stage: str,
    params: Params,
    root: Path,
    spec: dict[str, Any],
    *,
    workers: int | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``stages.<stage>.check(params, root)`` then ``stages.<stage>.run(params, root=root, **options)``, as the DVC
    path runs them (`stages.harness.runner.stage_main`), on `workers` (default ``params.workers_per_trial``)
    Ray Train workers; in the trial's own process when ``workers_per_trial`` is 1. ``options``: JSON-able
    keyword arguments of the stage function (evaluate's ``shared`` store)."""
    options = dict(options or {})
    module = importlib.import_module(f"stages.{stage}")
    if getattr(module, "check", None) is not None:
        module.check(params, root)  # what run needs, before it starts: run does not test it again
    if params.workers_per_trial <= 1:
        return module.run(params, root=root, **options)
    workers = params.workers_per_trial if workers is None else workers
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    share = spec.get("worker_resources") or {"cpu": 1.0, "gpu": 0.0}
    use_gpu = share["gpu"] > 0
    resources = {"CPU": share["cpu"], **({"GPU": share["gpu"]} if use_gpu else {})}
    partial = Path(root) / chain.PARTIAL
    out, nodes = partial / RESULT.format(stage), partial / NODES.format(stage)
    out.unlink(missing_ok=True)
    nodes.unlink(missing_ok=True)
    placement = spec.get("placement") or "pack"
    started = time.time()
    trainer = TorchTrainer(
        _worker,
        train_loop_config={
            "stage": stage,
            "params": params,
            "root": str(root),
            "options": options,
            "out": str(out),
            "nodes": str(nodes),
            "threads": max(1, int(share["cpu"])),
        },
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker=resources,
            placement_strategy=placement.upper(),
        ),
        run_config=RunConfig(
            name=f"{Path(root).name}-{stage}",
            storage_path=str(Path(spec["sweep_dir"]) / "ray-train"),
            failure_config=FailureConfig(max_failures=0),  # the Tune trial retries (sweep.max_failures)
        ),
    )
    trainer.fit()
    record_workers(root, stage, json.loads(nodes.read_text()), placement, started)
    return json.loads(out.read_text())


def record_workers(root: Path, stage: str, nodes: list[str], placement: str, started: float) -> None:
    """One line in ``<root>/workers.jsonl``: where the stage's ranks ran."""
    line = {
        "stage": stage,
        "nodes": nodes,
        "placement": placement,
        "started": started,
        "finished": time.time(),
    }
    append_json_line(Path(root) / WORKERS, line)


def worker_nodes(*roots: Path) -> list[str]:
    """Every node a data-parallel stage run in any of ``roots`` had a rank on (sorted; [] without any)."""
    nodes: set[str] = set()
    for path in (Path(r) / WORKERS for r in roots):
        for line in path.read_text().splitlines() if path.is_file() else []:
            nodes.update(json.loads(line).get("nodes", []))
    return sorted(nodes)


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: the stage function, with its rank's threads; rank 0 hands back the metrics."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    result = importlib.import_module(f"stages.{config['stage']}").run(
        config["params"], root=Path(config["root"]), **config.get("options", {})
    )
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_name())
    if dist.get_rank() == 0:
        atomic_write_json(Path(config["nodes"]), nodes)
        atomic_write_json(Path(config["out"]), result)
