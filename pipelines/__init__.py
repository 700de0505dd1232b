"""Composition: the chain a trial runs, the Ray Tune sweep and its studies, SLURM launch, the `tcnn` command.
The MLflow adapter both paths use is `stages.tracking` (it imports neither the stages nor the sweep)."""
