"""Optimizers and LR schedules: AdamW, or Muon for the blocks' hidden matrices plus AdamW.

Muon (docs/algorithms.md, "Muon"; KellerJordan/Muon) orthogonalises the Nesterov momentum of a 2-D
weight with five Newton-Schulz iterations and applies it with KellerJordan's shape scale
sqrt(max(1, rows/cols)); its learning rate is in spectral-norm units (default 0.02), so it is
configured apart from the AdamW learning rate. `MuonWithAdamW` holds both kinds of parameter
groups in ONE torch optimizer (groups tagged use_muon), so LR schedulers, state_dict and
torch.distributed.checkpoint treat it like any other optimizer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_update

try:  # DTensor exists only in builds with torch.distributed.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None

# Quintic Newton-Schulz coefficients chosen by KellerJordan to push singular values into
# roughly [0.7, 1.2] in five steps (not to convergence at 1: faster, and good enough).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")

# Name fragments that keep a 2-D weight inside `blocks` out of Muon when the model's family says
# nothing else (ModelFamily.muon_excluded_name_parts): norms, adaLN modulation and embedders are
# not hidden matrices ("Parameter split").
MUON_EXCLUDED_NAME_PARTS = ("norm", "modulation", "adaln", "embed", "scale_shift_table")


# ---------------------------------------------------------------------------------------------
# Newton-Schulz orthogonalisation (docs/algorithms.md, "Newton-Schulz")
# ---------------------------------------------------------------------------------------------

def newton_schulz5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, *,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise G (its last two dims): U S V^T -> U S' V^T, S' in ~[0.7, 1.2].

    The iteration runs in `dtype`: by default bfloat16 on CUDA (the reference) and float32
    elsewhere, because bf16 matmuls are slow on CPU and fp32 gives the tests a tight tolerance.
    Returns a tensor shaped and typed like G. Raises ValueError when G has fewer than 2 dims.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz5 needs a matrix, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    a, b, c = _NS_COEFFS
    X = G.to(dtype)
    # Iterate on the wide orientation so X X^T is the smaller Gram matrix.
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    # Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def _orthogonalized_update(update: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """Muon's step direction for one whole weight: NS5 of its matrix view times the shape scale."""
    return _orthogonalized_batch([update], ns_steps)[0]


def _orthogonalized_batch(updates: list[torch.Tensor], ns_steps: int) -> list[torch.Tensor]:
    """The directions of weights whose matrix views share one shape, in one batched NS5: a
    transformer's blocks repeat the same few shapes, and small matmuls one by one cost more in
    dispatch than in arithmetic on the CPU."""
    # conv filters [out, in, kh, kw] -> [out, in * kh * kw]
    matrices = torch.stack([u.reshape(u.shape[0], -1) for u in updates])
    rows, cols = matrices.shape[-2:]
    out = newton_schulz5(matrices, steps=ns_steps) * math.sqrt(max(1.0, rows / cols))
    return [d.view(u.shape) for d, u in zip(out.unbind(0), updates)]


def _orthogonalized_updates(updates: list[torch.Tensor], ns_steps: int) -> list[torch.Tensor]:
    """The directions of a group's weights: plain tensors batched by matrix shape; FSDP2-sharded
    ones (DTensors) spread over their shard group, so each rank runs Newton-Schulz on 1/S of
    the matrices."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    sharded = []
    by_shape: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        if DTensor is not None and isinstance(update, DTensor):
            sharded.append(i)
        else:
            key = (update.shape[0], update[0].numel(), update.dtype, update.device)
            by_shape.setdefault(key, []).append(i)
    for same in by_shape.values():
        for i, direction in zip(same, _orthogonalized_batch([updates[i] for i in same], ns_steps)):
            out[i] = direction
    if sharded:
        from trainer.parallel.distributed import orthogonalize_sharded

        for i, direction in zip(sharded, orthogonalize_sharded(
                [updates[i] for i in sharded],
                lambda full: _orthogonalized_update(full, ns_steps))):
            out[i] = direction
    return out


@torch.no_grad()
def _muon_group_step(state: dict, group: dict) -> None:
    """Apply one Muon step to every parameter with a gradient in `group` ("Newton-Schulz")."""
    lr = float(group["lr"])
    beta = group["momentum"]
    wd = group["weight_decay"]
    params, updates = [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        grad = p.grad
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(grad)
        buf = st["momentum_buffer"]
        buf.lerp_(grad, 1.0 - beta)  # M <- beta M + (1 - beta) G
        # Nesterov look-ahead: (1 - beta) G + beta M.
        params.append(p)
        updates.append(grad.lerp(buf, beta) if group["nesterov"] else buf)
    for p, direction in zip(params, _orthogonalized_updates(updates, group["ns_steps"])):
        if wd != 0:
            p.mul_(1.0 - lr * wd)  # decoupled decay, before the update
        p.add_(direction.to(p.dtype), alpha=-lr)


def _on_cuda(params: list) -> bool:
    return bool(params) and all(p.is_cuda for p in params)


@torch.no_grad()
def _adamw_group_step(state: dict, group: dict) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic, no amsgrad) for `group`.

    Runs torch's multi-tensor implementation: fused on CUDA, foreach elsewhere; a Python loop
    over 120 weights of a DiT costs more than the update itself.
    """
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    fused = _on_cuda(params)
    for p in params:
        st = state[p]
        if not st:
            # `step` is a 0-d float tensor, as in torch.optim.AdamW, so state dicts (and DCP)
            # hold only tensors. The fused kernel reads it on the device, foreach on the host.
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step_device = p.device if fused else torch.device("cpu")
        if st["step"].device != step_device:  # fresh, or loaded from a checkpoint of the other kind
            st["step"] = st["step"].to(step_device)
    beta1, beta2 = group["betas"]
    adamw_update(
        params, [p.grad for p in params], [state[p]["exp_avg"] for p in params],
        [state[p]["exp_avg_sq"] for p in params], [], [state[p]["step"] for p in params],
        foreach=not fused, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2,
        lr=float(group["lr"]), weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def _check_muon_params(params: list) -> None:
    for p in params:
        if p.ndim < 2:
            raise ValueError(
                f"Muon only updates matrices (ndim >= 2); got a parameter of shape "
                f"{tuple(p.shape)}. Give 1-D parameters to AdamW.")


def _as_param_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


class Muon(torch.optim.Optimizer):
    """Muon for matrix parameters: Nesterov momentum, Newton-Schulz-5, KellerJordan scaling.

    Per step and weight W with gradient G: M <- 0.95 M + 0.05 G; U = 0.05 G + 0.95 M
    (nesterov) or M; O = NS5(U) * sqrt(max(1, rows/cols)) (KellerJordan scaling: lr is in
    spectral-norm units, not matched to AdamW's update RMS as Moonlight's 0.2*sqrt(max) is);
    W <- W * (1 - lr * weight_decay); W <- W - lr * O. Parameters of more than 2 dims are
    treated as [shape[0], rest]. State per parameter: `momentum_buffer` (a tensor shaped like
    it). FSDP2 DTensor parameters: each matrix is gathered on one rank of its shard group,
    orthogonalised there and scattered back (trainer.parallel.distributed.orthogonalize_sharded), so
    the Newton-Schulz work per rank falls with the shard group's size.
    Raises ValueError for a parameter with fewer than 2 dims.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                        weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group, params=_as_param_list(param_group["params"]))
        _check_muon_params(param_group["params"])
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter with a gradient; returns closure() when one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _muon_group_step(self.state, group)
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer holding Muon groups and AdamW groups, told apart by group["use_muon"].

    `param_groups` is a list of dicts, each with "params" and "use_muon" (bool); keys a group
    leaves out take the constructor defaults of its kind: Muon groups lr=muon_lr, momentum,
    nesterov, ns_steps, weight_decay; AdamW groups lr=lr, betas, eps, weight_decay. Muon groups
    follow `Muon`; AdamW groups follow torch.optim.AdamW (state: step, exp_avg, exp_avg_sq).
    An LR scheduler scales every group from its own initial lr, so one LambdaLR moves both
    learning rates by the same factor.
    Raises ValueError for a group without "use_muon" or a Muon group holding a 1-D parameter.
    """

    def __init__(self, param_groups: Iterable[dict], *, lr: float = 1e-4, muon_lr: float = 0.02,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5):
        # Set before super().__init__, which calls add_param_group for every group.
        self._kind_defaults = {
            True: dict(lr=muon_lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                       weight_decay=weight_decay),
            False: dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
        }
        super().__init__(list(param_groups), defaults={})

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError("every MuonWithAdamW parameter group needs a 'use_muon' flag")
        param_group = dict(param_group, params=_as_param_list(param_group["params"]))
        use_muon = bool(param_group["use_muon"])
        param_group["use_muon"] = use_muon
        for key, value in self._kind_defaults[use_muon].items():
            param_group.setdefault(key, value)
        if use_muon:
            _check_muon_params(param_group["params"])
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter with a gradient; returns closure() when one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                _muon_group_step(self.state, group)
            else:
                _adamw_group_step(self.state, group)
        return loss


# ---------------------------------------------------------------------------------------------
# Parameter split (docs/algorithms.md, "Parameter split") and construction
# ---------------------------------------------------------------------------------------------

def is_muon_parameter(name: str, param: torch.Tensor,
                      excluded: tuple[str, ...] = MUON_EXCLUDED_NAME_PARTS) -> bool:
    """Whether Muon trains the parameter `name` (a dotted name from model.named_parameters()).

    True exactly when the parameter is 2-D, one of its enclosing modules is named `blocks`
    (wrappers such as `_orig_mod.` or `_checkpoint_wrapped_module.` do not matter), and its
    name, lower-cased, contains none of `excluded` (the family's muon_excluded_name_parts).
    Everything else (embedders, the output head, norms, biases, modulation) belongs to AdamW.
    """
    if param.ndim != 2:
        return False
    if "blocks" not in name.split(".")[:-1]:
        return False
    lowered = name.lower()
    return not any(part in lowered for part in excluded)


def split_parameters(model: nn.Module, excluded: tuple[str, ...] = MUON_EXCLUDED_NAME_PARTS
                     ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split the trainable parameters of `model` into (muon_params, adamw_params).

    Each parameter with requires_grad lands in exactly one list (shared parameters once),
    decided by `is_muon_parameter` with `excluded`; frozen parameters are in neither. Order
    follows model.named_parameters().
    """
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (muon if is_muon_parameter(name, param, excluded) else adamw).append(param)
    return muon, adamw


def build_optimizer(
    model: nn.Module,
    *,
    use_muon: bool = False,
    learning_rate: float,
    muon_learning_rate: float = 0.02,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    muon_excluded: tuple[str, ...] = MUON_EXCLUDED_NAME_PARTS,
) -> torch.optim.Optimizer:
    """Build the one optimizer of a model's trainable parameters.

    use_muon False: torch.optim.AdamW over everything, fused when every parameter is on a GPU
    (one kernel for all weights). True: MuonWithAdamW with a Muon group (the `split_parameters`
    matrices, lr = muon_learning_rate) and an AdamW group (the rest, lr = learning_rate);
    weight decay applies to both groups.
    Raises ValueError when the model has no trainable parameter, or use_muon is set but no
    parameter qualifies for Muon (the option would silently do nothing).
    """
    muon_params, adamw_params = split_parameters(model, muon_excluded)
    if not muon_params and not adamw_params:
        raise ValueError("the model has no trainable parameters")
    if not use_muon:
        params = muon_params + adamw_params
        return torch.optim.AdamW(params, lr=learning_rate, betas=betas, eps=eps,
                                 weight_decay=weight_decay, fused=_on_cuda(params) or None)
    if not muon_params:
        raise ValueError(
            "use_muon is set but no parameter qualifies for Muon (2-D weights under a module "
            "named `blocks`, not norm/modulation/embedding); turn use_muon off")
    groups = [{"params": muon_params, "use_muon": True}]
    if adamw_params:
        groups.append({"params": adamw_params, "use_muon": False})
    return MuonWithAdamW(groups, lr=learning_rate, muon_lr=muon_learning_rate, betas=betas,
                         eps=eps, weight_decay=weight_decay)


# ---------------------------------------------------------------------------------------------
# LR schedule
# ---------------------------------------------------------------------------------------------

def _resolve_decay_steps(lr_scheduler_type: str, warmup_steps: int, max_steps: int,
                         lr_decay_steps: int | None, lr_decay_floor_ratio: float) -> int:
    if lr_scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(f"unknown lr_scheduler_type {lr_scheduler_type!r}; valid: "
                         f"{', '.join(LR_SCHEDULER_TYPES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= lr_decay_floor_ratio <= 1.0:
        raise ValueError(f"lr_decay_floor_ratio must lie in [0, 1], got {lr_decay_floor_ratio}")
    # A run shortened below its warm-up (a smoke test with --max_steps 20) still gets a valid
    # schedule: warm-up is cut by the end of the run and decay has one nominal step.
    decay_steps = max(1, max_steps - warmup_steps) if lr_decay_steps is None else lr_decay_steps
    if lr_scheduler_type != "constant" and decay_steps < 1:
        raise ValueError(
            f"a {lr_scheduler_type} schedule needs at least one decay step; got "
            f"{decay_steps} (lr_decay_steps={lr_decay_steps}, max_steps={max_steps}, "
            f"warmup_steps={warmup_steps}). Lower warmup_steps or set lr_decay_steps.")
    return decay_steps


def lr_multiplier(step: int, *, lr_scheduler_type: str, warmup_steps: int, max_steps: int,
                  lr_decay_steps: int | None = None, lr_decay_floor_ratio: float = 0.0) -> float:
    """Factor on the peak learning rate for the optimizer step `step` (0-based).

    Warm-up: (step + 1) / warmup_steps for step < warmup_steps (the first step is not wasted on
    lr 0; the last warm-up step reaches 1). Then, with p = (step - warmup_steps) / decay_steps
    clipped to [0, 1] and floor f = lr_decay_floor_ratio: constant 1; linear 1 - p (1 - f);
    cosine f + (1 - f)(1 + cos(pi p)) / 2. After decay_steps the factor stays at f.
    decay_steps = lr_decay_steps, or max_steps - warmup_steps when that is None.
    Raises ValueError for an unknown type, negative warm-up, a floor outside [0, 1] or a
    decaying schedule with fewer than one decay step.
    """
    decay_steps = _resolve_decay_steps(lr_scheduler_type, warmup_steps, max_steps,
                                       lr_decay_steps, lr_decay_floor_ratio)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_scheduler_type == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    floor = lr_decay_floor_ratio
    if lr_scheduler_type == "linear":
        return 1.0 - progress * (1.0 - floor)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, lr_scheduler_type: str,
                       warmup_steps: int, max_steps: int, lr_decay_steps: int | None = None,
                       lr_decay_floor_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Return a LambdaLR that scales every group's initial lr by `lr_multiplier(step, ...)`.

    Call scheduler.step() after each optimizer step. Resume through `resume_lr_scheduler`: the
    step count comes from the checkpoint, the schedule (its shape from these arguments, its peak
    LRs from the optimizer's groups as built) from the current config.
    Raises ValueError as `lr_multiplier` does (checked here, before training starts).
    """
    _resolve_decay_steps(lr_scheduler_type, warmup_steps, max_steps, lr_decay_steps,
                         lr_decay_floor_ratio)
    fn = functools.partial(lr_multiplier, lr_scheduler_type=lr_scheduler_type,
                           warmup_steps=warmup_steps, max_steps=max_steps,
                           lr_decay_steps=lr_decay_steps,
                           lr_decay_floor_ratio=lr_decay_floor_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def resume_lr_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR,
                        state: dict) -> list[tuple[float, float]]:
    """Load a saved step count into `scheduler`, keeping this run's peak LRs.

    A LambdaLR's state_dict also holds the peak LRs (`base_lrs`) it was built with, and the
    optimizer's saved param groups their last LRs: loaded as they are, a `--learning_rate` given
    on a restart would be silently ignored. Call after the optimizer's state is loaded; every
    group's LR is set to this run's peak times the schedule at the saved step, which is exactly
    the saved LR when nothing changed. Returns (saved peak, current peak) of the groups whose
    peak changed, for the caller to log.
    """
    peaks = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    changed = [(float(old), float(new)) for old, new in zip(scheduler.base_lrs, peaks)
               if old != new]
    scheduler.base_lrs = peaks
    step = scheduler.last_epoch
    for group, peak, factor in zip(scheduler.optimizer.param_groups, peaks, scheduler.lr_lambdas):
        group["initial_lr"] = peak
        group["lr"] = peak * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return changed
