"""What a run's stage requires of its arguments and of the model family (no torch here), called
from trainer.preflight: the capabilities and checks the stage declares
(trainer.stages.declaration), plus what every stage needs for how the run batches and
conditions. A key only another stage reads is warned about.
"""

from __future__ import annotations

import warnings

from trainer.checks.lora import validate_lora
from trainer.config.schema import ConfigError, ResolvedArgs
from trainer.models.registry import family_of, model_config
from trainer.stages.registry import builtin_stages, stage_of


def null_caption_uses(args) -> list[str]:
    """What in the run's stage reads the empty caption's embedding (caption dropout, guidance),
    each with the setting that removes the need; [] when nothing does."""
    uses = []
    if args.get("cfg_drop_prob", 0) > 0:
        uses.append(f"caption dropout's empty caption (cfg_drop_prob {args.cfg_drop_prob}; 0 "
                    f"turns dropout off)")
    return uses + stage_of(args).null_caption_uses(args)


def validate_stage(args: ResolvedArgs) -> None:
    """Raise ConfigError when args.stage cannot run with these arguments (warn where harmless)."""
    declaration = stage_of(args)
    validate_lora(args)  # first: a stage a LoRA cannot train is refused for that reason
    family = family_of(args)
    _require_capabilities(family, args.stage, declaration.capabilities, _needs_of_the_data(args))
    declaration.check(args, family, model_config(args))
    _warn_other_stages_keys(args, declaration)


def _needs_of_the_data(args: ResolvedArgs) -> tuple[str, ...]:
    """Capabilities any stage needs for how these arguments batch and condition: packs (set, or
    derived from data of mixed shapes) need packed forwards; conditioning frames (kept clean at t = 0) need a time per frame;
    cp_size > 1 needs context parallel."""
    from trainer.data.checks import batching
    from trainer.models.registry import data_widths

    needs = ("packed",) if batching(args, data_widths(args)).budget is not None else ()
    if args.image_cond_prob > 0 or args.video_cond_prob > 0:
        needs += ("per_frame_times",)
    if args.cp_size > 1:
        needs += ("context_parallel",)
    return needs


def _require_capabilities(family, stage: str, capabilities: tuple[str, ...],
                          extra: tuple[str, ...] = ()) -> None:
    """Raise ConfigError naming what `family` lacks of what `stage` calls on its model (its
    declared `capabilities`, and `extra` for how the run batches and conditions)."""
    needed = dict.fromkeys((*capabilities, *extra))
    missing = family.missing_capabilities(needed)
    if missing:
        from trainer.models.family import CAPABILITIES

        raise ConfigError(
            f"stage {stage} needs what model family {family.name!r} cannot do: "
            f"{'; '.join(CAPABILITIES[c] for c in missing)}. Train this stage with a family "
            f"that has it (e.g. model_family: dit), or run a stage that does not need it.")


def _warn_other_stages_keys(args: ResolvedArgs, declaration) -> None:
    """Warn about keys only another of relay's stages reads, set for this one."""
    for other in builtin_stages():
        unused = [key for key in other.own_keys
                  if key not in declaration.own_keys and args[key] is not None]
        if unused and other is not declaration:
            warnings.warn(f"{', '.join(unused)} set but stage is {args.stage!r}: they have no "
                          f"effect outside stage {other.name}.")
