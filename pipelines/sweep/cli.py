"""`tcnn sweep` (also ``python -m pipelines.sweep``): the command line, run here or submitted to SLURM.

    tcnn sweep --params params.yaml [-S key=value ...] [--address local|auto|HOST:PORT] [--name NAME]
               [--resume | --auto-resume] [--num-cpus N] [--from-search SEARCH [--force]]
    tcnn sweep --params params.yaml --slurm [--nodes N] [--cpus-per-node C] [--gpus-per-node [TYPE:]G]
               [--partition P] [--sbatch KEY=VALUE ...] [--time MIN] [--detach]
               [--worker-placement pack|spread|...]

The driver (pipelines/sweep/driver.py) runs here, or with ``--slurm`` inside a SLURM allocation that
pipelines.slurm.ray_cluster.launch_ray_cluster starts (:func:`submit_slurm`; :func:`follow` prints the job's progress).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.utils.errors import first_line
from pipelines.ddp import PLACEMENTS
from pipelines.sweep.driver import run_sweep, slurm_driver
from pipelines.sweep.driver_lines import say
from pipelines.sweep.plan import SweepError
from pipelines.sweep.sweep_params import load_sweep_params
from pipelines.sweep.sweep_spec import SWEEP_JSON, build_spec, check_resources, reconcile
from pipelines.sweep.tuner import check_address, check_multinode_tracking
from stages.harness.runner import EXIT_IOERR, Stopped, io_error_line, stop_on_signals

# ---------------------------------------------------------------------------------------------- SLURM


def submit_slurm(spec: dict, args: argparse.Namespace) -> int:
    from pipelines.slurm.executor import gpu_count, make_executor, sbatch_options
    from pipelines.slurm.ray_cluster import RayClusterConfig, launch_ray_cluster
    from pipelines.slurm.ray_ports import RayPorts

    if args.nodes < 1:
        raise SweepError(f"--nodes {args.nodes}: must be at least 1")
    try:
        extra = sbatch_options(args.sbatch)
        count = gpu_count(args.gpus_per_node)
        gpus = args.gpus_per_node if ":" in args.gpus_per_node else count  # TYPE:N as given
    except ValueError as err:
        raise SweepError(str(err)) from None
    check_multinode_tracking(spec, args.nodes)
    w = spec.get("workers", 1)
    cpus = args.cpus_per_node or max(1, math.ceil(spec["resources"]["cpu"] * (w + 1 if w > 1 else 1)))
    asked = (
        f"the SLURM job ({args.nodes} node(s) x {cpus} CPUs, {count} GPUs: --cpus-per-node, --gpus-per-node)"
    )
    check_resources(spec, [{"CPU": cpus, "GPU": count}] * args.nodes, asked)  # before anything is submitted
    sweep_dir = Path(spec["sweep_dir"])
    folder = sweep_dir / "slurm"
    if args.ray_port:
        ports = RayPorts.from_base(args.ray_port)
    else:
        ports = RayPorts.find_free() if args.nodes == 1 else RayPorts()
    executor = make_executor(
        folder,
        nodes=args.nodes,
        cpus_per_node=cpus,
        gpus_per_node=gpus,
        mem_gb=args.mem_gb,
        timeout_min=args.time,
        partition=args.partition,
        job_name=f"tcnn-sweep-{spec['name']}"[:60],
        additional=extra,
    )
    config = RayClusterConfig(
        ports=ports,
        object_store_memory=int(args.object_store_mb * 1024 * 1024) if args.object_store_mb else None,
    )
    job = launch_ray_cluster(executor, slurm_driver, spec, config=config, rendezvous_dir=folder)
    say(f"submitted SLURM job {job.job_id} ({args.nodes} node(s) x {cpus} CPUs, {args.gpus_per_node} GPUs)")
    say(f"logs: {folder}/{job.job_id}_0_log.out / .err; results: {sweep_dir}")
    if args.detach:
        return 0
    return follow(job, spec)


def follow(job: Any, spec: dict, poll_s: float = 5.0) -> int:
    """Print the job's state and trial progress until it ends; returns the CLI exit code."""
    import submitit

    trials = Path(spec["sweep_dir"]) / "trials"
    n = len(spec["trials"])
    last = None
    while True:
        done = job.done(force_check=True)
        finished = sum(1 for tid in spec["trials"] if (trials / tid / "done.json").is_file())
        line = f"SLURM job {job.job_id} {job.state}: {finished}/{n} trials finished"
        if line != last:
            say(line)
            last = line
        if done:
            break
        time.sleep(poll_s)
    from pipelines.slurm.executor import head_result

    try:
        result = head_result(job)  # a worker node lost mid-job leaves no result of its own
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        first = first_line(err)
        print(
            f"tcnn sweep: error: SLURM job {job.job_id} failed ({first}); see {job.paths.stderr}",
            file=sys.stderr,
        )
        return 1
    say(f"results: {result['summary']} ({result['finished']}/{result['trials']} trials finished)")
    if result.get("parent_run_id"):
        say(f"MLflow parent run {result['parent_run_id']} ({spec['tracking']['uri']})")
    return 0 if result["failed"] == 0 else 1


# ------------------------------------------------------------------------------------------------ CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sweep",
        help="run a Ray Tune grid (sweep.grid) or search (sweep.search, each arm choosing "
        "its own values), locally, on Ray or on SLURM; --from-search: a grid at a search's choices",
    )
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param")
    p.add_argument(
        "--address", default="local", help="local (start Ray here), auto, HOST:PORT or ray://HOST:PORT"
    )
    p.add_argument("--name", default=None, help="sweep name (default: <params stem>-<config hash>)")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        dest="resume",
        action="store_const",
        const="yes",
        default="no",
        help="continue an interrupted sweep (Tuner.restore)",
    )
    group.add_argument("--auto-resume", dest="resume", action="store_const", const="auto",
                       help="resume when the sweep exists, start it otherwise")  # fmt: skip
    p.add_argument("--from-search", default=None, metavar="NAME",
                   help="a grid at the choices of the finished search NAME (<sweep.storage>/NAME/chosen.json): "
                   "finetune.lr = the T-CNN's lr, finetune.control_lr = the control's, the T-CNN's reparam.* "
                   "values; sweep.search/scheduler removed, -S kept (e.g. -S 'sweep.grid.seed=[0,1,2]')")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="with --from-search: use a choice made among fewer than sweep.search.min_finished trials")  # fmt: skip
    p.add_argument("--records", type=Path, default=None, metavar="DIR",
                   help="trials recorded on another machine (DIR/<sweep name>/<trial>.json, pipelines.sweep.replay):"
                   " replayed to Tune, not trained again")  # fmt: skip
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    p.add_argument("--object-store-mb", type=int, default=None, help="Ray object store size per node")
    s = p.add_argument_group("SLURM")
    s.add_argument("--slurm", action="store_true", help="submit the sweep as a SLURM job (Ray on its nodes)")
    s.add_argument("--nodes", type=int, default=1)
    s.add_argument("--cpus-per-node", type=int, default=None, help="default: ceil(sweep.cpus_per_trial)")
    s.add_argument("--gpus-per-node", default="0", metavar="[TYPE:]N", help="GPUs per node, e.g. 4 or a100:4")
    s.add_argument("--partition", default=None)
    s.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="another sbatch option, e.g. account=proj42, constraint=a100, qos=high (repeatable)",
    )
    s.add_argument("--time", type=int, default=60, help="time limit in minutes (requeued with resume)")
    s.add_argument("--mem-gb", type=float, default=None)
    s.add_argument(
        "--ray-port", type=int, default=None, help="base port (default: a free block on 1 node, 6379)"
    )
    s.add_argument("--detach", action="store_true", help="submit and return without following the job")
    p.add_argument(
        "--worker-placement",
        choices=PLACEMENTS,
        default="pack",
        help="where Ray puts a trial's data-parallel workers (workers_per_trial > 1): pack = as few nodes as "
        "possible (default), spread / strict_spread = one per node where possible / always",
    )
    p.set_defaults(func=main_sweep)
    return p


@contextlib.contextmanager
def driving_sweeps() -> Iterator[None]:
    """Sweeps driven from this process: a stop signal (stages.harness.runner.STAGE_SIGNALS) anywhere inside
    ends the trials, closes the MLflow runs KILLED and raises Stopped (exit 75, 130 for Ctrl-C) -- Tune's own
    Ctrl-C handler, which would let the driver go on to a summary of a half-run grid, is turned off."""
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    with stop_on_signals():
        yield


def command_status(
    prog: str,
    body: Callable[[], int],
    *,
    again: str | Callable[[], str],
    errors: tuple[type[Exception], ...] = (),
) -> int:
    """``body``'s exit status, or how it ended: stopped (75/130, with ``again``: how to continue), bad input
    (SweepError, ConfigError or ``errors``: one line, 2), a file or the tracking store that could not be read
    or written (one line, 74)."""
    try:
        return body()
    except Stopped as stop:
        print(f"{prog}: stopped by {stop}; {again if isinstance(again, str) else again()}", file=sys.stderr)
        return stop.exit_status
    except (SweepError, ConfigError, *errors) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a file or the tracking store could not be read or written: one line, 74
        if (line := io_error_line(err)) is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return EXIT_IOERR


def _run_here(spec: dict, args: argparse.Namespace, address: str) -> dict:
    """The sweep driven from this process (:func:`driving_sweeps`)."""
    with driving_sweeps():
        return run_sweep(
            spec,
            address=address,
            resume="auto" if args.resume != "no" else "no",
            num_cpus=args.num_cpus,
            object_store_mb=args.object_store_mb,
        )


def _from_search(args: argparse.Namespace) -> tuple[list[str], dict | None, dict | None]:
    """The ``-S`` list the grid runs with: ``--from-search``'s chosen values (pipelines/sweep/from_search.py)
    before the user's own; the record kept in sweep.json and the search's spec (None without the flag)."""
    if not args.from_search:
        return list(args.set), None, None
    from pipelines.sweep.from_search import origin

    storage_sets = [s for s in args.set if s.split("=", 1)[0].strip() == "sweep.storage"]
    storage = (Path.cwd() / load_sweep_params(args.params, storage_sets).sweep.storage).resolve()
    sets, record, search = origin(storage, args.from_search, args.set, args.force)
    return [*sets, *args.set], record, search


def _sweep(args: argparse.Namespace) -> int:
    sets, record, search = _from_search(args)
    params = load_sweep_params(args.params, sets)
    if args.slurm and args.address != "local":
        raise SweepError("--address: not with --slurm (the job starts its own Ray cluster)")
    address = check_address(args.address)
    spec = build_spec(params, name=args.name, params_file=Path(args.params), placement=args.worker_placement)
    args.sweep_json = Path(spec["sweep_dir"]) / SWEEP_JSON  # how a stop says to continue (_again)
    if record is not None:
        from pipelines.sweep.from_search import check_problem

        check_problem(search, spec)
        spec["from_search"] = record
    if args.records is not None:
        if not args.records.is_dir():
            raise SweepError(f"--records {args.records}: no such folder")
        spec["records"] = str(args.records.resolve())
    spec = reconcile(spec, args.resume)
    if args.slurm:
        return submit_slurm(spec, args)
    return 0 if _run_here(spec, args, address)["failed"] == 0 else 1


def main_sweep(args: argparse.Namespace) -> int:
    return command_status(
        "tcnn sweep", lambda: _sweep(args), again=lambda: _again(getattr(args, "sweep_json", None))
    )


def _again(sweep_json: Path | None) -> str:
    """How to continue a stopped sweep: ``--resume`` (the flag sweeps.md names) once its sweep.json is written;
    before that there is nothing to resume and the same command starts it."""
    if sweep_json is not None and sweep_json.is_file():
        return "run it again with --resume to continue"
    return "nothing was started: run it again to start it"
