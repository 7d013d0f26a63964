"""megatron-bridge-ext: cut peak GPU memory in Megatron Bridge training.

Importing this package is cheap: it imports neither torch nor Megatron. The features live in
their modules (``measure``, ``peft``, ``tiny_model``, ...) and the upstream changes in ``patches``.
"""

__version__ = "0.1.0"
