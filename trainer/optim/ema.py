"""Exponential moving average of a model's weights (fp32 shadow).

ema <- d * ema + (1 - d) * live, after the optimizer step of the tracked model. The shadow is
created (a copy of the live weights) at the first update with count >= start, then updated every
`update_every` counts; `count` is whatever the caller counts: optimizer steps for FM, student
updates for Stage2. Its state dict has the model's own keys, so a checkpoint's `ema/` member
loads into a model like `transformer/` does; on resume, DCP fills that dict in place.
With `trainable_only` (a LoRA run) the shadow holds the trained parameters only, the adapters:
the frozen base never moves, so an average of it would be a second copy of it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float, start: int = 0, update_every: int = 1,
                 trainable_only: bool = False):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay}")
        self.decay = decay
        self.start = start
        self.update_every = max(1, update_every)
        self.num_updates = 0
        self.trainable_only = trainable_only
        # The shadow exists from the start (a copy) so checkpoints always carry the member; it
        # is re-copied when tracking begins at `start`.
        self.shadow = {k: v.detach().clone().float() for k, v in self._tracked(model).items()}

    @torch.no_grad()
    def update(self, model: nn.Module, count: int) -> bool:
        """Update after the count-th step of the tracked model. Returns whether it updated."""
        if count < self.start or (count - self.start) % self.update_every != 0:
            return False
        live = self._tracked(model)
        if count == self.start:
            for k, v in live.items():
                self.shadow[k].copy_(v.float())
        else:
            for k, v in live.items():
                self.shadow[k].lerp_(v.float(), 1.0 - self.decay)
        self.num_updates += 1
        return True

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Make the shadow a copy of the live weights (after a warm start)."""
        for k, v in self._tracked(model).items():
            self.shadow[k].copy_(v.float())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module):
        """Temporarily put the EMA weights into `model`; the live weights come back bit-exact."""
        tracked = self._tracked(model)
        live = {k: v.detach().clone() for k, v in tracked.items()}
        with torch.no_grad():
            for k, v in tracked.items():
                v.copy_(self.shadow[k].to(v.dtype))
        try:
            yield model
        finally:
            with torch.no_grad():
                for k, v in tracked.items():
                    v.copy_(live[k])

    def _tracked(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return _tracked(model, self.trainable_only)


def _tracked(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Floating-point parameters and buffers by their state-dict key (`trainable_only`: the
    parameters that require grad)."""
    model = getattr(model, "module", model)
    state = model.state_dict(keep_vars=True)
    if trainable_only:
        return {k: v for k, v in state.items() if isinstance(v, nn.Parameter) and v.requires_grad}
    return {k: v for k, v in state.items() if v.is_floating_point()}
