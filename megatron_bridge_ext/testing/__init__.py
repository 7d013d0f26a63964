"""The shared harness of the demo, the benchmarks, the device check and the tests (like ``torch.testing``).

Not the product, and the product never imports it: a tiny Megatron Core GPT (:mod:`.tiny_model`), the
feature variants run side by side on it (:mod:`.variants`), process-group setup (:mod:`.distributed`),
a fused-attention stand-in for the local layer spec (:mod:`.sdpa_attention`), an attention that keeps a fused
kernel's saved set for multi-latent attention's real runs (:mod:`.fused_attention`) and one measured step
(:mod:`.peak`). On a machine without CUDA ranks run through :mod:`.cpu_run`, which installs
:mod:`.cpu_emulation` (CPU stand-ins for the CUDA-only calls Megatron Core makes). It ships in the
wheel because ``mbx demo`` and ``mbx bench memory`` run on it.
"""
