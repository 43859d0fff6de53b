"""What each stage requires of its arguments (no torch here), called from trainer.preflight.

Stage1 (tf_anyflow) needs a causal two-time model; Stage2 (dmd_sgf) three init paths and a
causal single-time student. Other stages are only warned about Stage2 keys that do nothing.
"""

from __future__ import annotations

import warnings

from trainer.diffusion.timesteps import NUM_TRAIN_TIMESTEPS
from trainer.config.lora_checks import validate_lora
from trainer.config.schema import ConfigError, ResolvedArgs
from trainer.models.registry import family_of, model_config


# What each stage calls on the model (trainer.models.family.CAPABILITIES): preflight refuses a
# model family that lacks one before a job starts.
STAGE_CAPABILITIES: dict[str, tuple[str, ...]] = {
    "fm": (),
    "tf_anyflow": ("per_frame_times", "teacher_forcing", "kv_cache", "two_time"),
    "dmd_sgf": ("per_frame_times", "teacher_forcing", "kv_cache"),
}


def null_caption_uses(args) -> list[str]:
    """What in the run's stage reads the empty caption's embedding (caption dropout, guidance),
    each with the setting that removes the need; [] when nothing does."""
    uses = []
    if args.get("cfg_drop_prob", 0) > 0:
        uses.append(f"caption dropout's empty caption (cfg_drop_prob {args.cfg_drop_prob}; 0 "
                    f"turns dropout off)")
    if args.get("stage") == "tf_anyflow" and args.get("anyflow_fuse_guidance_scale", 1.0) != 1.0:
        uses.append(f"the guidance fused into Stage1's target (anyflow_fuse_guidance_scale "
                    f"{args.anyflow_fuse_guidance_scale}; 1 fuses none)")
    if args.get("stage") == "dmd_sgf" and args.get("real_guidance_scale", 0.0) != 0.0:
        uses.append(f"the teacher's guidance (real_guidance_scale {args.real_guidance_scale}; 0 "
                    f"scores with the unguided teacher)")
    return uses


def validate_stage(args: ResolvedArgs) -> None:
    """Raise ConfigError when args.stage cannot run with these arguments (warn where harmless)."""
    validate_lora(args)  # first: a stage a LoRA cannot train is refused for that reason
    _require_capabilities(family_of(args), args.stage, _needs_of_the_data(args))
    _check_tf_anyflow(args)
    _check_dmd_sgf(args)


def _needs_of_the_data(args: ResolvedArgs) -> tuple[str, ...]:
    """Capabilities any stage needs for how these arguments batch and condition: packs (set, or
    derived from data of mixed shapes) need packed forwards; conditioning frames (kept clean at t = 0) need a time per frame;
    cp_size > 1 needs context parallel."""
    from trainer.data.checks import batching

    needs = ("packed",) if batching(args).budget is not None else ()
    if args.image_cond_prob > 0 or args.video_cond_prob > 0:
        needs += ("per_frame_times",)
    if args.cp_size > 1:
        needs += ("context_parallel",)
    return needs


def _require_capabilities(family, stage: str, extra: tuple[str, ...] = ()) -> None:
    """Raise ConfigError naming what `family` lacks of what `stage` calls on its model."""
    needed = dict.fromkeys((*STAGE_CAPABILITIES.get(stage, ()), *extra))
    missing = family.missing_capabilities(needed)
    if missing:
        from trainer.models.family import CAPABILITIES

        raise ConfigError(
            f"stage {stage} needs what model family {family.name!r} cannot do: "
            f"{'; '.join(CAPABILITIES[c] for c in missing)}. Train this stage with a family "
            f"that has it (e.g. model_family: dit), or run a stage that does not need it.")


def _check_tf_anyflow(args: ResolvedArgs) -> None:
    """Stage-specific checks for stage tf_anyflow (nothing for other stages).

    Raises ConfigError when the model config is not a causal two-time model whose
    gate equals anyflow_time_gate, or a Stage1 setting is out of range. Warns when no EMA is
    kept (Stage2 starts from Stage1's EMA).
    """
    if args.stage != "tf_anyflow":
        return
    family = family_of(args)
    geometry = family.geometry(model_config(args))
    if geometry.causal_chunk_frames is None:
        raise ConfigError(
            f"stage tf_anyflow trains a causal (teacher-forcing) model, but the model config is "
            f"bidirectional: {family.setting_hint('causal')} so relay sample/eval rebuild the "
            f"same causal model.")
    if not geometry.two_time:
        raise ConfigError(
            f"stage tf_anyflow trains a two-time model u(x, t, r), but the model config has no "
            f"second time input: {family.setting_hint('two_time')}. The warm start then loads "
            f"the FM weights and copies E_t into E_r.")
    if float(geometry.time_gate) != float(args.anyflow_time_gate):
        raise ConfigError(
            f"anyflow_time_gate is {args.anyflow_time_gate} but the model's time_gate is "
            f"{geometry.time_gate}. The model config is what relay sample rebuilds: "
            f"{family.setting_hint('time_gate')} to {args.anyflow_time_gate} (or change "
            f"anyflow_time_gate to match).")
    for key in ("anyflow_diffusion_ratio", "anyflow_consistency_ratio"):
        if not 0.0 <= args[key] <= 1.0:
            raise ConfigError(f"`{key}` must lie in [0, 1], got {args[key]}.")
    if args.anyflow_diffusion_ratio + args.anyflow_consistency_ratio > 1.0:
        raise ConfigError("`anyflow_diffusion_ratio` + `anyflow_consistency_ratio` exceed 1: no "
                          "room is left for flow-map samples. Lower one of them.")
    if not args.anyflow_epsilon > 0:
        raise ConfigError(f"`anyflow_epsilon` must be > 0 (raw timestep units), got "
                          f"{args.anyflow_epsilon}.")
    if not args.anyflow_fuse_guidance_scale > 0:
        raise ConfigError(f"`anyflow_fuse_guidance_scale` must be > 0 (the residual is divided "
                          f"by it; 1 = no fusion), got {args.anyflow_fuse_guidance_scale}.")
    if args.flowmap_sampling_steps < 1:
        raise ConfigError(f"`flowmap_sampling_steps` must be at least 1, got "
                          f"{args.flowmap_sampling_steps}.")
    if not args.use_ema:
        warnings.warn("stage tf_anyflow with use_ema: false. Stage2's student starts from "
                      "Stage1's EMA; set use_ema: true unless you know you want the live weights.")


def _check_dmd_sgf(args: ResolvedArgs) -> None:
    """Reject a Stage2 configuration that cannot run, before any model exists.

    For other stages only warns when Stage2 init paths are set (they would do nothing).
    Raises ConfigError saying what to change.
    """
    paths = ("student_init_path", "teacher_init_path", "critic_init_path")
    if args.stage != "dmd_sgf":
        unused = [key for key in paths if args[key] is not None]
        if unused:
            warnings.warn(f"{', '.join(unused)} set but stage is {args.stage!r}: they have no "
                          "effect outside stage dmd_sgf.")
        return

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    missing = [key for key in paths if args[key] is None]
    check(not missing, f"stage dmd_sgf needs {', '.join(missing)}: the student starts from a "
          "Stage1 output_dir (its EMA), the teacher and the critic from an SFT output_dir.")
    check(args.pretrained_transformer_path is None and not args.load_transformer_weights,
          "stage dmd_sgf does not read pretrained_transformer_path / load_transformer_weights: "
          "its three roles load from student_init_path, teacher_init_path and critic_init_path "
          "(with student_/teacher_/critic_init_weights). Remove the pretrained_transformer_path "
          "and load_transformer_weights keys.")
    family = family_of(args)
    geometry = family.geometry(model_config(args))
    check(geometry.causal_chunk_frames is not None,
          f"stage dmd_sgf trains a causal student: {family.setting_hint('causal')} (the "
          f"student's config; the teacher and critic use its bidirectional form).")
    check(not geometry.two_time,
          f"the Stage2 student is single-time: {family.setting_hint('single_time')} (Stage1's "
          f"second time input is dropped at load).")
    check(args.generator_update_interval >= 1,
          f"`generator_update_interval` must be >= 1, got {args.generator_update_interval}.")
    steps = list(args.dmd_denoising_steps)
    check(len(steps) >= 1 and all(0 < a <= NUM_TRAIN_TIMESTEPS for a in steps)
          and all(a > b for a, b in zip(steps, steps[1:])),
          f"`dmd_denoising_steps` must be raw timesteps in (0, {NUM_TRAIN_TIMESTEPS}], strictly descending, e.g. "
          f"[1000, 750, 500, 250]; got {steps}.")
    check(args.real_guidance_scale >= 0,
          f"`real_guidance_scale` (reference convention, 0 = conditional only) must be >= 0, "
          f"got {args.real_guidance_scale}.")
    lo, hi = args.min_score_timestep_ratio, args.max_score_timestep_ratio
    check(0.0 <= lo < hi <= 1.0,
          f"score timestep ratios need 0 <= min < max <= 1, got min {lo}, max {hi}.")
    check(args.critic_learning_rate > 0,
          f"`critic_learning_rate` must be > 0, got {args.critic_learning_rate}.")
    for key in ("critic_adam_beta1", "critic_adam_beta2"):
        check(0.0 <= args[key] < 1.0, f"`{key}` must lie in [0, 1), got {args[key]}.")
    check(args.critic_max_grad_norm >= 0, "`critic_max_grad_norm` must be >= 0 (0 disables).")
    check(args.gradient_accumulation_steps == 1,
          "stage dmd_sgf takes one micro-batch per update: set gradient_accumulation_steps: 1 "
          "and raise train_batch_size instead.")
    check(args.video_cond_prob == 0.0,
          "stage dmd_sgf supports image conditioning (image_cond_prob: the first latent frame "
          "as a clean anchor) but not video_cond_prob; set video_cond_prob: 0.")
    if args.cfg_drop_prob > 0:
        warnings.warn("cfg_drop_prob has no effect in stage dmd_sgf: the student is trained on "
                      "its captions, the teacher's unconditional branch uses the null caption. "
                      "Set cfg_drop_prob: 0 to silence this.")
    if args.max_steps <= args.generator_update_interval:
        warnings.warn(f"max_steps ({args.max_steps}) <= generator_update_interval "
                      f"({args.generator_update_interval}): the student never updates.")
