"""Random draws that follow the sample, not the rank.

Every random choice made for a training sample (its noise level, caption drop, clean
conditioning frames, noise, Stage1's time pair) comes from a generator of its own, seeded by
(run seed, step, the sample's global index in the data stream, purpose). The same global
batch then draws the same numbers whether it is split over 1, 2 or 8 data-parallel ranks, in
one micro-batch or four, and a run resumed on another number of ranks continues the same
trajectory. Draws that all ranks must agree on (Stage2's exit step decides how many forwards
every rank runs) are keyed by the step alone.

A sample's generator is consumed in the order the loss code asks, so a stage must draw the
same things in the same order for every sample; drawing per sample keeps that true whatever
the batch composition.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

# Purposes keep the streams of one sample apart where a stage draws for it twice in a step
# (Stage2's student and critic batches are different samples, but a purpose costs nothing).
TRAIN = 0
STEP_SHARED = 1


def _seed(*key: int) -> int:
    # SeedSequence mixes the key's words into well-spread state; 63 bits fit manual_seed.
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]).generate_state(2, np.uint64)[0]
               >> np.uint64(1))


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator every rank seeds the same at `step` (for draws all ranks must agree on)."""
    return torch.Generator(device=device).manual_seed(_seed(seed, step, STEP_SHARED))


class SampleDraws:
    """Per-sample generators for one micro-batch: keys are the samples' global stream indices
    (the batch's "sample_keys"), one generator each, on `device`."""

    def __init__(self, seed: int, step: int, keys: Sequence[int],
                 device: torch.device | str = "cpu", purpose: int = TRAIN):
        self.device = torch.device(device)
        self.generators = [torch.Generator(device=self.device).manual_seed(
            _seed(seed, step, key, key >> 32, purpose)) for key in keys]

    def __len__(self) -> int:
        return len(self.generators)

    def one(self, i: int) -> "SampleDraws":
        """The draws of sample i alone (the same generator: drawing from it moves both)."""
        single = SampleDraws.__new__(SampleDraws)
        single.device, single.generators = self.device, [self.generators[i]]
        return single

    def stack(self, draw: Callable[[torch.Generator], torch.Tensor]) -> torch.Tensor:
        """torch.stack of draw(generator) over the samples, in batch order."""
        return torch.stack([draw(g) for g in self.generators])

    def uniform(self) -> torch.Tensor:
        """One U[0, 1) draw per sample: float32 [B] on the draws' device."""
        return self.stack(lambda g: torch.rand((), generator=g, device=self.device))

    def normal_like(self, x: torch.Tensor) -> torch.Tensor:
        """Standard normal noise shaped like x [B, ...] (each sample's own), x's dtype and device."""
        shape = tuple(x.shape[1:])
        return self.stack(lambda g: torch.randn(shape, generator=g, device=self.device)).to(x)
