"""Hashes that name things: files (sha256 of the bytes), configs (sha256 of canonical JSON), seeds."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def file_digest(path: str | os.PathLike, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    """Hex digest of a file's bytes, read in chunks: sha256 by default (md5 for published checksums). The one
    file hasher of the project."""
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON rendering with sorted keys (params sections, input fingerprints)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def derive_seed(seed: int, purpose: str) -> int:
    """A second seed for another random stream (e.g. fine-tuning's data order), stable across runs."""
    return int(hashlib.sha256(f"{seed}:{purpose}".encode()).hexdigest()[:8], 16)
