"""Shared pytest fixtures. Tests never touch the repo's own data/, runs/ or mlruns.db: they use tmp_path."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import _xdist_groups
import pytest
import torch
from slurm_cluster import (  # noqa: F401  (SLURM test-cluster fixture)
    SESSION_ENV,
    SlurmCluster,
    slurm_cluster,
    stop_started_clusters,
)

REPO = Path(__file__).resolve().parents[1]
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Stage CLIs run by tests do not write an MLflow store unless a test asks for one (TCNN_TRACKING=1).
os.environ.setdefault("TCNN_TRACKING", "0")

# Keep tests deterministic and light on a 2-core machine. Under pytest-xdist (`make test`) the workers share the
# cores: each worker, and every process a test starts (stages, DVC, Ray, torchrun, which read OMP_NUM_THREADS),
# gets its share, so that two workers' compute threads do not oversubscribe the cores (measured: two workers
# training at 2 threads each on 2 cores ran their steps several times slower than one at a time).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test leaves pytest's process with the signal handlers it found. ray.init installs Ray's SIGTERM
    handler (sys.exit) in the calling process and ray.shutdown leaves it; a later test of the same xdist worker
    whose training loop chains to the handler before its own (core.training.stop_signals.StopSignals.chain) then ended
    in SystemExit(15) instead of Preempted."""
    before = {s: signal.getsignal(s) for s in _HANDLED}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """With TCNN_NO_SKIPS=1 (set by .ci/run) a skipped test fails, unless it is marked `gpu`: on a CI machine a
    missing dataset, browser or cluster must not silently drop the end-to-end, determinism or UI tests."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("TCNN_NO_SKIPS") == "1" and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but TCNN_NO_SKIPS=1 forbids skips other than `gpu` tests: {reason}"


#: pytest-xdist (`make test`: `-n 2`): the tests of one group run in one worker, one after another, beside the
#: other workers' tests. The SLURM tests share the test clusters (their nodes' CPUs, the requeue and time-limit
#: timing) and wait on SLURM much of the time. Every test that uses a module-scoped fixture (a built chain, a
#: queue of DVC experiments, a sweep) is grouped with its module, so the fixture is built once, not once per
#: worker. Any other test is a unit of its own. (`tests/_xdist_groups.py` hands the groups to the scheduler.)
XDIST_GROUPS = {"slurm": "slurm"}


def _group(item: pytest.Item) -> str | None:
    for marker, group in XDIST_GROUPS.items():
        if item.get_closest_marker(marker) is not None:
            return group
    defs = getattr(item, "_fixtureinfo", None)
    for fixturedefs in defs.name2fixturedefs.values() if defs is not None else ():
        if any(d.scope == "module" for d in fixturedefs):
            return item.module.__name__ if item.module is not None else None
    return None


def _cost(item: pytest.Item) -> int:
    """0 for the SLURM group, 1 for the other slow tests, 2 for the rest: the long units start first, and the
    short ones fill the end of the run in every worker (longest-first scheduling)."""
    if item.get_closest_marker("slurm") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(
        config, "workerinput"
    ):  # not an xdist worker (a pytest a test starts inherits the env vars)
        return
    # a module keeps its tests together and in order; modules go by their costliest test
    modules: dict[str, int] = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        modules[name] = min(modules.get(name, 2), _cost(item))
    items.sort(key=lambda it: modules[it.nodeid.split("::")[0]])
    _xdist_groups.publish(config, {item.nodeid: _group(item) for item in items})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return _xdist_groups.scheduler(config, log)


def pytest_configure(config: pytest.Config) -> None:
    _xdist_groups.configure(config)
    # The run's id, named by the clusters it starts (slurm_cluster.SESSION_ENV): set by the first process of a
    # run (the xdist controller, whose workers inherit it), not by a pytest a test starts (it inherits it too).
    if not hasattr(config, "workerinput") and not os.environ.get(SESSION_ENV):
        os.environ[SESSION_ENV] = uuid.uuid4().hex
        config.stash[_OWNER] = os.environ[SESSION_ENV]


_OWNER = pytest.StashKey[str]()
_CLUSTER_LINES = pytest.StashKey[list[str]]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the very end of the run (the xdist controller's session finish comes after every worker's): stop the
    SLURM test clusters this run started, unless TCNN_KEEP_CLUSTER=1 (slurm_cluster.stop_started_clusters)."""
    config = session.config
    if (run_id := config.stash.get(_OWNER, None)) is not None:
        config.stash[_CLUSTER_LINES] = stop_started_clusters(run_id)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Say what became of the test clusters this run started (stopped, or left running and how to stop them)."""
    for line in config.stash.get(_CLUSTER_LINES, []):
        terminalreporter.write_line(f"SLURM: {line}")


@pytest.fixture
def serial_threads():
    """torch at the 2 threads a test has in one process, whatever pytest-xdist's share, for the tests whose
    margins were set on networks trained at 2 threads (another thread count sums floats in another order and
    trains another network: under a 1-thread share, test_continue_mode's gap was 0.0182 against its perturbed
    control's 0.0164)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(threads)
