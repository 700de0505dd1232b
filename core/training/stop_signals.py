"""Stop signals of a training run: SIGTERM (SLURM time limit), SIGHUP, SIGUSR1/SIGUSR2 (SLURM --signal,
submitit) become a flag the loop (core.training.loop) reads at step boundaries; it checkpoints, then raises
`Preempted`, and the run resumes when started again.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "try again later" -- the run resumes when started again


STOP_SIGNALS = tuple(
    s
    for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"))
    if s is not None
)


class Preempted(Exception):
    """A stop signal arrived; the state was checkpointed at a step boundary and the run can resume."""

    def __init__(self, signum: int, checkpoint: Path, epoch: int, step: int) -> None:
        self.signum, self.checkpoint, self.epoch, self.step = signum, checkpoint, epoch, step
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(
            f"stopped by {name} at epoch {epoch + 1} step {step}; state saved to {checkpoint}; "
            "run the same command again to resume"
        )


class StopSignals:
    """Turn SIGTERM (SLURM time limit), SIGHUP, SIGUSR1 (SLURM --signal) and SIGUSR2 (submitit) into a flag read
    at step boundaries. After the checkpoint is written, a handler that was installed before (e.g.
    submitit's SIGUSR2 requeue handler) is called, then `Preempted` is raised. Outside the main thread
    (some Ray workers) signals cannot be caught and this does nothing."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> StopSignals:
        for s in self.signals:
            with contextlib.suppress(ValueError, OSError):  # not the main thread: no signal handling
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, prev in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def chain(self) -> None:
        """Call the handler that was installed before ours for the received signal, if it was Python's."""
        if self.received is None:
            return
        prev = self._previous.get(self.received)
        # The stage process's own handler (stages.harness.runner.stop_on_signals) would only raise: Preempted says it.
        if (
            callable(prev)
            and prev is not signal.default_int_handler
            and not getattr(prev, "tcnn_stage_handler", False)
        ):
            prev(self.received, None)


def stop_signum(stop: StopSignals) -> int:
    """The signal that stopped this rank, or SIGTERM for a rank stopped because another one was signalled."""
    return stop.received if stop.received is not None else int(signal.SIGTERM)
