"""Parallelism as a memory lever: resizing EP/ETP (mixture of experts) on the same GPUs and TP/PP at the cost of DP,
and CPU offloading of activations.

:mod:`.constraints` holds the model-level refusals (CPU offloading, CUDA graphs with full recompute,
distributed saved activations), the expert-parallel layout rules and the limits of resizing; :mod:`.cost` the traffic formulas the
plan prices a resize with.
"""
