"""Parent and child runs: one *parent* per pipeline execution (or sweep), one *child* per stage (or trial),
nested through MLflow's ``mlflow.parentRunId`` tag, opened, re-attached after a kill, and ended with the status
of what ended them (FINISHED, FAILED, KILLED on Ctrl-C).

The stages under ``dvc repro`` are separate processes that DVC starts one after another, with nothing of ours
around them to hand an id down (MLflow's own ``MLFLOW_RUN_ID`` resumes a run, it does not nest under one), so
``start_parent(key=...)`` re-attaches to the *open* parent of the same key (one per workspace; see
``CHAIN_TAG``); a sweep hands its parent's id to its trials explicitly. What a killed process left behind is
stages/tracking/stale.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from stages.tracking import stale
from stages.tracking import system_metrics as monitor
from stages.tracking.logs import RunLogging
from stages.tracking.names import (
    ATTEMPT_TAG,
    CHAIN_TAG,
    KEY_TAG,
    KIND_TAG,
    PARENT_TAG,
    RESUMES_TAG,
    STAGE_TAG,
    TERMINAL_STATUSES,
    RunStatus,
    flatten_params,
    str_tags,
)
from stages.tracking.store import TrackingError, quote


class RunLifecycle(RunLogging):
    """Opening, re-attaching and ending the parent and child runs of a ``Tracker``."""

    def start_parent(
        self,
        name: str = "pipeline",
        tags: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        key: str | None = None,
        params: Any = None,
    ) -> str | None:
        """Open (or re-attach to) the parent run; returns its id (None when not enabled).

        Order: an explicit ``run_id`` (must exist) -> the newest *open* parent tagged with ``key`` (a chain
        whose last stage has not run yet: its earlier stages closed it FINISHED, or a failure FAILED, or a
        SIGKILL left it RUNNING), reopened -> a new parent run, open, with MLflow's context tags. With
        ``params``, an open parent of ``key`` whose logged params differ is not re-attached (params are
        write-once): it is marked superseded (FAILED if a killed process left it RUNNING) and a new parent is
        opened; the params are logged on the parent. ``self.parent_created`` says whether a new run was
        opened; ``tcnn.resumes`` counts how often a FAILED or KILLED execution was continued.
        """
        if not self.enabled:
            return None
        flat = flatten_params(params) if params is not None else {}
        found: str | None = None
        if run_id is not None:
            self._existing_run(run_id, "parent run")
            found = run_id
        elif key is not None:
            found = stale.open_parent(self.store, key, flat)
        self.parent_created = found is None
        if found is not None:
            self._reattach_parent(found, tags)
        else:
            found = self._create_parent(name, tags, key)
        # a parent of this workspace (found by key) carries this execution's params
        own = run_id is None and key is not None
        if flat and (own or self.parent_created):  # never onto a shared parent (a sweep's, by id or env)
            self.log_params(flat, run_id=found)
        return found

    def _existing_run(self, run_id: str, what: str) -> None:
        """TrackingError unless the store has the run ``run_id``."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            raise TrackingError(f"tracking: {what} {run_id} does not exist in {self.uri}") from None

    def _reattach_parent(self, run_id: str, tags: Mapping[str, Any] | None) -> None:
        """Make ``run_id`` the parent again: RUNNING, tagged with this process (and ``tcnn.resumes`` + 1 when an
        interrupted execution is continued)."""
        run = self.client.get_run(run_id)
        self.parent_run_id = run_id  # from here on a failed write still leaves a run to close
        extra: dict[str, Any] = {}
        if run.info.status != "RUNNING":  # the chain's next stage, or an interrupted execution continued
            self.client.update_run(run_id, status="RUNNING")
        if run.info.status in ("FAILED", "KILLED"):
            extra[RESUMES_TAG] = int(run.data.tags.get(RESUMES_TAG, "0")) + 1
        self._set_tags(run_id, {**(tags or {}), **self._process_tags(), **extra})

    def _create_parent(self, name: str, tags: Mapping[str, Any] | None, key: str | None) -> str:
        """A new parent run, open (the chain of ``key`` when given), with MLflow's git, source and user tags."""
        from mlflow.tracking.context.registry import resolve_tags

        all_tags = {KIND_TAG: "parent", ATTEMPT_TAG: "1", **self._process_tags(), **(tags or {})}
        if key is not None:
            all_tags.update({KEY_TAG: key, CHAIN_TAG: "open"})
        run = self.client.create_run(self.experiment_id, run_name=name, tags=resolve_tags(str_tags(all_tags)))
        self.parent_run_id = run.info.run_id
        return run.info.run_id

    def close_children(
        self, parent_run_id: str, status: RunStatus = "FAILED", reason: str = "its parent was superseded"
    ) -> int:
        """End every RUNNING child of ``parent_run_id`` (left by killed processes) with ``status``, tagged
        ``tcnn.stale`` = ``reason``; returns how many were closed."""
        return stale.close_children(self.store, parent_run_id, status, reason)

    def start_child(
        self,
        stage: str,
        *,
        params: Any = None,
        tags: Mapping[str, Any] | None = None,
        on_stale: Literal["resume", "fail"] = "resume",
        system_metrics: bool = False,
        run_name: str | None = None,
        run_id: str | None = None,
    ) -> str | None:
        """Open the run of one stage (or trial) under the parent, resuming a killed attempt of it.

        A RUNNING run with the same ``stage`` under the same parent is a leftover of a killed process: it is
        resumed (``on_stale="resume"``; unless its logged params differ from ``params``, which MLflow cannot
        overwrite) or marked FAILED (``on_stale="fail"``). ``params`` are logged with :func:`flatten_params`.
        ``run_id``: reopen exactly this run (e.g. the id a Ray trial kept in its checkpoint), whatever its state.
        """
        if not self.enabled:
            return None
        if self.parent_run_id is None:
            self.start_parent()
        assert self.parent_run_id is not None
        flat = flatten_params(params) if params is not None else {}
        if run_id is not None:
            self._existing_run(run_id, "run")
            self._reopen(run_id, tags)
            child = run_id
        elif (child := stale.stale_child(self.store, self.parent_run_id, stage, flat, on_stale)) is not None:
            self._reopen(child, tags)
        else:
            child = self._create_child(stage, tags, run_name)
        self.run_id = child
        if flat:
            self.log_params(flat)
        if system_metrics and monitor.start(self.uri, self.store.guard, child):
            self._fluent = True  # MLflow samples the system into the child until end()
        return child

    def _reopen(self, run_id: str, tags: Mapping[str, Any] | None) -> None:
        """Make ``run_id`` RUNNING again, tagged with this process and its attempt number + 1."""
        run = self.client.get_run(run_id)
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1")) + 1
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        self._set_tags(run_id, {**(tags or {}), **self._process_tags(), ATTEMPT_TAG: str(attempt)})

    def _create_child(self, stage: str, tags: Mapping[str, Any] | None, run_name: str | None) -> str:
        """A new run of ``stage`` under the parent (named ``run_name``, default the stage), attempt 1."""
        all_tags = {
            PARENT_TAG: self.parent_run_id,
            KIND_TAG: "stage",
            STAGE_TAG: stage,
            ATTEMPT_TAG: "1",
            **self._process_tags(),
            **(tags or {}),
        }
        run = self.client.create_run(self.experiment_id, run_name=run_name or stage, tags=str_tags(all_tags))
        return run.info.run_id

    def find_child(self, stage: str, *, status: str | None = None) -> list[Any]:
        """The child runs of the parent for ``stage`` (newest first), optionally only those in ``status``."""
        if not self.enabled or self.parent_run_id is None:
            return []
        flt = f"tags.`{PARENT_TAG}` = {quote(self.parent_run_id)} and tags.`{STAGE_TAG}` = {quote(stage)}"
        if status is not None:
            flt += f" and attributes.status = {quote(status)}"
        return self.store.search(flt)

    def end(self, status: RunStatus = "FINISHED") -> None:
        """End the active child run, or the parent when no child is open."""
        if not self.enabled:
            return
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"end: status must be one of {TERMINAL_STATUSES}, got {status!r}")
        if self.run_id is not None:
            if self._fluent:  # MLflow stops its system metrics monitor and ends the run
                self._fluent = False
                monitor.end(self.store.guard, self.run_id, status)
            else:
                self.client.set_terminated(self.run_id, status=status)
            self.run_id = None
        elif self.parent_run_id is not None:
            self.end_parent(status)

    def end_parent(self, status: RunStatus = "FINISHED") -> None:
        """End the parent run (the last stage of a pipeline, or the sweep driver, calls this)."""
        if not self.enabled or self.parent_run_id is None:
            return
        if self.run_id is not None:
            self.end(status)
        self.client.set_terminated(self.parent_run_id, status=status)
        self.parent_run_id = None

    @contextlib.contextmanager
    def stage(self, stage: str, **kwargs: Any) -> Iterator[RunLifecycle]:
        """``start_child`` + ``end``: FINISHED on success, FAILED on an exception, KILLED on Ctrl-C."""
        self.start_child(stage, **kwargs)
        try:
            yield self
        except KeyboardInterrupt:
            self.end("KILLED")
            raise
        except BaseException:
            self.end("FAILED")
            raise
        self.end("FINISHED")
