"""The CUDA caching allocator's settings, chosen by relay rather than by hand.

A DiT step allocates and frees activations of many sizes (the 30 blocks' saved tensors, then
their gradients); with fixed-size segments the freed blocks fragment and reserved memory
climbs well above what is allocated. Expandable segments grow one mapping instead. The
setting is read once, when CUDA first allocates, so it must be in the environment before any
tensor reaches the GPU.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("relay")

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def configure_cuda_allocator(environ=os.environ) -> str:
    """Sets PYTORCH_CUDA_ALLOC_CONF to expandable segments unless the user set it; logs which.

    Returns the value in effect. Call before the first CUDA allocation (it has no effect after).
    """
    if environ.get(ALLOC_CONF):
        log.info("CUDA allocator: %s=%s (preset)", ALLOC_CONF, environ[ALLOC_CONF])
    else:
        environ[ALLOC_CONF] = DEFAULT
        log.info("CUDA allocator: %s=%s (relay's default)", ALLOC_CONF, DEFAULT)
    return environ[ALLOC_CONF]
