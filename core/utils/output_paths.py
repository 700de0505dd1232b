"""Output paths checked before any compute (issue 59): a command that will write a folder or a file at its end
first makes sure it can, so that hours of work do not end in "cannot write". Each check is a one-line
:class:`OutputPathError` naming the path and why.

Writability is tried, not inferred from permission bits (root passes every ``os.access`` check, and a read-only
mount or /proc refuses what the bits allow): a temp file is created in the folder the output goes to (or in
its nearest existing ancestor, for a folder to be created) and removed at once, as ``core.utils.atomic``'s
writers create theirs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path the command could not write: the message is one line naming it."""


def _probe(folder: Path) -> str | None:
    """Why a file cannot be created in the existing folder ``folder`` (None: it can)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tcnn-probe.", suffix=".tmp", dir=folder)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (as a path: a dangling symlink does not count)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(path.anchor or ".")


def _unwritable(folder: Path) -> str | None:
    """Why files cannot be created in the folder ``folder`` or in a folder created there (None: they can)."""
    base = _existing_ancestor(folder.absolute())
    if not base.is_dir():
        return f"{base} is not a directory"
    if (why := _probe(base)) is not None:
        return f"cannot create files in {base} ({why})"
    return None


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` is a folder files can be created in, or one that can be created (its nearest existing ancestor
    is a folder files can be created in). ``what`` names the option or key in the message."""
    path = Path(path)
    if (why := _unwritable(path)) is not None:
        raise OutputPathError(f"{what} {path}: {why}")
    return path


def check_output_file(path: str | os.PathLike, what: str, *, holds: tuple[str, ...] = ()) -> Path:
    """``path`` is a file the command can replace (atomically: a temp file beside it, then a rename), or one
    it can create; an existing file must be a readable regular file and hold each of ``holds`` (e.g. the
    markers of the block the command replaces)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OutputPathError(f"{what} {path}: not a regular file")
    if path.is_file():
        try:
            text = path.read_text() if holds else ""
        except (OSError, UnicodeDecodeError) as err:
            raise OutputPathError(f"{what} {path}: cannot read it ({type(err).__name__})") from None
        missing = [h for h in holds if h not in text]
        if missing:
            raise OutputPathError(f"{what} {path}: it has no {missing[0]}")
    elif holds:
        raise OutputPathError(f"{what} {path}: no such file (it must hold {' ... '.join(holds)})")
    if (why := _unwritable(path.parent)) is not None:
        raise OutputPathError(f"{what} {path}: {why}")
    return path
