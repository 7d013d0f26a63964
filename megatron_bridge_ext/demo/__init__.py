"""The demo and benchmark harness behind ``mbx demo`` and ``mbx bench memory``.

Not the product: a tiny Megatron Core GPT (:mod:`.tiny_model`), the feature variants run side by
side on it (:mod:`.variants`), the rank-side runners (:mod:`.train` for the demo, :mod:`.bench`
for the benchmark), their shared options (:mod:`.options`) and launcher (:mod:`.launch`). On a
machine without CUDA the launcher runs the ranks through :mod:`.cpu_run`, which installs
:mod:`.cpu_emulation` (CPU stand-ins for the CUDA-only calls Megatron Core makes); nothing else in
the package imports it.
"""
