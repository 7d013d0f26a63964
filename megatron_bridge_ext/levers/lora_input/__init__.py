"""LoRA-A's input under sequence parallelism: keep the local sequence shard instead of the gathered input.

:mod:`.sp_lora` holds the autograd core (torch and Megatron Core only) and the strategy registry;
:mod:`.collectives` is the one table of what each strategy communicates, which the registry
describes and :mod:`.cost` prices; :mod:`.eligibility` decides, per base layer, whether an adapter
can use a strategy; :mod:`.sp_input` applies it to Bridge's LoRA-family PEFTs (the classes in
:mod:`megatron_bridge_ext.peft` pick it); :mod:`.te_check` checks the Transformer Engine path on a
device.

Importing this package imports none of them.
"""
