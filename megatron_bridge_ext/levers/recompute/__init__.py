"""Selective activation recompute: the modules Megatron Core accepts and what ``core_attn`` saves
(:mod:`.attention`), and the run-time proof that the flag took effect (:mod:`.probe`).

Importing this package imports neither of them.
"""
