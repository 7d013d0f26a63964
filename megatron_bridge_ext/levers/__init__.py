"""The memory levers, one folder each, in the order ``mbx plan`` tries them.

* :mod:`.allocator`: expandable segments, set before CUDA starts (no memory saved, fragmentation cut);
* :mod:`.lora_input`: LoRA-A's input under sequence parallelism (``off``, ``regather``, ``shard_local``);
* :mod:`.recompute`: selective activation recompute, and the run-time probe that shows it ran;
* :mod:`.parallelism`: TP/PP resizing at the cost of DP, and CPU offloading of activations.

Each folder holds the lever's flags, checks and application (``config.py``, composed by
:class:`megatron_bridge_ext.config.MemoryConfig`; parallelism: ``constraints.py``), its cost for the
plan (``cost.py``) and its options in the plan (``advice.py``, looped over by
:mod:`megatron_bridge_ext.planner`). :mod:`.change` and :mod:`.step` hold what they share.
Importing this package imports none of them.
"""
