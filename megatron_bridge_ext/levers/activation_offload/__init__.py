"""Fine-grained activation offloading (Megatron Core 0.19 ``fine_grained_activation_offloading``): what Core and Bridge
refuse (:mod:`.constraints`) and the step time of its host-device copies (:mod:`.cost`). Its memory effect is traced
by the estimate (:mod:`megatron_bridge_ext.estimate.features.activation_offload`).

Importing this package imports neither of them.
"""
