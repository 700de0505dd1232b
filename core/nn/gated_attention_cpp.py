"""The GPSA attention core as a C++/OpenMP kernel (core/nn/csrc/gated_attention.cpp), built from source once.

The same function as `core.nn.gated_attention.gated_attention` ([TCNN21] Eq. 7, the gated content/positional mix
of [ConViT21] Eq. 6, then A.X), computed one image at a time per thread (``at::parallel_for``): the image's
scores, softmax, gated mix and flush, A.X and, in backward, the maps recomputed and the gradients, all in cache.
The batch sums of the backward (positional attention, gate) are reduced per fixed block of images in a fixed
order, so results do not depend on the thread count.

The extension is compiled by ``torch.utils.cpp_extension.load`` (g++, ninja) into the user's cache,
``$XDG_CACHE_HOME/tcnn/torch_extensions`` (``~/.cache/...``; ``TCNN_EXTENSIONS_DIR`` overrides it;
``scripts/setup.sh`` builds it), one build per CPU capability (AVX-512, AVX2 or baseline flags), source and torch
version, named by a hash of them; once built it is imported directly. The name is the content, so every copy of
the code shares one build: a worktree, a DVC experiment's temporary workspace (``dvc exp run --queue``/``--temp``)
and a fresh clone on the same machine load it, where a directory under each checkout built it again in each. When the build or the load fails, `extension` says so once in the log and returns None, and
`core.nn.gpsa_tcnn.TcnnGPSA` takes its Python path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from core.utils.errors import first_line

__all__ = ["available", "extension", "gated_attention_cpp", "gated_attention_cpp_qk"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gated_attention.cpp"


def build_root() -> Path:
    """Where the builds live: ``TCNN_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/tcnn/torch_extensions``, else
    ``~/.cache/tcnn/torch_extensions`` (shared by every checkout: the build's name is its content)."""
    if override := os.environ.get("TCNN_EXTENSIONS_DIR"):
        return Path(override)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tcnn" / "torch_extensions"


#: Compiler flags per torch CPU capability: the vector width of the kernel's own GEMM and loops, and the ATen
#: vector functions (its softmax) compiled for that capability.
ARCH_FLAGS: dict[str, list[str]] = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

#: A build lock older than this was left by a killed build (a build takes about a minute of one core).
STALE_LOCK_S = 1800.0

_state: dict[str, Any] = {}


def extension() -> ModuleType | None:
    """The compiled kernel (built on first use, then loaded from ``build/``), or None after one log line when it
    cannot be built or loaded (``TCNN_NO_CPP_ATTENTION=1`` also disables it)."""
    if "ext" in _state:
        return _state["ext"]
    ext = None
    if os.environ.get("TCNN_NO_CPP_ATTENTION") == "1":
        log.info("GPSA C++ attention disabled (TCNN_NO_CPP_ATTENTION=1): the Python path is used")
    else:
        try:
            ext = _load()
        except Exception as e:  # noqa: BLE001 - any build/load failure means: fall back, once, loudly
            first = first_line(e, 200)
            log.warning(
                "GPSA C++ attention unavailable (%s: %s); the Python path is used", type(e).__name__, first
            )
            log.debug("GPSA C++ attention build/load failure in full: %s", e)
            ext = None
    _state["ext"] = ext
    return ext


def _load() -> ModuleType:
    """Import the built library when it exists (named by a hash of the source, the flags, torch's version and the
    Python ABI: no build lock taken, so a process killed at start-up leaves none behind), else build it
    (``torch.utils.cpp_extension.load``, which serialises concurrent builds with a lock file)."""
    cap = torch.backends.cpu.get_cpu_capability()
    cflags = ["-O3", "-fopenmp", *ARCH_FLAGS.get(cap, [])]
    abi = (cflags, torch.__version__, sys.implementation.cache_tag)  # a cache any venv on the machine reads
    key = hashlib.sha256(SOURCE.read_bytes() + repr(abi).encode()).hexdigest()[:12]
    name = f"tcnn_gated_attention_{cap.lower()}_{key}"
    build = build_root() / name
    lib = build / f"{name}.so"
    if not lib.is_file():
        quiet = logging.getLogger("torch.utils.cpp_extension")  # its CUDA_HOME warning: not our concern
        level, quiet.level = quiet.level, logging.ERROR
        try:
            from torch.utils import cpp_extension
        finally:
            quiet.setLevel(level)
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)  # left by a build that was killed
        cpp_extension.load(
            name=name, sources=[str(SOURCE)], build_directory=str(build), extra_cflags=cflags,
            extra_ldflags=["-fopenmp"], verbose=False,
        )  # fmt: skip
    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {lib}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def available() -> bool:
    """Whether the compiled kernel is loaded (building it if needed)."""
    return extension() is not None


class _CppGatedAttention(torch.autograd.Function):
    """Y = (g softmax(scale Q^T K) + Pos) X through the C++ kernel; backward recomputes the maps per image and
    returns the gradients of qt, kt in their own strides (``torch.empty_like``)."""

    @staticmethod
    def forward(
        ctx: Any,
        qt: torch.Tensor,
        kt: torch.Tensor,
        vt: torch.Tensor,
        pos: torch.Tensor,
        g_con: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(qt, kt, vt, pos, g_con)
        ctx.scale = scale
        return extension().forward(qt, kt, vt, pos, g_con, scale)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        qt, kt, vt, pos, g = ctx.saved_tensors
        dq, dk, dv, dpos, dg = extension().backward(dy.contiguous(), qt, kt, vt, pos, g, ctx.scale)
        return dq, dk, dv, dpos, dg, None


class _CppGatedAttentionQK(torch.autograd.Function):
    """The same for q and k in one tensor ``qk`` [B, heads, 2 d, L] (rows (q | k, d) per head, any strides: one
    projection's output): its gradient comes back as one tensor in ``qk``'s own strides, so neither a copy of
    ``qk`` into the [B * heads, d, L] layout nor the zero-fill and add of two slices' gradients happens."""

    @staticmethod
    def forward(
        ctx: Any, qk: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(qk, vt, pos, g_con)
        ctx.scale = scale
        d = qk.shape[2] // 2
        return extension().forward(qk[:, :, :d], qk[:, :, d:], vt, pos, g_con, scale)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        qk, vt, pos, g = ctx.saved_tensors
        d = qk.shape[2] // 2
        dqk = torch.empty_like(qk)
        _, _, dv, dpos, dg = extension().backward(
            dy.contiguous(), qk[:, :, :d], qk[:, :, d:], vt, pos, g, ctx.scale, dqk[:, :, :d], dqk[:, :, d:]
        )
        return dqk, dv, dpos, dg, None


def gated_attention_cpp(
    qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
) -> torch.Tensor:
    """`core.nn.gated_attention.gated_attention` (same arguments and result) through the C++ kernel; CPU, float32
    or float64, and `available()` must hold. qt, kt may also come as [B, heads, d, L] (any strides: e.g. views
    of a channels-last projection, no copy); their gradients come in their own strides."""
    pos, g_con = pos.contiguous(), g_con.contiguous()
    if not torch.is_grad_enabled():
        return extension().forward(qt, kt, vt, pos, g_con, scale)
    return _CppGatedAttention.apply(qt, kt, vt, pos, g_con, scale)


def gated_attention_cpp_qk(
    qk: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
) -> torch.Tensor:
    """`gated_attention_cpp` with q and k as the two halves of one tensor ``qk`` [B, heads, 2 d, L] (q^T rows
    then k^T rows per head, any strides; Lq = L): the layout of the T-CNN's one q|k projection
    (`core.nn.gpsa_tcnn.TcnnGPSA._qk_rows`), taken as it comes, its gradient one tensor in its own strides."""
    pos, g_con = pos.contiguous(), g_con.contiguous()
    if not torch.is_grad_enabled():
        d = qk.shape[2] // 2
        return extension().forward(qk[:, :, :d], qk[:, :, d:], vt, pos, g_con, scale)
    return _CppGatedAttentionQK.apply(qk, vt, pos, g_con, scale)
