"""megatron-bridge-ext: cut peak GPU memory in Megatron Bridge training.

Importing this package is cheap: it imports neither torch nor Megatron. The features live in
their modules (``measure``, ``peft``, ``tiny_model``, ``allocator``, ``diagnose``, ...) and the
upstream changes in ``patches``.
"""

__version__ = "0.1.0"


def init(*, nccl_ub=False, cuda_graph_impl=None, ipc=None):
    """First call of a training script: turn on expandable segments before CUDA starts.

    See :func:`megatron_bridge_ext.allocator.init`; the import happens here, on call, so that
    ``import megatron_bridge_ext`` stays cheap and torch is not imported before the allocator
    variables are set.
    """
    from megatron_bridge_ext.allocator import init as _init

    return _init(nccl_ub=nccl_ub, cuda_graph_impl=cuda_graph_impl, ipc=ipc)
