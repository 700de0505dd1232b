"""What a ``Tracker`` writes to a run: params (write-once, under stable flattened names), metrics, tags,
artifacts, JSON/YAML dicts, dataset inputs, the environment it ran in, and PyTorch models
(``mlflow.pytorch.log_model``). Every call goes to the open child run unless ``run_id`` names another, and is a
no-op when tracking is not enabled."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stages.tracking.names import UV_LOCK_FILE, flatten_params, is_flat_str, str_tags
from stages.tracking.state import TrackerState


class RunLogging(TrackerState):
    """The logging calls of a ``Tracker`` (MLflow's ``log_batch``, ``log_artifact(s)``, ``log_inputs``...)."""

    def log_params(self, params: Any, *, run_id: str | None = None) -> None:
        """Log a ``Params`` or a (nested) mapping under stable flattened names (write-once in MLflow)."""
        if not self.enabled:
            return
        from mlflow.entities import Param

        target = self._run(run_id)
        flat = params if is_flat_str(params) else flatten_params(params)
        existing = self.client.get_run(target).data.params
        items = [Param(k, v) for k, v in flat.items() if existing.get(k) != v]
        self.client.log_batch(target, params=items)  # MLflow splits it into batches of its limits

    def log_metrics(
        self, metrics: Mapping[str, float], step: int | None = None, *, run_id: str | None = None
    ) -> None:
        """Log scalar metrics at ``step`` (epoch or global step; 0 when omitted)."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        target = self._run(run_id)
        now = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"log_metrics: metric {key!r} is not a number ({value!r})") from None
            items.append(Metric(key, number, now, int(step or 0)))
        self.client.log_batch(target, metrics=items)

    def set_tags(self, tags: Mapping[str, Any], *, run_id: str | None = None) -> None:
        """Set ``tags`` (values as strings, None left out) on the run."""
        if not self.enabled:
            return
        self._set_tags(self._run(run_id), tags)

    def _set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in str_tags(tags).items()])

    def log_artifact(
        self, path: str | os.PathLike, artifact_path: str | None = None, *, run_id: str | None = None
    ) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        if not self.enabled:
            return
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"log_artifact: {path} does not exist")
        target = self._run(run_id)
        if path.is_dir():
            self.client.log_artifacts(target, str(path), artifact_path)
        else:
            self.client.log_artifact(target, str(path), artifact_path)

    def log_dict(
        self, obj: Mapping[str, Any] | list, artifact_file: str, *, run_id: str | None = None
    ) -> None:
        """Store a JSON (or YAML, by extension) artifact built from ``obj``."""
        if not self.enabled:
            return
        self.client.log_dict(self._run(run_id), obj, artifact_file)

    def log_dataset(
        self,
        name: str,
        digest: str,
        source: str,
        *,
        context: str = "train",
        profile: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        """Record a dataset input (``mlflow.log_input`` equivalent) by name, digest (e.g. manifest sha256)
        and source (a path or URI)."""
        if not self.enabled:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(
            name=name,
            digest=digest[:36],
            source_type="local",
            source=json.dumps({"uri": str(source)}),
            profile=json.dumps(dict(profile)) if profile else None,
        )
        tags = [InputTag("mlflow.data.context", context)]
        self.client.log_inputs(self._run(run_id), datasets=[DatasetInput(dataset, tags)])

    def log_environment(self, root: str | os.PathLike = ".", *, run_id: str | None = None) -> None:
        """Log the environment on ``run_id`` (default: the parent): ``uv.lock`` as it is in ``root`` (what
        the README commands installed, hashes included) and the resolved distributions as installed
        (``environment/requirements.txt``), so a run names the exact environment it ran in."""
        run_id = run_id or self.parent_run_id
        if not self.enabled or run_id is None:
            return
        with contextlib.suppress(Exception):  # nice to have: never fail a stage for it
            self.client.log_text(run_id, resolved_environment(), "environment/requirements.txt")
            lock = Path(root) / UV_LOCK_FILE
            if lock.is_file():
                self.client.log_artifact(run_id, str(lock), "environment")

    @contextlib.contextmanager
    def activate(self, run_id: str | None = None) -> Iterator[Any]:
        """Make the active run MLflow's fluent active run for calls this adapter does not wrap
        (``mlflow.pytorch.log_model``...). Yields the ``mlflow`` module, or None when not enabled."""
        if not self.enabled:
            yield None
            return
        import mlflow

        target = self._run(run_id)
        if self._fluent and target == self.run_id:  # already MLflow's active run (it logs system metrics)
            yield mlflow
            return
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(self.uri)
        try:
            with self.store.guard(), mlflow.start_run(run_id=target):
                yield mlflow
                # Leaving start_run() would mark the run FINISHED: put it back to RUNNING below.
        finally:
            with contextlib.suppress(Exception):
                self.client.update_run(target, status="RUNNING")
            mlflow.set_tracking_uri(previous)

    def log_checkpoint_model(self, checkpoint: Path, name: str) -> None:
        """The model of a checkpoint through ``mlflow.pytorch.log_model`` (loadable with
        ``mlflow.pytorch.load_model``; it gives the logits of ``core.training.checkpoint.load_model``)."""
        if not self.enabled or not checkpoint.is_file():
            return
        from core.training.checkpoint import load_model

        self.log_torch_model(load_model(checkpoint), name=name)

    def log_torch_model(self, model: Any, name: str = "model", **kwargs: Any) -> None:
        """``mlflow.pytorch.log_model`` on the active run; pins torch instead of inferring requirements
        (slow). MLflow 3's default format ('pt2', a traced graph) needs ``input_example=``; without one the
        model is pickled (its classes must be importable where it is loaded)."""
        if not self.enabled:
            return
        import torch

        kwargs.setdefault("pip_requirements", [f"torch=={torch.__version__.split('+')[0]}"])
        if kwargs.get("input_example") is None:
            kwargs.setdefault("serialization_format", "pickle")
        with self.activate() as mlflow:
            import mlflow.pytorch  # noqa: F401

            mlflow.pytorch.log_model(model, name=name, **kwargs)


def resolved_environment() -> str:
    """The resolved Python environment as ``pip freeze``-style lines (from the installed distributions'
    metadata: the same set pip reports, without starting pip), headed by the interpreter and platform."""
    import importlib.metadata as md
    import platform

    seen: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    head = f"# python {platform.python_version()} ({sys.executable}) on {platform.platform()}\n"
    return head + "\n".join(sorted(seen.values(), key=str.lower)) + "\n"
