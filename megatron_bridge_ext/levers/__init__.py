"""The memory levers, one folder each, in the order ``mbx plan`` tries them.

* :mod:`.allocator`: expandable segments, set before CUDA starts (no memory saved, fragmentation cut);
* :mod:`.lora_input`: LoRA-A's input under sequence parallelism (``off``, ``regather``, ``shard_local``);
* :mod:`.recompute`: selective activation recompute, and the run-time probe that shows it ran.

Importing this package imports none of them.
"""
