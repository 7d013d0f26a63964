"""The ``mbx demo`` and ``mbx bench memory`` commands.

The rank-side runners (:mod:`.train` for the demo, :mod:`.bench` for the benchmark), their shared
options (:mod:`.options`) and launcher (:mod:`.launch`). What they run on (the tiny model, the
variants, process groups, the CPU emulation) is the shared harness, :mod:`megatron_bridge_ext.testing`.
"""
