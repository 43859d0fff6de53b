"""relay's own stages, declared (no torch here): fm (flow matching: pretrain, SFT), tf_anyflow
(Stage1: causal teacher forcing + the AnyFlow flow-map loss) and dmd_sgf (Stage2: DMD via SGF).
Their torch halves are trainer/stages/fm.py, tf_anyflow.py and dmd_sgf.py (with rollout.py).
"""

from __future__ import annotations

import warnings
from typing import Any

from trainer.config.schema import ConfigError
from trainer.diffusion.timesteps import NUM_TRAIN_TIMESTEPS
from trainer.stages.declaration import MemoryRole, SamplingPlan, StageDeclaration, WeightKey

DMD_ROLES = ("student", "teacher", "critic")


def teacher_guided(args) -> bool:
    """Whether Stage1 takes its fused guidance's direction from a frozen teacher."""
    return (args.get("anyflow_guidance_reference", "student") == "teacher"
            and args.get("anyflow_fuse_guidance_scale", 1.0) != 1.0)


class FlowMatching(StageDeclaration):
    """Pretrain / SFT: one transformer regressing the velocity at one noise level per sample."""

    name = "fm"
    builder = "trainer.stages.fm:build"
    warmup_loss = "trainer.stages.fm:warmup_loss"
    lora_refusal = None


class TFAnyFlow(StageDeclaration):
    """Stage1: a causal two-time model trained by teacher forcing on the flow-map loss."""

    name = "tf_anyflow"
    capabilities = ("per_frame_times", "teacher_forcing", "kv_cache", "two_time")
    builder = "trainer.stages.tf_anyflow:build"
    warmup_loss = "trainer.stages.tf_anyflow:warmup_loss"
    video_copies = 2
    timestep_range_refusal = ("Stage1 (tf_anyflow) draws a pair of times per sample for its "
                              "flow map")
    lora_refusal = ("Stage1 turns a bidirectional single-time model into a causal two-time one: "
                    "its second time input is a new module that must train in full, and the "
                    "causal attention changes what every weight sees, which a low-rank update "
                    "of a few layers does not cover")
    health_watches_samples = True

    def sampling(self, args) -> SamplingPlan:
        fused = args.anyflow_fuse_guidance_scale != 1.0
        return SamplingPlan("trainer.stages.tf_anyflow:sample_flowmap",
                            args.flowmap_sampling_steps,
                            1.0 if fused else args.validation_guidance,
                            args.train_timestep_shift)

    def memory_roles(self, use_ema: bool, args=None) -> tuple[MemoryRole, ...]:
        roles = (MemoryRole("transformer", True, use_ema),)
        if args is not None and teacher_guided(args):
            roles += (MemoryRole("teacher", False),)
        return roles

    def frozen_roles(self, args) -> dict[str, tuple[str, str, str]]:
        """The guidance teacher (the warm-start weights), loaded again from its source on resume."""
        if teacher_guided(args):
            return {"teacher": (args["pretrained_transformer_path"], args["pretrained_weights"],
                                "pretrained_transformer_path")}
        return {}

    def null_caption_uses(self, args) -> list[str]:
        if args.get("anyflow_fuse_guidance_scale", 1.0) != 1.0:
            return [f"the guidance fused into Stage1's target (anyflow_fuse_guidance_scale "
                    f"{args.anyflow_fuse_guidance_scale}; 1 fuses none)"]
        return []

    def check(self, args, family, config: dict[str, Any]) -> None:
        """Refuses a model config that is not a causal two-time model whose gate equals
        anyflow_time_gate, or a Stage1 setting out of range. Warns when no EMA is kept
        (Stage2 starts from Stage1's EMA)."""
        geometry = family.geometry(config)
        if geometry.causal_chunk_frames is None:
            raise ConfigError(
                f"stage tf_anyflow trains a causal (teacher-forcing) model, but the model config "
                f"is bidirectional: {family.setting_hint('causal')} so relay sample/eval rebuild "
                f"the same causal model.")
        if not geometry.two_time:
            raise ConfigError(
                f"stage tf_anyflow trains a two-time model u(x, t, r), but the model config has "
                f"no second time input: {family.setting_hint('two_time')}. The warm start then "
                f"loads the FM weights and copies E_t into E_r.")
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
            raise ConfigError("`anyflow_diffusion_ratio` + `anyflow_consistency_ratio` exceed 1: "
                              "no room is left for flow-map samples. Lower one of them.")
        if not args.anyflow_epsilon > 0:
            raise ConfigError(f"`anyflow_epsilon` must be > 0 (raw timestep units), got "
                              f"{args.anyflow_epsilon}.")
        if not args.anyflow_fuse_guidance_scale > 0:
            raise ConfigError(f"`anyflow_fuse_guidance_scale` must be > 0 (the residual is "
                              f"divided by it; 1 = no fusion), got "
                              f"{args.anyflow_fuse_guidance_scale}.")
        if args.anyflow_guidance_reference == "teacher":
            if args.anyflow_fuse_guidance_scale == 1.0:
                raise ConfigError(
                    "anyflow_guidance_reference: teacher gives the direction of the guidance "
                    "fused into Stage1's target, and anyflow_fuse_guidance_scale is 1 (no "
                    "fusion), so it would do nothing. Set anyflow_fuse_guidance_scale to the "
                    "teacher's CFG (e.g. 4), or anyflow_guidance_reference: student.")
            if not args.load_transformer_weights or args.pretrained_transformer_path is None:
                raise ConfigError(
                    "anyflow_guidance_reference: teacher runs a frozen copy of the weights "
                    "Stage1 starts from, and none are named: set load_transformer_weights: "
                    "true and pretrained_transformer_path to the SFT output_dir.")
        if args.anyflow_teacher_context == "causal" and not teacher_guided(args):
            raise ConfigError(
                "anyflow_teacher_context: causal says what the guidance teacher sees, and this "
                "run has none (it needs anyflow_guidance_reference: teacher and "
                "anyflow_fuse_guidance_scale != 1). Set those, or set anyflow_teacher_context: "
                "clip (--anyflow_teacher_context clip where a config file sets causal).")
        if args.flowmap_sampling_steps < 1:
            raise ConfigError(f"`flowmap_sampling_steps` must be at least 1, got "
                              f"{args.flowmap_sampling_steps}.")
        if not args.use_ema:
            warnings.warn("stage tf_anyflow with use_ema: false. Stage2's student starts from "
                          "Stage1's EMA; set use_ema: true unless you know you want the live "
                          "weights.")


class DMDSGF(StageDeclaration):
    """Stage2: a causal student distilled against a frozen teacher and a trained critic."""

    name = "dmd_sgf"
    capabilities = ("per_frame_times", "teacher_forcing", "kv_cache")
    # The student's first: it is the run's own model.
    weight_keys = tuple(WeightKey(f"{role}_init_path", f"{role}_init_weights")
                        for role in DMD_ROLES)
    builder = "trainer.stages.dmd_sgf:build"
    warmup_loss = "trainer.stages.dmd_sgf:warmup_loss"
    inference_member = "student"
    video_copies = 2
    timestep_range_refusal = ("Stage2 (dmd_sgf) runs the student over its dmd_denoising_steps "
                              "and scores at times of its own")
    lora_refusal = ("Stage2 trains a student and a critic from different weights (its student_, "
                    "teacher_ and critic_init_path) while a LoRA run has one frozen base "
                    "(pretrained_transformer_path)")
    own_keys = tuple(f"{role}_init_path" for role in DMD_ROLES)
    health_watches_samples = True
    health_watches_critic = True

    def memory_roles(self, use_ema: bool, args=None) -> tuple[MemoryRole, ...]:
        return (MemoryRole("student", True, use_ema), MemoryRole("critic", True),
                MemoryRole("teacher", False))

    def sampling(self, args) -> SamplingPlan:
        # A student trained on an unwarped step list uses its steps as given (no shift).
        shift = args.train_timestep_shift if args.warp_denoising_step else 1.0
        return SamplingPlan("trainer.stages.rollout:sample_student",
                            len(args.dmd_denoising_steps), 1.0, shift)

    def null_caption_uses(self, args) -> list[str]:
        if args.get("real_guidance_scale", 0.0) != 0.0:
            return [f"the teacher's guidance (real_guidance_scale {args.real_guidance_scale}; "
                    f"0 scores with the unguided teacher)"]
        return []

    def frozen_roles(self, args) -> dict[str, tuple[str, str, str]]:
        """The teacher, unless save_frozen_teacher asks for it in every checkpoint."""
        if not args.get("save_frozen_teacher", False):
            return {"teacher": (args["teacher_init_path"], args["teacher_init_weights"],
                                "teacher_init_path")}
        return {}

    def check(self, args, family, config: dict[str, Any]) -> None:
        """Refuses a Stage2 configuration that cannot run, before any model exists."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        missing = [key for key in self.own_keys if args[key] is None]
        check(not missing, f"stage dmd_sgf needs {', '.join(missing)}: the student starts from "
              "a Stage1 output_dir (its EMA), the teacher and the critic from an SFT output_dir.")
        check(args.pretrained_transformer_path is None and not args.load_transformer_weights,
              "stage dmd_sgf does not read pretrained_transformer_path / "
              "load_transformer_weights: its three roles load from student_init_path, "
              "teacher_init_path and critic_init_path (with student_/teacher_/"
              "critic_init_weights). Remove the pretrained_transformer_path and "
              "load_transformer_weights keys.")
        geometry = family.geometry(config)
        check(geometry.causal_chunk_frames is not None,
              f"stage dmd_sgf trains a causal student: {family.setting_hint('causal')} (the "
              f"student's config; the teacher and critic use its bidirectional form).")
        check(not geometry.two_time,
              f"the Stage2 student is single-time: {family.setting_hint('single_time')} "
              f"(Stage1's second time input is dropped at load).")
        check(args.generator_update_interval >= 1,
              f"`generator_update_interval` must be >= 1, got {args.generator_update_interval}.")
        steps = list(args.dmd_denoising_steps)
        check(len(steps) >= 1 and all(0 < a <= NUM_TRAIN_TIMESTEPS for a in steps)
              and all(a > b for a, b in zip(steps, steps[1:])),
              f"`dmd_denoising_steps` must be raw timesteps in (0, {NUM_TRAIN_TIMESTEPS}], "
              f"strictly descending, e.g. [1000, 750, 500, 250]; got {steps}.")
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
              "stage dmd_sgf takes one micro-batch per update: set gradient_accumulation_steps: "
              "1 and raise train_batch_size instead.")
        check(args.video_cond_prob == 0.0,
              "stage dmd_sgf supports image conditioning (image_cond_prob: the first latent "
              "frame as a clean anchor) but not video_cond_prob; set video_cond_prob: 0.")
        if args.cfg_drop_prob > 0:
            warnings.warn("cfg_drop_prob has no effect in stage dmd_sgf: the student is trained "
                          "on its captions, the teacher's unconditional branch uses the null "
                          "caption. Set cfg_drop_prob: 0 to silence this.")
        if args.max_steps <= args.generator_update_interval:
            warnings.warn(f"max_steps ({args.max_steps}) <= generator_update_interval "
                          f"({args.generator_update_interval}): the student never updates.")


# The stages `stage:` names by their `name` (trainer.stages.registry).
BUILTIN: tuple[StageDeclaration, ...] = (FlowMatching(), TFAnyFlow(), DMDSGF())
