"""The source files a Python module runs, found from the modules themselves: the module, the packages it sits
in, and the modules its namespace binds (``import x``, ``from x import f``), followed recursively; and the
distribution an installed module comes from.

The network code a stage builds is an input of its result wherever it comes from (a kind's code in core/, a
user's builder in the workspace or on PYTHONPATH, an installed package): `stages.harness.identity.network_code`
records these files, and the configuration checks that DVC sees a workspace builder (`model.code`). Standard
library only, so the stages that train nothing can use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import site
import sys
import sysconfig
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from types import ModuleType

__all__ = ["closure", "distribution", "installed", "is_local", "local_files", "source_file"]


@cache
def _install_roots() -> tuple[Path, ...]:
    """The interpreter's own trees: the standard library and the site-packages folders."""
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    return tuple(dict.fromkeys(Path(r).resolve() for r in roots))


def installed(path: Path) -> bool:
    """``path`` lies in the standard library or a site-packages folder of this interpreter (an installed
    distribution), not in the workspace or another folder on PYTHONPATH."""
    return any(path.is_relative_to(root) for root in _install_roots())


def source_file(module: ModuleType) -> Path | None:
    """The module's file, resolved (None: a built-in or namespace package)."""
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def is_local(module: ModuleType) -> bool:
    """A module loaded from a file outside the installed distributions (the workspace's, PYTHONPATH's)."""
    file = source_file(module)
    return file is not None and not installed(file)


def _bound(module: ModuleType) -> Iterable[ModuleType]:
    """The loaded modules the namespace of ``module`` names (bound modules, and where bound objects come from)
    and the packages ``module`` sits in. A package's own submodules are left out: the import system binds each
    one there once anything loads it."""
    own = f"{module.__name__}." if hasattr(module, "__path__") else None
    for value in list(vars(module).values()):
        if isinstance(value, ModuleType):
            name = None if own and value.__name__.startswith(own) else value.__name__
        else:
            name = getattr(value, "__module__", None)
        if isinstance(name, str) and name in sys.modules:
            yield sys.modules[name]
    parts = module.__name__.split(".")
    for i in range(1, len(parts)):
        parent = sys.modules.get(".".join(parts[:i]))
        if parent is not None:
            yield parent


def closure(roots: Iterable[str], follow: Callable[[ModuleType], bool]) -> set[ModuleType]:
    """The modules ``roots`` (imported here) and every module ``follow`` accepts that they reach through
    their namespaces and packages, recursively (the import graph as the modules bind it: the same whatever
    else the process loaded before)."""
    todo = [importlib.import_module(m) for m in roots]
    seen: set[ModuleType] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(m for m in _bound(module) if m not in seen and follow(m))
    return seen


def local_files(module: str) -> list[Path]:
    """The files outside the installed distributions that importing and running ``module`` executes: its own
    (when local), its packages' and those of the local modules it reaches (`closure`), resolved and sorted."""
    files = {source_file(m) for m in closure([module], is_local) if is_local(m)}
    return sorted(f for f in files if f is not None)


@cache
def _providers() -> dict[str, list[str]]:
    """Top-level package -> the installed distributions that provide it (read once: a scan of every one)."""
    return dict(importlib.metadata.packages_distributions())


def distribution(module: str) -> tuple[str, str] | None:
    """(name, version) of the installed distribution that provides ``module``'s top-level package (None:
    none does, e.g. the standard library)."""
    names = _providers().get(module.partition(".")[0]) or []
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
