"""Megatron Bridge's own training loop on a tiny GPT: the recipe (:mod:`.recipe`), what is measured inside
the loop (:mod:`.meters`) and one run of it (:mod:`.runner`). ``mbx demo --bridge`` and the tests use them.
"""
