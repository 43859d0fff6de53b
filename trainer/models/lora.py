"""LoRA adapters on a family's module through peft: apply, load, read out and merge.

A LoRA run (`lora_rank` > 0, docs/lora.md) builds the family's module, loads the frozen base
into it (`pretrained_transformer_path`, through the warm-start reader), then peft's
`inject_adapter_in_model` replaces each target nn.Linear by a peft LoRA layer holding the
original as `base_layer` and the adapters `lora_A` [r, in] and `lora_B` [out, r] (B = 0 at
the start, so the model starts as the base). Every parameter but the adapters is frozen: no
gradient, no optimizer state, no EMA, nothing in a checkpoint. This happens before activation
checkpointing, compile and FSDP2, so the adapters are ordinary parameters of their block:
FSDP2 shards them with it, Muon takes their matrices (trainer.optim.optimizers). Reading the
base and the adapters from checkpoints and exports is trainer.checkpoint.lora_weights'.

Key names: in the module, `blocks.0.attn1.to_q.lora_A.default.weight` (peft's adapter name
`default`); exported and read back, peft's and diffusers' `blocks.0.attn1.to_q.lora_A.weight`
(`adapter_key`). The targets are matched by trainer.models.lora_targets.
"""

from __future__ import annotations

import logging
import torch
from torch import nn

from trainer.models.lora_targets import (lora_alpha, lora_enabled, match_targets,
                                         target_entries)
from trainer.models.registry import family_of

log = logging.getLogger("relay")

ADAPTER_NAME = "default"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# diffusers keeps a pipeline component's LoRA keys under its name (load_lora_weights).
DIFFUSERS_PREFIX = "transformer."

__all__ = ["lora_enabled", "apply_lora", "lora_config", "adapter_key", "module_key",
           "is_adapter_key", "adapter_state_dict", "load_adapter", "merge_adapter",
           "target_names", "base_state_dict"]


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_key(key: str) -> str:
    """A module key (`x.lora_A.default.weight`) as peft and diffusers write it (`x.lora_A.weight`)."""
    for part in ("lora_A", "lora_B"):
        key = key.replace(f".{part}.{ADAPTER_NAME}.", f".{part}.")
    return key


def module_key(key: str) -> str:
    """The module key of an exported adapter key (the inverse of `adapter_key`)."""
    for part in ("lora_A", "lora_B"):
        key = key.replace(f".{part}.", f".{part}.{ADAPTER_NAME}.")
    return key


def target_names(model: nn.Module, args) -> list[str]:
    """The module names of `model` that the run's lora_target_modules (or the family's
    default) select. Raises ValueError when there are none to use or an entry selects no
    linear layer."""
    family = family_of(args)
    entries = target_entries(args, family)
    if not entries:
        raise ValueError(f"model family {family.name!r} names no default LoRA targets: set "
                         f"lora_target_modules (module names such as to_q, or patterns)")
    names = [name for name, _ in model.named_modules()]
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return match_targets(linear, entries, names)


def lora_config(args, targets: list[str]):
    """peft's LoraConfig of the run for the module names `targets`."""
    from peft import LoraConfig

    return LoraConfig(r=int(args["lora_rank"]), lora_alpha=lora_alpha(args),
                      lora_dropout=float(args.get("lora_dropout") or 0.0),
                      target_modules=list(targets), init_lora_weights=True, bias="none")


def apply_lora(model: nn.Module, args) -> nn.Module:
    """Put the run's adapters into `model` (in place, before checkpointing, compile and
    FSDP2) and freeze everything else; returns it. The adapters draw their initial A from
    torch's global generator, so every rank starts from the same ones."""
    from peft import inject_adapter_in_model

    targets = target_names(model, args)
    inject_adapter_in_model(lora_config(args, targets), model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d on %d linear layers: %d trained parameters of %d (%.3f%%)",
             args["lora_rank"], len(targets), trained, total, 100.0 * trained / total)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a parameter, gathered when it is an FSDP2 shard (a collective)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").clone()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of `model` under their exported keys (`adapter_key`), full CPU tensors."""
    return {adapter_key(name): _full(param) for name, param in model.named_parameters()
            if is_adapter_key(name)}


def load_adapter(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy exported-key adapters `state` into `model`'s (plain, not yet sharded) adapters.
    Strict: raises ValueError naming the keys missing, unexpected or of another shape (another
    rank or other targets)."""
    params = {adapter_key(name): param for name, param in model.named_parameters()
              if is_adapter_key(name)}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    shapes = [f"{key}: source {tuple(state[key].shape)}, model {tuple(params[key].shape)}"
              for key in sorted(set(params) & set(state))
              if tuple(state[key].shape) != tuple(params[key].shape)]
    if missing or unexpected or shapes:
        raise ValueError(
            f"the adapters of {source} do not fit this run's LoRA (lora_rank, "
            f"lora_target_modules): missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}, other shapes "
            f"{shapes[:4]}")
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(state[key].to(param.dtype))


def merge_adapter(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                  scale: float) -> dict[str, torch.Tensor]:
    """The base state dict with each adapted weight W replaced by W + scale x B A (computed in
    float32, stored in W's dtype). `base` has the module's plain keys (`x.weight`), `adapters`
    exported keys. Raises ValueError when an adapter's layer is not in `base`."""
    merged = dict(base)
    layers = sorted({key.rsplit(".lora_", 1)[0] for key in adapters})
    for layer in layers:
        weight_key = f"{layer}.weight"
        if weight_key not in base:
            raise ValueError(f"the adapter of {layer} has no base weight {weight_key}")
        a = adapters[f"{layer}.lora_A.weight"].float()
        b = adapters[f"{layer}.lora_B.weight"].float()
        weight = base[weight_key]
        merged[weight_key] = (weight.float() + scale * (b @ a)).to(weight.dtype)
    return merged


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA module under the plain module's keys (`x.base_layer.weight`
    -> `x.weight`), adapters left out: what the family's own state dict would be."""
    return {name.replace(".base_layer.", "."): _full(value)
            for name, value in model.state_dict().items() if not is_adapter_key(name)}
