"""What every training stage gives the loop in train.py.

A stage owns its roles (the models it checkpoints), their optimizers, LR schedulers and EMAs,
and one method, `train_step`, that performs one optimizer step (all micro-batches) and returns
the numbers to log. The loop owns everything else: resume, saving, logging, preemption.

Checkpoint members: a single-role stage saves `transformer/`, `optimizer/` and (with EMA)
`ema/`; a multi-role stage saves one directory per role plus `optimizer/` and `ema/` holding a
mapping by role.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("relay")
from trainer.parallel.distributed import mean_across_ranks, total_norm


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is not finite; raised with the optimizer step skipped."""


@dataclass(frozen=True)
class WarmStartSource:
    """Weights a stage starts from when its output_dir has no checkpoint: `role` (a key of
    Stage.roles) is loaded from `path` (trainer.checkpoint.warm_start's kinds of path) by trainer.run_state."""

    role: str
    path: str
    weights: str  # live | ema
    allow_missing: tuple[str, ...] = ()
    allow_unexpected: tuple[str, ...] = ()


class Stage(abc.ABC):
    name = "base"
    roles: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]
    emas: dict

    @abc.abstractmethod
    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (every micro-batch); the numbers to log."""

    @abc.abstractmethod
    def sampling_model(self, weights: str = "live") -> nn.Module:
        """The module to sample from (the EMA is swapped in by the caller)."""

    # --- warm start and checkpoint members -----------------------------------------------
    def warm_start_sources(self) -> list[WarmStartSource]:
        """What to load before the first step when there is nothing to resume (default: none)."""
        return []

    def after_warm_start(self, reports: dict[str, dict]) -> None:
        """Called with each role's load report once every source is loaded: EMAs restart from
        the loaded weights. A stage may check or complete what was loaded here."""
        for role, ema in self.emas.items():
            ema.reset(self.roles[role])

    def model_members(self) -> dict[str, nn.Module]:
        return dict(self.roles)

    def extra_state(self) -> dict:
        """Small state beyond modules/optimizers (e.g. EMA counters), saved in training_state."""
        return {"ema_updates": {k: e.num_updates for k, e in self.emas.items()}}

    def load_extra_state(self, state: dict) -> None:
        for k, n in state.get("ema_updates", {}).items():
            if k in self.emas:
                self.emas[k].num_updates = int(n)


def check_finite(step: int, **values: float) -> None:
    """Raise NonFiniteError naming the step and the offending values."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFiniteError(
            f"non-finite {detail} at step {step}; the optimizer step was skipped and nothing "
            f"saved was touched. Lower learning_rate, set max_grad_norm, or check the data.")


def clip_and_step(step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  loss: torch.Tensor, max_grad_norm: float) -> tuple[float, float]:
    """Clip the gradients (0 = measure only) and step the optimizer; return the loss (averaged
    over ranks) and the gradient norm as floats. Raises NonFiniteError when either is not
    finite, with no weight or optimizer moment changed.

    torch's fused AdamW (relay's optimizer on GPUs) can skip its step on the device, given a
    `found_inf` flag as the AMP grad scaler gives it: its update is queued right behind the
    backward pass and the host reads the two numbers afterwards, so the GPU never idles waiting
    for the host between the two. Any other optimizer steps after the host has checked them.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    norm = (total_norm(torch.nn.utils.clip_grad_norm_(params, limit)) if params
            else torch.zeros((), device=loss.device))
    loss = mean_across_ranks(loss.detach())
    on_device = _skips_on_device(optimizer)
    if on_device:
        bad = ~(torch.isfinite(loss).to(norm.device) & torch.isfinite(norm))
        optimizer.found_inf = bad.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    loss_value, norm_value = float(loss), float(norm)
    check_finite(step, loss=loss_value, grad_norm=norm_value)
    if not on_device:
        optimizer.step()
    return loss_value, norm_value


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True for torch's fused Adam/AdamW, whose kernel reads the `found_inf` flag."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and \
        bool(optimizer.defaults.get("fused"))


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """A data batch with its tensors, and a pack's lists of tensors, moved to `device`
    (captions and ids stay as they are)."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
            return [move(v) for v in value]
        return value

    return {k: move(v) for k, v in batch.items()}


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The LRs to log: `lr` of the AdamW groups and, with Muon, `muon_lr` of the Muon groups."""
    rates: dict[str, float] = {}
    for group in optimizer.param_groups:
        key = "muon_lr" if group.get("use_muon") else "lr"
        rates.setdefault(key, group["lr"])
    return rates


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast on GPU (auto or bfloat16), nothing on CPU unless bfloat16 is asked for."""
    bf16 = dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")
    _log_compute_dtype(dtype, device.type, bf16)
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return torch.autocast(device_type=device.type, enabled=False)


@functools.lru_cache(maxsize=None)
def _log_compute_dtype(dtype: str, device_type: str, bf16: bool) -> None:
    # once per setting: what `dtype: auto` became is otherwise invisible in the logs
    log.info("compute dtype: %s on %s -> %s", dtype, device_type,
             "bf16 autocast (weights and optimizer in float32)" if bf16 else "no autocast")
