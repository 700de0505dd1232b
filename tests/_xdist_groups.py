"""Groups of tests that one pytest-xdist worker runs together (``make test``: ``-n 2``).

pytest-xdist's ``--dist loadgroup`` reads an ``xdist_group`` marker into the node id (``test@group``), which
pytest 9 no longer lets a plugin change: the groups were silently ignored (measured: two SLURM tests ran at
once in two workers). So the groups travel another way: every worker computes them at collection (the
collection is the same in every worker) and writes ``{node id: group}`` to a file named by the run's id, and
the controller's scheduler -- xdist's load-scope scheduler, whose work units are these groups -- reads it.
A test without a group is a unit of its own; the units are dealt out in collection order (costliest first,
``conftest.pytest_collection_modifyitems``) to whichever worker has fewer than three tests left.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest


def _path(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"tcnn-xdist-groups-{run_id}.json"


def configure(config: pytest.Config) -> None:
    """In the controller of an xdist run: fix the run's id before the workers start, so both sides name the
    same file."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.getoption("numprocesses", None) and config.getoption("testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex


def publish(config: pytest.Config, groups: dict[str, str | None]) -> None:
    """In a worker: write the groups of the collected tests (atomically; every worker writes the same)."""
    run_id = config.workerinput["testrunuid"]  # type: ignore[attr-defined]
    path = _path(run_id)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


def scheduler(config: pytest.Config, log):  # noqa: ANN201  (an xdist scheduler)
    """The controller's scheduler: load-scope scheduling over the published groups, in collection order."""
    if config.getoption("dist", "no") not in ("load", "loadgroup", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str | None] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                path = _path(config.getoption("testrunuid"))
                if not path.is_file():
                    raise RuntimeError(f"no test groups from the workers at {path}")
                self._groups = json.loads(path.read_text())
                path.unlink(missing_ok=True)
            return self._groups.get(nodeid) or nodeid

    config.option.loadscopereorder = False  # keep the collection's costliest-first order
    return GroupScheduling(config, log)
