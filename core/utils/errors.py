"""An exception's first line, the part a one-line refusal quotes (an error without a message: its type name)."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of ``str(err)`` (at most ``limit`` characters), else the error's type name."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if limit is None else line[:limit]
