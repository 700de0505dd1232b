"""The sweep driver's own lines on stdout (``sweep: <msg>``)."""

from __future__ import annotations


def say(msg: str) -> None:
    print(f"sweep: {msg}", flush=True)
