"""One module per DVC stage. Each exposes `run(params, ...)` (called by DVC and by Ray trials alike)
and `main(argv)` for `python -m stages.<name> [--params FILE]`."""
