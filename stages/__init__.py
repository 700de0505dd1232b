"""One module per DVC stage. Each exposes `run(params, ...)` (called by DVC and by Ray trials alike)
and `main(argv)` for `python -m stages.<name> [--params FILE]`.

Importing this package first, as ``python -m stages.<name>`` does, installs a stop-signal handler for the
seconds the stage spends importing torch, MLflow and the rest, before `stages.harness.runner.stage_main` installs its
own: a signal then ends the process with one line and the stage's usual status (75, or 130 for Ctrl-C), not a
traceback or a bare death by signal. Nothing is open or written at that point.
"""

import signal as _signal
import sys as _sys
import threading as _threading


def _stopped_while_starting(signum: int, frame: object) -> None:
    argv = getattr(_sys, "orig_argv", [])
    name = next((a.removeprefix("stages.") for a in argv if a.startswith("stages.")), "stage")
    print(
        f"{name}: stopped by {_signal.Signals(signum).name} while starting; nothing was written",
        file=_sys.stderr,
    )
    raise SystemExit(130 if signum == _signal.SIGINT else 75)


if _sys.argv[:1] == ["-m"] and _threading.current_thread() is _threading.main_thread():  # python -m stages.X
    for _name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        _signal.signal(getattr(_signal, _name), _stopped_while_starting)
