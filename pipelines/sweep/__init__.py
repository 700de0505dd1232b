"""The Ray Tune sweep (`tcnn sweep`)."""
