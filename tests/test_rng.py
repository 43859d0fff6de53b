"""RNG capture and restore."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from trainer.checkpoint.rng import capture_rng_state, restore_rng_state


def draw() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.randn()), torch.randn(3).tolist()


def test_restored_generators_repeat_the_same_draws_after_a_weights_only_round_trip():
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator
    state = capture_rng_state()
    expected = draw()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=True)
    draw()
    restore_rng_state(reloaded)
    assert draw() == expected


def test_restore_rejects_something_that_is_not_an_rng_state():
    with pytest.raises(ValueError, match="not an RNG state"):
        restore_rng_state({"python": 1})
