"""What a LoRA run (lora_rank > 0) requires of its arguments (no torch here), called from
trainer.checks.stage, so `--dry-run`, `relay resolve` and `relay submit` refuse it
before a job starts. docs/lora.md, "What relay refuses".
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from trainer.config.schema import ConfigError, ResolvedArgs
from trainer.models.lora_targets import (adapter_param_count, lora_enabled, match_targets,
                                         target_entries)
from trainer.models.registry import family_of, model_config
from trainer.stages.registry import builtin_stages, stage_of


def validate_lora(args: ResolvedArgs) -> None:
    """Raise ConfigError, in one paragraph, for LoRA settings a run cannot use."""
    if not lora_enabled(args):
        _refuse_ignored_keys(args)
        return
    if args.lora_rank < 0:
        raise ConfigError(f"`lora_rank` must be >= 0 (0: no LoRA), got {args.lora_rank}.")
    problems = []
    refusal = stage_of(args).lora_refusal
    if refusal is not None:
        trained = " or ".join(d.name for d in builtin_stages() if d.lora_refusal is None)
        problems.append(f"stage {args.stage} does not train a LoRA: {refusal}; LoRA trains "
                        f"with stage {trained}")
    if not args.load_transformer_weights or args.pretrained_transformer_path is None:
        problems.append("a LoRA adapts frozen base weights, and none are named: set "
                        "load_transformer_weights: true and pretrained_transformer_path to "
                        "the base (a diffusers directory, a checkpoint or a state dict)")
    if args.lora_alpha is not None and not (args.lora_alpha > 0 and math.isfinite(args.lora_alpha)):
        problems.append(f"lora_alpha must be > 0 (or null for lora_rank), got {args.lora_alpha}")
    if not 0.0 <= args.lora_dropout < 1.0:
        problems.append(f"lora_dropout must lie in [0, 1), got {args.lora_dropout}")
    if importlib.util.find_spec("peft") is None:
        problems.append("the peft package is not installed (pip install peft, a dependency of "
                        "relay)")
    problems += _target_problems(args)
    if problems:
        raise ConfigError(f"this LoRA run (lora_rank {args.lora_rank}) cannot start: "
                          + "; ".join(problems) + ". See docs/lora.md.")


def _refuse_ignored_keys(args: ResolvedArgs) -> None:
    """LoRA keys set while lora_rank is 0 would silently do nothing."""
    set_keys = [key for key, unset in (("lora_alpha", None), ("lora_init_path", None))
                if args.get(key) is not unset]
    if args.get("lora_target_modules"):
        set_keys.append("lora_target_modules")
    if args.get("lora_dropout"):
        set_keys.append("lora_dropout")
    if set_keys:
        raise ConfigError(f"{', '.join(set_keys)} {'is' if len(set_keys) == 1 else 'are'} set "
                          f"but lora_rank is 0, so the run trains every weight and "
                          f"{'it would' if len(set_keys) == 1 else 'they would'} be ignored. Set "
                          f"lora_rank (e.g. 16) for a LoRA, or remove {', '.join(set_keys)}.")


def _target_problems(args: ResolvedArgs) -> list[str]:
    family = family_of(args)
    entries = target_entries(args, family)
    if not entries:
        return [f"model family {family.name!r} names no default LoRA targets: set "
                f"lora_target_modules (module names such as to_q, or fnmatch patterns)"]
    try:
        shapes = family.linear_shapes(model_config(args))
    except (ValueError, KeyError):
        return []  # the model config itself is refused by the model checks
    if shapes is None:
        return []  # the family lists no layers here: the targets are matched at build
    try:
        match_targets(shapes, entries)
    except ValueError as exc:
        return [str(exc)]
    return []


def adapter_params(args: ResolvedArgs) -> int | None:
    """Parameters of the run's adapters, or None when not a LoRA run or the family does not
    list its linear layers (the memory estimate then says so)."""
    if not lora_enabled(args):
        return None
    family = family_of(args)
    try:
        shapes = family.linear_shapes(model_config(args))
        if shapes is None:
            return None
        targets = match_targets(shapes, target_entries(args, family))
    except (ValueError, KeyError):
        return None
    return adapter_param_count(shapes, targets, int(args.lora_rank))


def lora_init_problem(args: ResolvedArgs) -> str | None:
    """lora_init_path names nothing on this machine (checked with the weights a run reads)."""
    path = args.get("lora_init_path") if lora_enabled(args) else None
    if path is not None and not Path(path).exists():
        return (f"`lora_init_path` {path} does not exist. Point it at a `relay export --format "
                f"peft` directory, its adapter_model.safetensors or a LoRA run's checkpoint, or "
                f"set lora_init_path: null for fresh adapters.")
    return None
