"""Utilities that know nothing of the project: atomic file writes, hashing, logging."""
