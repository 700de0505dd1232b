"""Layers: GPSA (T-CNN and ConViT modes), PSA, attention-augmented conv, CMHSA, GEMM routes, locality.

Layer: imports ``core.utils`` only.
"""
