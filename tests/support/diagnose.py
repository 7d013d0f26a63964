"""What the OOM diagnosis tests share: an OOM message as torch prints it, read by the classifier and the handler."""

from __future__ import annotations

OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "1.52 GiB is free. Including non-PyTorch memory, this process has 77.66 GiB memory in use. Of the "
               "allocated memory 52.00 GiB is allocated by PyTorch, and 22.60 GiB is reserved by PyTorch but "
               "unallocated.")
