"""Parallelism as a memory lever: resizing TP/PP at the cost of DP, and CPU offloading of activations.

:mod:`.constraints` holds the model-level refusals (CPU offloading, CUDA graphs with full recompute,
distributed saved activations) and the limits of resizing; :mod:`.cost` the traffic formulas the
plan prices a resize with.
"""
