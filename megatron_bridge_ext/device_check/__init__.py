"""The device check: every GPU figure of the project from one command, on a machine with Python 3.12 and torch.

``python -m megatron_bridge_ext.device_check`` (``scripts/device_check.sh``) installs the carried wheels
and runs the check; each job is a module, runnable with ``python -m``:

* ``__main__``: the one command: the carried wheels into a private folder, then ``check``;
* ``check``: the parts in order, each in its own process under its own timeout, and their verdicts;
* ``fragmentation_workload``: a fragmentation OOM on purpose (default allocator) and its absence
  (``megatron_bridge_ext.init()``);
* ``peak_memory``: rank 0 of a TP=2 LoRA job on one device through a fake process group, per variant;
  ``estimates.json`` (package data) holds the memory estimates of the measured configs;
* ``one_gpu``: two allocator-level checks on one GPU at the grid's tiny shapes (the saved-activation meter
  against ``memory_allocated``; shard_local's saving at rank 0 of TP=2), bound by the allocator's rounding;
* ``wheels``: the pinned wheel set downloaded and checked against its budget, and installed;
* ``torch_only_venv`` and ``rehearsal``: the whole check rehearsed on a CPU (``make device-rehearsal``).

Importing any of them imports neither torch nor Megatron: the GPU machine has no Megatron until the
carried wheels are installed, and the parts import what they need when they run.
"""
