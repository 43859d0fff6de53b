"""A LoRA run's weights on disk: the frozen base loaded into the module, the adapters read from
a `relay export --format peft` directory, a safetensors file or a LoRA run's checkpoint, and a
LoRA checkpoint rebuilt for sampling (its base checked against the bytes it trained on).

The adapters themselves (peft's layers, their keys, merging) are trainer.models.lora's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from trainer.checkpoint.lora_base import check_base, read_recorded_base
from trainer.checkpoint.warm_start import load_warm_start, read_weights
from trainer.checkpoint.weights_source import resolve_weights_source
from trainer.config.schema import ConfigError
from trainer.models.lora import (ADAPTER_FILE, DIFFUSERS_PREFIX, adapter_key, apply_lora,
                                 is_adapter_key, load_adapter)
from trainer.models.registry import family_of

log = logging.getLogger("relay")


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without diffusers' `transformer.` or peft's `base_model.model.` prefix."""
    for prefix in (DIFFUSERS_PREFIX, "base_model.model."):
        if state and all(key.startswith(prefix) for key in state):
            return {key[len(prefix):]: value for key, value in state.items()}
    return state


def read_adapter(path: str | Path, weights: str = "auto") -> dict[str, torch.Tensor]:
    """The adapters `path` holds, under exported keys: a `relay export --format peft`
    directory or its adapter_model.safetensors (diffusers' `transformer.` keys or bare ones),
    or a LoRA run's checkpoint-N/ or output_dir (its EMA adapters when `weights` is "auto"
    and it saved them, else the `weights` member). Raises ValueError when it holds none."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir() and (path / ADAPTER_FILE).is_file():
        path = path / ADAPTER_FILE
    if path.is_file() and path.suffix == ".safetensors":
        state = _strip_prefix(load_file(str(path), device="cpu"))
    else:
        chosen = weights
        if weights == "auto":
            try:
                source = resolve_weights_source(path, weights="ema")
            except Exception:  # no EMA member: the live adapters
                source = resolve_weights_source(path, weights="live")
        else:
            source = resolve_weights_source(path, weights=chosen)
        state = {adapter_key(key): value for key, value in read_weights(source).items()}
    adapters = {key: value for key, value in state.items() if is_adapter_key(key)}
    if not adapters:
        raise ValueError(f"{path} holds no LoRA adapters (no lora_A / lora_B keys)")
    return adapters


def load_base(model: nn.Module, args) -> dict:
    """Load the frozen base (pretrained_transformer_path) into the plain module, strictly, as a
    warm start does (trainer.checkpoint.warm_start); returns the load report."""
    report = load_warm_start(args["pretrained_transformer_path"], model,
                             weights=args["pretrained_weights"],
                             allow_missing=tuple(args["warm_start_allow_missing"]),
                             allow_unexpected=tuple(args["warm_start_allow_unexpected"]),
                             family=family_of(args))
    log.info("LoRA base: %d tensors from %s (frozen)", len(report["loaded"]), report["source"])
    return report


def prepare_lora(model: nn.Module, args) -> nn.Module:
    """A LoRA run's module: the frozen base loaded from pretrained_transformer_path (strict,
    as a warm start), the adapters applied, then started from lora_init_path when it is set.
    Returns `model`. Raises CheckpointError for a base that does not fit, ConfigError (one
    paragraph) for targets or init adapters that do not."""
    load_base(model, args)
    init = args.get("lora_init_path")
    try:
        apply_lora(model, args)
        if init:
            load_adapter(model, read_adapter(init), str(init))
            log.info("LoRA adapters start from %s", init)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{'lora_init_path: ' if init else ''}{exc}. See docs/lora.md.") from None
    return model


def checkpoint_adapters(checkpoint: str | Path, *, weights: str,
                        member: str | None = None) -> dict[str, torch.Tensor]:
    """The adapters a LoRA run's checkpoint saved (its `weights` member, or `member`), under
    exported keys. Raises CheckpointError when they cannot be read."""
    source = resolve_weights_source(checkpoint, weights=weights, member=member)
    return {adapter_key(key): value for key, value in read_weights(source).items()}


def load_lora_checkpoint(model: nn.Module, args, checkpoint: str | Path, *, weights: str,
                         member: str | None = None) -> nn.Module:
    """A LoRA checkpoint rebuilt for sampling: its base (refused, CheckpointError, when its
    bytes changed since the run trained on it: trainer.checkpoint.lora_base), its adapters
    applied and loaded from the checkpoint. Returns `model`."""
    checkpoint = Path(checkpoint)
    check_base(args["pretrained_transformer_path"], args["pretrained_weights"],
               read_recorded_base(checkpoint), checkpoint.name)
    load_base(model, args)
    apply_lora(model, args)
    load_adapter(model, checkpoint_adapters(checkpoint, weights=weights, member=member),
                 str(checkpoint))
    return model
