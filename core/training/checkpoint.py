"""Checkpoint files: atomic writes, loads that fail with one clear line, and models rebuilt from their spec.

A *model checkpoint* is a dict holding at least ``{"model": state_dict, "model_spec": ...}`` (the spec:
`core.models.spec`).

Training checkpoints (core.training.loop, core.training.resume_file) add optimizer, scheduler, grad-scaler and RNG states to the same dict, so
every checkpoint the project writes can be opened with :func:`load_model`.

Files are written atomically (temp file in the same directory, fsync, ``os.replace``, fsync of the
directory): a reader, or a run killed at any moment, sees either the old file or the new one, never half of
one. Checkpoints hold only tensors and plain Python containers, so they load with ``weights_only=True``.

Every checkpoint dict is saved with the sha256 of its content (:data:`CHECKSUM_KEY`: tensors by dtype, shape
and bytes, everything else by ``repr``; :func:`content_digest`), recomputed by :func:`load`: a file damaged
where the zip reader does not look (inside a tensor's bytes) fails there with one line, never loads as good.
A checkpoint without the key (written before it existed, or by hand) loads unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from core.models.spec import build_from_spec
from core.utils.atomic import atomic_write
from core.utils.errors import first_line


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or lacks a key; the message is one line naming it."""


# ---------------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------------


CHECKSUM_KEY = "_content_sha256"


def content_digest(obj: Any) -> str:
    """sha256 of a checkpoint's content, the same before saving and after loading (see the module docstring)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, list | tuple):
            h.update(b"[" if isinstance(x, list) else b"(")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """`torch.save(obj, path)` atomically (temp file, fsync, os.replace); a dict gets its content sha256."""
    if isinstance(obj, dict):
        obj = {**{k: v for k, v in obj.items() if k != CHECKSUM_KEY}, CHECKSUM_KEY: content_digest(obj)}
    return atomic_write(path, lambda f: torch.save(obj, f))


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def load(
    path: str | os.PathLike, *, map_location: str | torch.device = "cpu", require: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Load a checkpoint dict written by :func:`atomic_save`.

    Raises :class:`CheckpointError` (one line naming the file) when the file is missing, empty, truncated,
    not a torch checkpoint, not a dict, or lacks one of the `require`d keys.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file (truncated checkpoint)")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # zip errors, EOF, unpickling errors: all mean the same thing to the user
        reason = first_line(err)
        raise CheckpointError(
            f"{path}: corrupt or truncated checkpoint ({type(err).__name__}: {reason})"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint dict (found {type(obj).__name__})")
    stored = obj.pop(CHECKSUM_KEY, None)
    if stored is not None and content_digest(obj) != stored:
        raise CheckpointError(f"{path}: checksum mismatch, the checkpoint is damaged")
    missing = [k for k in require if k not in obj]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks key(s) {missing}")
    return obj


def model_from(ckpt: dict[str, Any], path: str | os.PathLike) -> nn.Module:
    """The model a loaded checkpoint dict (``{"model", "model_spec", ...}``, read from ``path``) holds, rebuilt
    from its spec (`core.models.spec.build_from_spec`, every kind) with its weights loaded, in train mode;
    CheckpointError (one line naming ``path``) when the spec builds nothing or the weights do not fit it."""
    try:
        model = build_from_spec(ckpt["model_spec"])
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(
            f"{path}: cannot rebuild its model from model_spec ({first_line(err)})"
        ) from None
    return with_weights(model, ckpt, path)


def with_weights(model: nn.Module, ckpt: dict[str, Any], path: str | os.PathLike) -> nn.Module:
    """``model`` with the weights of the checkpoint dict ``ckpt`` (read from ``path``) loaded; CheckpointError
    (one line naming ``path``) when they do not fit it."""
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError) as err:
        raise CheckpointError(
            f"{path}: weights do not fit the model its model_spec describes ({first_line(err)})"
        ) from None
    return model


def load_model(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model stored in any project checkpoint (every kind), weights loaded, in eval mode."""
    ckpt = load(path, map_location=map_location, require=("model", "model_spec"))
    return model_from(ckpt, path).to(map_location).eval()


# ---------------------------------------------------------------------------------------------------------
# RNG states (stored as tensors and plain containers so that weights_only loading accepts them)
# ---------------------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may touch: torch (CPU and each CUDA device), numpy, python."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if state.get("cuda") and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a different number of devices: leave them seeded
            torch.cuda.set_rng_state_all(state["cuda"])
