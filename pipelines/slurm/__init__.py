"""SLURM launch: submitit executors and a Ray cluster on a SLURM allocation.

Only ``pipelines/`` and ``infra/`` know SLURM (DESIGN section 2). The pieces:

- :mod:`~pipelines.slurm.executor`: :func:`make_executor`, a submitit SLURM executor with one task per node
  (the Ray layout) whose status polling falls back to ``squeue`` when ``sacct`` has no accounting database
  (small or test clusters); :func:`wait_result` follows a job to its result.
- :mod:`~pipelines.slurm.ray_ports`: :class:`RayPorts`, every port a Ray node opens, pinned (``from_base``)
  or chosen free (``find_free``).
- :mod:`~pipelines.slurm.ray_cluster`: :class:`RayClusterJob`, the submitit callable. Task 0 (first node) runs
  ``ray start --head --block`` with explicit ``--num-cpus/--num-gpus``, pinned ports and a short per-job
  ``--temp-dir`` (unix socket paths must stay under 107 bytes), writes a rendezvous file with the head's
  address to a shared folder, waits for all nodes to join, then runs the driver function with
  ``ray.init(address=...)`` done and ``RAY_ADDRESS`` set. The other tasks poll the rendezvous file, join with
  ``ray start --address=... --block`` and leave when the head writes its ``done`` marker. Several nodes run
  with ``--no-kill``: a lost worker node ends only its own task (Ray and the driver carry on without it),
  and a lost head node is noticed by the worker tasks, which requeue the job (:mod:`~pipelines.slurm.head_loss`).
  It is ``Checkpointable``: on the preemption/time-limit signal (USR2) submitit requeues the job and the
  driver runs again from the start, so drivers must resume from their own state (``Tuner.restore``).
  :func:`launch_ray_cluster` submits it.
- :mod:`~pipelines.slurm.ray_node`: one node's side of a job: its SLURM environment, Ray's token
  authentication, the Ray processes a previous run left behind.

``infra/slurm/ray_cluster.sbatch`` is the plain-sbatch equivalent (srun instead of submitit).
"""

import importlib
from typing import Any

#: What a SLURM job submitted before this package existed names by its old module path (submitit's job file
#: pickles the job's callable and its config): looked up here on first use, so such a queued or requeued job
#: still starts.
_MOVED = {
    "RayClusterJob": "pipelines.slurm.ray_cluster",
    "RayClusterConfig": "pipelines.slurm.ray_cluster",
    "RayPorts": "pipelines.slurm.ray_ports",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
