"""Composition: the chain a trial runs, the Ray Tune sweep, SLURM launch, the tracking adapter."""
