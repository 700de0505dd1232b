"""What tracked runs are called and keyed by, the same on the DVC path and in sweeps: MLflow tag names,
params flattened to stable names (:func:`flatten_params`), a parent run's label, and the keys that find a
workspace's open parent. No MLflow here (stages/tracking/tracker.py is the adapter, stages/harness/stage_run.py
the DVC path's run protocol)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from core.utils.hashing import file_digest, stable_hash

PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
SOURCE_NAME_TAG = "mlflow.source.name"  # the parent's: the command that ran the chain (`dvc repro`)
NOTE_TAG = "mlflow.note.content"  # a run's description in the MLflow UI (Markdown)
KIND_TAG = "tcnn.kind"  # "parent" | "stage"
STAGE_TAG = "tcnn.stage"
KEY_TAG = "tcnn.parent_key"
ATTEMPT_TAG = "tcnn.attempt"
HOST_TAG = "tcnn.host"
PID_TAG = "tcnn.pid"
RESUMES_TAG = "tcnn.resumes"  # parent: how often an interrupted (FAILED/KILLED) execution was continued
DVC_LOCK_TAG = "tcnn.dvc_lock_sha256"  # parent: sha256 of dvc.lock (updated by every stage; final at report)
DVC_EXP_TAG = "tcnn.dvc_exp_name"  # parent: the DVC experiment name under `dvc exp run`
UV_LOCK_TAG = "tcnn.uv_lock_sha256"  # parent: sha256 of uv.lock (the lock itself: an artifact)
UV_LOCK_FILE = "uv.lock"
PARAMS_HASH_TAG = "tcnn.params_hash"  # parent: sha256 of its params (tracking section excluded)
# Parent of a DVC chain: "open" until its last stage ran, then "complete" (or "superseded").
CHAIN_TAG = "tcnn.chain"
# MLflow 3's UI opens an experiment of this kind on its training runs (not on the GenAI traces overview).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"

#: Dotted params keys that get a short, stable MLflow name (identical in every run: DVC stages and sweep trials).
PARAM_ALIASES: dict[str, str] = {
    "reparam.alpha_init": "alpha_init",
    "reparam.lambda_init": "lambda_init",
    "reparam.epoch": "reparam_epoch",
    "data.sample_fraction": "sample_fraction",
}

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
_MAX_PARAM_LEN = 6000  # MLflow's limit for a param value


def _param_value(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    else:
        text = str(value)
    return text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 3] + "..."


def flatten_params(params: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a ``Params`` (or a nested mapping) to MLflow params with stable names.

    Nested keys join with dots (``pretrain.augment.hflip``); the keys in :data:`PARAM_ALIASES` get their
    short names (``reparam.alpha_init`` -> ``alpha_init``); lists become compact JSON; empty mappings are kept
    as ``{}`` so every run carries the same set of names.
    """
    if hasattr(params, "model_dump"):
        params = params.model_dump(mode="json")
    if not isinstance(params, Mapping):
        raise TypeError(f"flatten_params: expected Params or a mapping, got {type(params).__name__}")
    flat: dict[str, str] = {}

    def walk(key: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for sub, value in node.items():
                walk(f"{key}.{sub}" if key else str(sub), value)
        else:
            flat[PARAM_ALIASES.get(key, key)] = _param_value(node)

    walk(prefix, params)
    return flat


# ---------------------------------------------------------------------------------------------- helpers


def resolve_uri(uri: str, base_dir: str | os.PathLike = ".") -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////abs/base/rel.db``; other URIs unchanged.

    Resolve once in the process that reads params.yaml and hand the absolute URI to others (Ray trials run in
    their own working directories).
    """
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and ":memory:" not in uri:
        return prefix + str((Path(base_dir) / uri[len(prefix) :]).resolve())
    return uri


def digest_if_present(path: str | os.PathLike) -> str | None:
    """sha256 of a file (e.g. dvc.lock for the parent run's tag); None when it does not exist."""
    try:
        return file_digest(path)
    except FileNotFoundError:
        return None


def workspace_key(root: str | os.PathLike = ".") -> str:
    """A key naming one workspace (host + absolute path): stages under one `dvc repro` share a parent by it."""
    return f"{socket.gethostname()}:{Path(root).resolve()}"


def params_hash(params: Any) -> str:
    """sha256 of a run's params as MLflow logs them, without the ``tracking`` section (where runs are logged
    does not change what they compute)."""
    return stable_hash({k: v for k, v in flatten_params(params).items() if not k.startswith("tracking.")})


def run_label(params: Any) -> str:
    """A parent run's name from what distinguishes pipeline executions at a glance: model kind and arch, the
    dataset, t1 and the alpha / lambda init (for the kinds that use them), the training-sample fraction and
    the seed."""
    record, r = params.model.record, params.reparam
    parts = [record.name, params.model.arch, params.data.name]
    if record.reparameterizes:
        parts.append(f"t1={r.epoch}")
    conversion = record.conversion
    if "alpha_init" in conversion:
        parts.append(f"alpha={r.alpha_init:g}")
    if "lambda_init" in conversion:
        parts.append(f"lambda={r.lambda_init:g}")
    parts += [f"f={params.data.sample_fraction:g}", f"seed={params.seed}"]
    if params.pretrain.seed is not None:
        parts.append(f"cnn_seed={params.pretrain.seed}")
    return " ".join(parts)


def compatible_params(logged: Mapping[str, str], flat: Mapping[str, str]) -> bool:
    """True when no param already logged on a run differs from ``flat`` (MLflow params are write-once)."""
    return all(logged.get(k, v) == v for k, v in flat.items())


def str_tags(tags: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in tags.items() if v is not None}


def is_flat_str(params: Any) -> bool:
    return isinstance(params, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in params.items()
    )
