"""The Inductor settings every family's compiled blocks are built under.

Training must compile under these same settings when compile_transformer is set: the
Inductor/Triton cache keys include the Inductor config, so a kernel warm-up that compiled
differently would warm nothing.
"""

from __future__ import annotations

__all__ = ["ACTIVATION_MEMORY_BUDGET", "apply_compile_settings"]

ACTIVATION_MEMORY_BUDGET = 0.93  # of compiled blocks; see apply_compile_settings


def apply_compile_settings() -> None:
    """Sets the process-wide Inductor and partitioner options relay compiles blocks with."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # A known pitfall: torch 2.11's Inductor computed wrong gradients for
    # per-block adaLN tables with this reduction fusion on (pytorch#193061). Off for both the
    # warm-up and training, so their cache keys agree.
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False
    # The partitioner keeps 93% of the activations it would save by default and recomputes the
    # cheapest rest in the backward pass: at the Wan-1.3B size on an H200 the step's peak fell
    # from 93.5 to 67.3 GiB at the same step time (docs/performance.md).
    functorch_config.activation_memory_budget = ACTIVATION_MEMORY_BUDGET
