"""Capture and restore every random number generator a training step touches.

The captured state holds only tensors, lists, ints, floats and strings, so it can be saved with
`torch.save` and read back with `torch.load(weights_only=True)`: a checkpoint never needs to
unpickle arbitrary objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RNG_STATE_FORMAT = 1


def capture_rng_state() -> dict[str, Any]:
    """Return the state of Python's `random`, NumPy's global generator, torch CPU and this rank's CUDA device.

    Only the current CUDA device is captured: one rank drives one device, and asking for every
    device's state would create a CUDA context on each of them. The CUDA entry is an empty list
    when CUDA is not in use, so a CPU state restores on CPU without special cases.
    """
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    cuda_states: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_states = [torch.cuda.get_rng_state().clone()]
    return {
        "format": RNG_STATE_FORMAT,
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        # uint32 keys widened to int64: torch has no uint32 tensors that every version loads.
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": cuda_states,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back to `state` (from `capture_rng_state`).

    Raises ValueError if `state` is not in the expected format, or holds a CUDA state while CUDA
    is not available here (a CPU resume of a GPU run: reseed instead).
    """
    if not isinstance(state, dict) or state.get("format") != RNG_STATE_FORMAT:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an RNG state of format {RNG_STATE_FORMAT} (got {got})")
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state["cuda"]
    if cuda_states:
        if not torch.cuda.is_available():
            raise ValueError("RNG state holds a CUDA generator but CUDA is not available here")
        torch.cuda.set_rng_state(cuda_states[0])
