"""megatron-bridge-ext: cut peak GPU memory in Megatron Bridge training.

Importing this package is cheap: it imports neither torch nor Megatron. The features live in
their modules (``levers``, ``peft``, ``estimate``, ``measure``, ``diagnose``, ...) and the
upstream changes in ``patches``.
"""

__version__ = "0.1.0"


def init(*, nccl_ub=False, cuda_graph_impl=None, ipc=None):
    """The first line of a training script, before anything touches CUDA or imports Bridge's training modules.

    1. Turns on expandable segments before CUDA starts: see :func:`megatron_bridge_ext.levers.allocator.init`.
    2. Applies the patches Bridge's ``pretrain``/``finetune`` need to import and start, and the
       Transformer Engine norm-gradient fix for any LoRA-family PEFT, Bridge's own classes included
       (:data:`megatron_bridge_ext.patches.registry.INIT`), with its run-time check: import hooks, so
       they import nothing now and take effect when the script imports Bridge (or at once if it has).
       One log line says what each did. ``mbx run`` does the same in every Python process it starts.

    Returns the allocator's result. The imports happen here, on call, so that
    ``import megatron_bridge_ext`` stays cheap and torch is not imported before the allocator
    variables are set.
    """
    import logging

    from megatron_bridge_ext.levers.allocator import init as _init
    from megatron_bridge_ext.patches.registry import install_init_hooks

    result = _init(nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl, ipc=ipc)
    statuses = install_init_hooks()
    logging.getLogger("megatron_bridge_ext").info(
        "megatron_bridge_ext.init() (first line of the training script): patches for Bridge's training entry "
        "points and LoRA on Transformer Engine: %s; TE norm-gradient check installed",
        "; ".join(f"{s.name} {s.status}" for s in statuses))
    return result
