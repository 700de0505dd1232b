"""Layers: GPSA (one base, T-CNN and ConViT layers), PSA, attention-augmented conv, CMHSA, GEMM routes, locality.

Layer: imports ``core.utils`` only.
"""
