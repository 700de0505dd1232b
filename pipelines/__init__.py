"""Composition: the chain a trial runs, the Ray Tune sweep and its studies, SLURM launch, the `tcnn` command.
The MLflow adapter both paths use is the stage harness's (`stages.harness.tracking`)."""
