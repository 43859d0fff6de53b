"""Every argument of train.py, as plain data: name, type, default, help (no torch here).

The login node validates whole pipelines with this module and trainer.config.args, so neither may need
torch. `ResolvedArgs` is what parsing returns (the model's config comes from
trainer.models.registry.model_config). The reference in docs/config-reference.md is generated from SECTIONS:

    python -m trainer.config.schema --markdown > docs/config-reference.md
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import sys
from typing import Any



class ConfigError(Exception):
    """A configuration the run must not start with. The message says what and how to fix it."""


# ---------------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------------

# kind: the value type. "path" is a string that is made absolute; "dict" a mapping;
# "int_list"/"float_list"/"str_list" lists; "path_or_dict" is data_path's `dir` or
# `{dir: repeat_count}`.
KINDS = ("int", "float", "bool", "str", "path", "dict", "int_list", "float_list", "str_list",
         "path_or_dict")


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    kind: str
    default: Any
    help: str
    choices: tuple | None = None
    nullable: bool = False


SECTIONS: dict[str, list[Arg]] = {
    "model": [
        Arg("model_family", "str", "dit",
            "The model family (architecture) the run trains: `dit`, relay's own video DiT "
            "(docs/model.md), `wan` (docs/wan.md), or a family outside relay's package named "
            "by its class as `package.module:Class` (a trainer.models.family.ModelFamily "
            "subclass; the module is imported from the directory relay runs in or PYTHONPATH: "
            "docs/model.md, \"Adding a family\")."),
        Arg("transformer_config_overrides", "dict", {},
            "The complete transformer architecture: the model family's constructor arguments "
            "over its defaults (for `dit`: hidden_size, num_attention_heads, num_layers, "
            "mlp_ratio, rope_axes_dim, patch_size, in_channels, text_dim, qk_norm, "
            "causal_chunk_size, ...; docs/model.md). Nothing is read from a pretrained-model "
            "directory."),
        Arg("zero_init_modulation", "bool", True,
            "adaLN-Zero for a model built from scratch: its modulation (dit: every block's "
            "adaLN linear; wan: the time projection and every scale/shift/gate table) and its "
            "output head start at zero, so the new model outputs exactly zero and its gated "
            "branches open as it trains. Loaded weights replace it. Top-level only; never "
            "inside the overrides."),
        Arg("video_attention_sparsity", "float", 0.0,
            "Sparse video self-attention (docs/model.md, \"Sparse video attention\"): the "
            "fraction of video key tiles each query tile skips, in [0, 1). The video tokens are "
            "grouped into tiles of video_attention_tile latent tokens; each query tile attends "
            "to the key tiles of highest coarse score (mean q . mean k) and the rest are "
            "skipped. 0: dense attention, exactly the path without the option. Families with "
            "the `sparse_video_attention` capability (dit, wan); bidirectional forwards only "
            "(refused with teacher forcing / KV-cache stages, a causal model, packs and "
            "cp_size > 1). The weights stay those of a dense model."),
        Arg("video_attention_tile", "int_list", [2, 8, 8],
            "The sparse attention's tile [frames, rows, cols] in patch tokens of the latent "
            "grid (after patching); its volume is the block of tokens selected as a whole. "
            "FlashAttention 4's block-sparse kernel runs 128-token tiles (2x8x8, 1x8x16, ...); "
            "another volume runs on SDPA with a token mask."),
        Arg("video_attention_own_tile", "bool", False,
            "With video_attention_sparsity > 0: each query tile always attends its own key "
            "tile (a local window of one tile) and the highest-scoring others fill the rest of "
            "its kept tiles, so the sparsity and the cost stay the same."),
        Arg("video_attention_sparsity_warmup_steps", "int", 0,
            "Steps over which the sparsity ramps linearly from dense to "
            "video_attention_sparsity (target x min(1, step / warmup steps)); 0: the target "
            "from the first step."),
        Arg("pretrained_transformer_path", "path", None,
            "Warm start: a plain state dict (.pt, .safetensors, a directory holding "
            "model_state.pt), a checkpoint-N/ directory, its transformer/ DCP directory, an "
            "output_dir (its newest complete checkpoint), or a diffusers pipeline directory "
            "(model_family wan; its vae/, text_encoder/ + tokenizer/ and scheduler/ then give "
            "vae_path, text_encoder, text_max_tokens, train_timestep_shift and the validation "
            "sampler unless set: docs/wan.md). Used only while output_dir has no "
            "checkpoint of its own. Needs load_transformer_weights: true.", nullable=True),
        Arg("load_transformer_weights", "bool", False,
            "Load pretrained_transformer_path at start. false with a path set is rejected."),
        Arg("make_tiny_wan", "bool", False,
            "Write a tiny random Wan diffusers pipeline (trainer.models.wan.tiny) at "
            "pretrained_transformer_path when nothing is there yet, before the run reads it: "
            "a model to try the Wan path on a CPU (config/pipeline/wan-tiny.yaml). A path "
            "naming an expert folder (.../transformer, .../transformer_2) writes Wan2.2 A14B's "
            "layout in its parent instead: two experts and boundary_ratio 0.875 "
            "(config/pipeline/wan-a14b-tiny.yaml). model_family wan only."),
        Arg("pretrained_weights", "str", "live",
            "Which weights of a training checkpoint a warm start reads: the live weights or "
            "the EMA shadow.", choices=("live", "ema")),
        Arg("warm_start_allow_missing", "str_list", [],
            "fnmatch patterns of model keys the warm-start source may lack (keys a stage adds, "
            "e.g. the second time embedder a Stage1 model adds: its family's second_time_keys, "
            "'r_embedder.*' for dit). Anything else missing is an error."),
        Arg("warm_start_allow_unexpected", "str_list", [],
            "fnmatch patterns of source keys the model may drop (e.g. the family's second-time "
            "keys when a model without it loads Stage1 weights). Anything else unexpected is "
            "an error."),
        Arg("text_encoder", "str", "standin",
            "Text encoder for validation and sampling prompts, and for the captions of data "
            "that stores no caption embeddings: 'standin' (the deterministic seeded token "
            "table of the embedded data), or a local directory holding a transformers encoder "
            "and its tokenizer (UMT5, Qwen2-style; the encode extra)."),
        Arg("vae_path", "path", None,
            "A local directory holding a diffusers AutoencoderKLWan (config.json and weights, "
            "as save_pretrained writes them; the encode extra). Validation then decodes its "
            "sampled latents through it into mp4 clips. null: the identity VAE of the embedded "
            "data (latents are pixels).", nullable=True),
        Arg("text_max_tokens", "int", 8,
            "Caption length in tokens (padded and masked); also the length captions are "
            "encoded to when the data stores no caption embeddings."),
        Arg("allow_caption_truncation", "bool", False,
            "Train on captions longer than text_max_tokens cut to their first "
            "text_max_tokens tokens (stored embeddings in stacked batches; captions stored "
            "as text, which are encoded to text_max_tokens). false: such data is refused "
            "before the run starts, with the count and the longest caption."),
        Arg("text_encoder_hidden_state_skip_layer", "int", 0,
            "How many final layers of a real text encoder to drop: the caption embedding is "
            "the hidden state that many layers before the last. Encoding and inference must "
            "use the same value."),
    ],
    "lora": [
        Arg("lora_rank", "int", 0,
            "LoRA fine-tuning through peft (docs/lora.md): the rank r of the adapters; 0 trains "
            "every weight. With r > 0 the base (pretrained_transformer_path) is frozen and only "
            "the adapters train; checkpoints hold the adapters and a digest of the base."),
        Arg("lora_alpha", "float", None,
            "LoRA scale numerator: the adapter adds (lora_alpha / lora_rank) x B A x. null: "
            "lora_rank (a scale of 1).", nullable=True),
        Arg("lora_dropout", "float", 0.0,
            "Dropout on the adapters' input while training (0: none; > 0 makes the loss depend "
            "on the data-parallel split)."),
        Arg("lora_target_modules", "str_list", [],
            "The linear layers that get an adapter: a module name matches an entry equal to it "
            "or ending in '.<entry>' (to_q, attn1.to_out.0), or an fnmatch pattern of the whole "
            "name when the entry holds * ? or [ (blocks.*.ffn.net.2). []: the model family's "
            "default (wan: q/k/v/out of attn1 and attn2; dit: qkv and proj of every block)."),
        Arg("lora_init_path", "path", None,
            "Start the adapters from another LoRA: a `relay export --format peft` directory, "
            "its adapter_model.safetensors, or a LoRA run's checkpoint-N/ or output_dir (its EMA "
            "adapters when it saved them, else the live ones). Rank and targets must match. "
            "null: fresh adapters (B = 0, so the model starts as the base).", nullable=True),
    ],
    "training": [
        # The stages are declared in trainer.stages, whose registry imports this module, so the
        # schema cannot ask it: the default and the help name relay's own; preflight refuses a
        # stage the registry cannot find.
        Arg("stage", "str", "fm",
            "Training objective: fm = flow matching (pretrain, SFT); tf_anyflow = Stage1 causal "
            "teacher forcing + AnyFlow flow-map loss; dmd_sgf = Stage2 DMD via SGF (student, "
            "teacher, critic); or a stage outside relay's package named by its declaration as "
            "`package.module:Class` (or `package.module:NAME` of a declaration object; the "
            "module is imported from the directory relay runs in or PYTHONPATH: docs/layout.md, "
            "\"Adding a stage\")."),
        Arg("max_steps", "int", 1000, "Optimizer steps to train for."),
        Arg("learning_rate", "float", 1e-4, "Peak learning rate of AdamW."),
        Arg("weight_decay", "float", 0.0, "Decoupled weight decay (AdamW and Muon)."),
        Arg("adam_beta1", "float", 0.9, "AdamW beta1."),
        Arg("adam_beta2", "float", 0.95, "AdamW beta2."),
        Arg("adam_eps", "float", 1e-8, "AdamW epsilon."),
        Arg("use_muon", "bool", False,
            "Muon for the 2-D hidden matrices of the transformer blocks, AdamW for embeddings, "
            "norms, biases, modulation and the head."),
        Arg("muon_learning_rate", "float", 0.02,
            "Peak Muon learning rate (spectral-norm units, KellerJordan scaling)."),
        Arg("warmup_steps", "int", 0, "Linear warm-up steps from zero to the peak LR."),
        Arg("lr_scheduler_type", "str", "constant", "LR schedule after warm-up.",
            choices=("constant", "linear", "cosine")),
        Arg("lr_decay_steps", "int", None,
            "Steps of decay after warm-up (null: until max_steps).", nullable=True),
        Arg("lr_decay_floor_ratio", "float", 0.0,
            "The decayed LR never goes below this fraction of the peak."),
        Arg("max_grad_norm", "float", 1.0, "Gradient clipping norm (0 disables)."),
        Arg("gradient_accumulation_steps", "int", 1, "Micro-batches per optimizer step."),
        Arg("train_batch_size", "int", 8, "Micro-batch size per data-parallel rank."),
        Arg("global_batch_size", "int", None,
            "Optional check: must equal train_batch_size x gradient_accumulation_steps x "
            "data-parallel size (under packing_token_budget: packs, one a micro-batch).",
            nullable=True),
        Arg("seed", "int", 42, "Seed of the model init, the data order and the noise."),
        Arg("dtype", "str", "auto",
            "Compute dtype: auto = bf16 autocast on GPU, fp32 on CPU.",
            choices=("auto", "float32", "bfloat16")),
        Arg("deterministic", "bool", False,
            "torch deterministic algorithms (bit-identical resume on CPU; slower on GPU)."),
        Arg("compile_transformer", "bool", False,
            "torch.compile each transformer block (the kernel warm-up compiles the same graphs)."),
        Arg("legacy_eager_mode", "bool", True,
            "The seed trainer's execution-mode switch, accepted so its YAML loads: relay runs "
            "eager PyTorch (torch.compile per block with compile_transformer), never CUDA "
            "graphs, so true is the only mode and false is refused before the run starts."),
        Arg("use_ema", "bool", False, "Keep an fp32 EMA shadow of the trained weights."),
        Arg("ema_decay", "float", 0.999, "EMA decay d: ema <- d*ema + (1-d)*live."),
        Arg("ema_start_step", "int", 0, "Optimizer step at which the EMA starts (a copy)."),
        Arg("ema_update_every", "int", 1, "Update the EMA every N optimizer steps."),
    ],
    "diffusion": [
        Arg("flow_snr_type", "str", "lognorm", "Base sampler of the noise level sigma.",
            choices=("uniform", "lognorm", "mix", "mode")),
        Arg("flow_lognorm_loc", "float", 0.0, "Logit-normal location m."),
        Arg("flow_lognorm_scale", "float", 1.0, "Logit-normal scale s."),
        Arg("flow_mode_scale", "float", 1.29, "Scale c of the 'mode' sampler."),
        Arg("flow_mix_uniform_ratio", "float", 0.3,
            "Fraction of uniform draws in the 'mix' sampler."),
        Arg("train_timestep_shift", "float", 1.0,
            "Fixed shift s: sigma = s*u / (1 + (s-1)*u); s > 1 trains noisier."),
        Arg("train_timestep_range", "float_list", [0.0, 1.0],
            "[lo, hi], 0 <= lo < hi <= 1: flow matching (stage fm) trains only on noise levels "
            "sigma in [lo, hi], after the shift (timesteps 1000 lo to 1000 hi, the numbers "
            "WanPipeline compares with boundary_ratio x 1000): each base draw is mapped "
            "affinely into the range before the shift (docs/algorithms.md, 'An expert's "
            "range'). Unless set, a Wan2.2 A14B expert folder as pretrained_transformer_path "
            "sets it for stage fm: transformer/ (high noise) [boundary_ratio, 1], "
            "transformer_2/ (low noise) [0, boundary_ratio] (docs/wan.md). Stage1 and Stage2 "
            "draw their own times and refuse any value but [0, 1]."),
        Arg("train_timestep_shift_mode", "str", "fixed",
            "fixed: use train_timestep_shift; dynamic: s = exp(mu(video tokens)).",
            choices=("fixed", "dynamic")),
        Arg("dynamic_shift_base_tokens", "int", 256, "Dynamic shift: token count of base_shift."),
        Arg("dynamic_shift_max_tokens", "int", 4096, "Dynamic shift: token count of max_shift."),
        Arg("dynamic_shift_base", "float", 0.5, "Dynamic shift: mu at base tokens."),
        Arg("dynamic_shift_max", "float", 1.15, "Dynamic shift: mu at max tokens."),
        Arg("loss_weighting", "str", "none", "Per-sample loss weight w(sigma).",
            choices=("none", "gaussian", "beta08")),
    ],
    "data": [
        Arg("data_path", "path_or_dict", None,
            "A directory of parquet shards, or a mapping {directory: repeat_count}.",
            nullable=True),
        Arg("synthetic_data", "bool", False,
            "Generate the embedded moving-shapes dataset into data_path (cached; regenerated "
            "only when these settings change)."),
        Arg("synthetic_generator", "str", "shapes",
            "Which embedded dataset: shapes = one coloured shape moving (the tiny default); "
            "bench = the quality benchmark's scenes (six shapes, eight colours and directions, "
            "speeds, two objects; positional stand-in captions). It also picks the captions "
            "and pixel checker of validation and `relay eval`.", choices=("shapes", "bench")),
        Arg("synthetic_num_samples", "int", 2048, "Clips in the synthetic dataset."),
        Arg("synthetic_seed", "int", 0, "Seed of the synthetic dataset."),
        Arg("synthetic_num_frames", "int", 8, "Frames per synthetic clip."),
        Arg("synthetic_height", "int", 16, "Synthetic clip height in pixels."),
        Arg("synthetic_width", "int", 16, "Synthetic clip width in pixels."),
        Arg("packed_dataloader_num_workers", "int", 0,
            "Worker processes that read and decode batches (0: in the training process)."),
        Arg("packed_dataloader_prefetch_factor", "int", 2,
            "Batches each worker reads ahead; host memory holds about workers x this many."),
        Arg("packing_token_budget", "int", None,
            "Pack variable-shape samples into micro-batches of at most this many joint tokens "
            "(video tokens after patchify + caption tokens), instead of train_batch_size "
            "samples of one shape. null: no packing.", nullable=True),
        Arg("image_sample_prob", "float", None,
            "Draw each batch from the image samples (media_type image, or one latent frame) "
            "with this probability and from the videos otherwise, each stream with its own "
            "epochs and cursor. 0.0 leaves images out. null: one stream of everything.",
            nullable=True),
    ],
    "tasks": [
        Arg("cfg_drop_prob", "float", 0.1,
            "Probability of replacing a sample's caption with the null caption (for CFG)."),
        Arg("image_cond_prob", "float", 0.0,
            "Probability that a sample keeps its first latent frame clean (t = 0, no loss)."),
        Arg("video_cond_prob", "float", 0.0,
            "Probability that a sample keeps its first video_cond_frames frames clean."),
        Arg("video_cond_frames", "int", 2, "Clean leading frames of a video-conditioned sample."),
        Arg("conditioning_schema", "str_list", ["t2v", "i2v", "continuation"],
            "The conditioning tasks the data supports: t2v (caption only), i2v (first frame "
            "given; needed by image_cond_prob > 0), continuation (leading frames given; needed "
            "by video_cond_prob > 0)."),
    ],
    "distributed": [
        Arg("hybrid_shard", "bool", False,
            "FSDP2 hybrid shard (HSDP): shard parameters within a group of ranks (a node by "
            "default), replicate across groups. false: shard over every rank."),
        Arg("shard_group_size", "int", None,
            "With hybrid_shard: ranks per shard group (null: the ranks of one node). A "
            "multiple of cp_size that divides the world size.", nullable=True),
        Arg("cp_size", "int", 1,
            "Ulysses context-parallel degree: each sample's video tokens are split over cp "
            "consecutive ranks, which read one share of the data; the world splits as dp x cp. "
            "Must divide the world size, num_attention_heads and the tokens of a latent frame "
            "(docs/distributed.md)."),
        Arg("enable_gradient_checkpointing", "bool", False,
            "Recompute each transformer block's activations in the backward pass (less memory, "
            "about one more forward of compute)."),
        Arg("use_dedicated_gradient_checkpointing", "bool", False,
            "With enable_gradient_checkpointing: selective, per op: keep the attention outputs, "
            "recompute the rest (more memory than full checkpointing, less recompute)."),
        Arg("gpu_memory_gib", "float", None,
            "Memory of one GPU of the partition (H200: 141). When set, a stage whose estimated "
            "memory per GPU exceeds it is refused before it starts (trainer.checks.memory).",
            nullable=True),
        Arg("expected_latent_shape", "int_list", None,
            "[C, T, H, W] of a training latent, for the memory estimate where the data is not "
            "readable (a login node without the dataset); where it is, the two must agree.",
            nullable=True),
        Arg("dist_backend", "str", "auto", "Process-group backend (auto: nccl on GPU, else gloo).",
            choices=("auto", "nccl", "gloo")),
    ],
    "validation": [
        Arg("validation_interval", "int", 0,
            "Sample the fixed validation captions every N steps into samples/step-<N>/ and log "
            "their colour/direction accuracy (0: only at the end of the run; -1: never)."),
        Arg("validation_steps", "int", 30,
            "Sampling steps of validation (FM Euler steps; flow-map / rollout steps for the "
            "distilled stages use validation_sampling_steps of their own stage)."),
        Arg("validation_guidance", "float", 4.0,
            "CFG scale of validation samples, standard convention u + w (c - u) (1 = none)."),
        Arg("validation_num_captions", "int", 16,
            "How many of the fixed evaluation captions validation samples."),
        Arg("validation_seed", "int", 0, "Seed of validation noise."),
        Arg("validation_weights", "str", "both",
            "Which weights validation samples: live, ema, or both (ema only where EMA is on).",
            choices=("live", "ema", "both")),
    ],
    "stage1": [
        Arg("anyflow_epsilon", "float", 5.0,
            "Finite-difference half-width in raw timestep units (docs/algorithms.md, 'Flow-map loss')."),
        Arg("anyflow_diffusion_ratio", "float", 0.5,
            "Fraction of the global batch trained on the diagonal r = t (plain FM)."),
        Arg("anyflow_consistency_ratio", "float", 0.25,
            "Fraction of the global batch trained with r = 0 (the x0 map)."),
        Arg("anyflow_fuse_guidance_scale", "float", 1.0,
            "Guidance fused into the target, w: target = w v_c + (1 - w) u(t, t | null). "
            "1 = no fusion."),
        Arg("anyflow_guidance_reference", "str", "student",
            "What gives the fused guidance's direction: student (target = w v + (1 - w) "
            "u(t, t | null), the model's own null prediction; the data noise in the target "
            "grows w-fold) or teacher (target = v + (w - 1) (T(x_t | c) - T(x_t | null)) from "
            "a frozen bidirectional copy of the warm-start weights; the noise stays the "
            "data's). Needs anyflow_fuse_guidance_scale != 1.",
            choices=("student", "teacher")),
        Arg("anyflow_teacher_context", "str", "clip",
            "What the guidance teacher (anyflow_guidance_reference: teacher) sees of the clip: "
            "clip (the whole noisy clip, one call) or causal (per causal chunk, the chunks "
            "before it clean, as the student sees them in teacher forcing: one call a chunk).",
            choices=("clip", "causal")),
        Arg("anyflow_pair_sampler", "str", "v15",
            "(t, r) sampler: v15 (t ~ U, r = u2 t) or nvlabs (t = max, r = min of two uniforms).",
            choices=("v15", "nvlabs")),
        Arg("anyflow_time_gate", "float", 0.25,
            "Gate g of the two-time embedding e(t, r) = (1 - g) E_t(t) + g E_r(r)."),
        Arg("flowmap_sampling_steps", "int", 4,
            "Flow-map steps of Stage1 validation samples."),
    ],
    "stage2": [
        Arg("student_init_path", "path", None,
            "Stage2 student source (a Stage1 output_dir or checkpoint); its second time "
            "embedder E_r (the family's second_time_keys) is dropped.", nullable=True),
        Arg("student_init_weights", "str", "ema", "Student source weights.",
            choices=("live", "ema")),
        Arg("teacher_init_path", "path", None,
            "Stage2 frozen teacher (real score) source: an SFT output_dir or checkpoint.",
            nullable=True),
        Arg("teacher_init_weights", "str", "ema", "Teacher source weights.",
            choices=("live", "ema")),
        Arg("critic_init_path", "path", None,
            "Stage2 trainable critic (fake score) source; usually the same as the teacher.",
            nullable=True),
        Arg("critic_init_weights", "str", "ema", "Critic source weights.",
            choices=("live", "ema")),
        Arg("save_frozen_teacher", "bool", False,
            "Save the frozen teacher in every checkpoint. false: checkpoints hold the student, "
            "its EMA, the critic and the optimizers, and record the teacher's source by "
            "content digest (frozen-roles.json); a resume loads the teacher from "
            "teacher_init_path again and refuses one whose bytes changed. true: self-contained "
            "checkpoints, larger by the teacher (5.7 GB at Wan2.1-1.3B)."),
        Arg("critic_learning_rate", "float", 4e-4, "Critic AdamW learning rate."),
        Arg("critic_adam_beta1", "float", 0.0, "Critic AdamW beta1."),
        Arg("critic_adam_beta2", "float", 0.999, "Critic AdamW beta2."),
        Arg("generator_update_interval", "int", 5,
            "Student updates when step % N == 0 (step > 0); the critic updates every step."),
        Arg("rollout_mode", "str", "simulate",
            "simulate: the student rolls out from noise; data_latent: noise data latents to "
            "the exit step.", choices=("simulate", "data_latent")),
        Arg("dmd_denoising_steps", "int_list", [1000, 750, 500, 250],
            "Student rollout timesteps (raw units), warped onto the shifted grid when "
            "warp_denoising_step is true."),
        Arg("warp_denoising_step", "bool", True,
            "Warp dmd_denoising_steps onto the train_timestep_shift grid (docs/algorithms.md, 'Step list')."),
        Arg("real_guidance_scale", "float", 3.0,
            "Teacher CFG in the reference convention R_s(c, u) = c + s (c - u) (s = 3 is "
            "standard w = 4; 0 = conditional only)."),
        Arg("min_score_timestep_ratio", "float", 0.02,
            "Lower clamp of the teacher/critic score noise level."),
        Arg("max_score_timestep_ratio", "float", 0.98,
            "Upper clamp of the teacher/critic score noise level."),
        Arg("critic_max_grad_norm", "float", 1.0, "Critic gradient clipping (0 disables)."),
    ],
    "health": [
        Arg("health_gate", "bool", False,
            "Stop the run, after saving, when it degrades (trainer.runtime.health): validation "
            "mean_score too far below its best several validations in a row, (Stage1, Stage2) "
            "samples that stop moving or flood with one colour, or (Stage2) the critic's FM "
            "loss diverging from its starting value or collapsing toward 0. The reason goes into "
            "run-result.json (stop_reason) and `relay status`; the exit code is 1."),
        Arg("health_score_margin", "float", 0.15,
            "How far (absolute, scores in [0, 1]) validation mean_score may fall below its "
            "best before a validation counts as degraded."),
        Arg("health_score_patience", "int", 2,
            "Degraded validations in a row that stop the run."),
        Arg("health_critic_max_ratio", "float", 10.0,
            "Stage2: the critic's FM loss over its value at the start of Stage2 "
            "(critic_loss_rel) above which a step counts as diverging (0 turns this check off)."),
        Arg("health_critic_min_ratio", "float", 0.01,
            "Stage2: critic_loss_rel below which a step counts as the critic having nothing "
            "left to learn (the student's samples collapsed to something trivial; 0 turns "
            "this check off)."),
        Arg("health_critic_patience", "int", 5,
            "Stage2: diverging (or stalled) critic steps in a row that stop the run."),
        Arg("health_sample_min_ratio", "float", 0.2,
            "Stage1/Stage2: a validation counts as collapsed when its samples' motion (a static "
            "video) or contrast (a colour flood), read from the pixels on any data, falls below "
            "this fraction of the highest seen in the run; health_score_patience of them in a "
            "row stop the run (0 turns this check off)."),
    ],
    "output": [
        Arg("output_dir", "path", None,
            "Run directory: checkpoints, metrics, samples. A run resumes from its newest "
            "readable checkpoint here.", nullable=True),
        Arg("save_interval", "int", 500, "Save a checkpoint every N steps (and at the end)."),
        Arg("save_total_limit", "int", 3,
            "Keep at most N complete checkpoints (0 keeps all); the newest is never pruned."),
        Arg("log_interval", "int", 10, "Write a metrics.jsonl record every N steps."),
        Arg("report_to", "str", "none", "Experiment tracker.", choices=("none", "wandb")),
        Arg("wandb_project", "str", "relay", "W&B project (WANDB_API_KEY comes from the env)."),
        Arg("wandb_run_name", "str", None, "W&B run name (default: output_dir's name).",
            nullable=True),
        Arg("async_checkpoint", "bool", False,
            "Save checkpoints in the background (at most one in flight, finished before exit)."),
        Arg("resume_data_state", "bool", True,
            "Resume the data cursors with the checkpoint. false restarts the data stream (for a "
            "resume whose saved data position the new split cannot reach exactly; see "
            "docs/checkpoints.md)."),
        Arg("allow_data_change", "bool", False,
            "Resume even though the data changed since the checkpoint was saved (shards added, "
            "removed or rewritten: checkpoints record each shard's name, size and parquet footer "
            "digest). The data position is kept in the new data's order, and the log says where "
            "each stream continues. false refuses such a resume."),
        Arg("resume_video_csv", "bool", True,
            "false: resume everything but restart the video stream from the top, keeping the "
            "image stream's cursor (needs image_sample_prob, which splits the two streams)."),
        Arg("preemption_signal", "str", "SIGUSR2",
            "Signal that asks the run to save at the next step and exit for requeue (SIGTERM "
            "is always handled too).", choices=("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")),
    ],
}

# Old key names still accepted, translated with a warning.
LEGACY_KEYS: dict[str, str] = {
    "heads_num": "num_attention_heads",
    "mm_single_blocks_depth": "num_layers",
    "rope_dim_list": "rope_axes_dim",
    "hidden_dim": "hidden_size",
    "lr": "learning_rate",
    "batch_size": "train_batch_size",
}
# Legacy names that belong inside transformer_config_overrides rather than at the top level.
MODEL_KEYS_IN_OVERRIDES = {"num_attention_heads", "num_layers", "rope_axes_dim", "hidden_size"}

ARGS: dict[str, Arg] = {a.name: a for args in SECTIONS.values() for a in args}
SECTION_OF: dict[str, str] = {a.name: s for s, args in SECTIONS.items() for a in args}
SECRET_KEYS = ("WANDB_API_KEY",)


def closest_key(name: str, candidates) -> str | None:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return match[0] if match else None


class ResolvedArgs(dict):
    """The resolved arguments: a dict with attribute access (args.learning_rate)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_json(self) -> str:
        return json.dumps(self, indent=2, sort_keys=True)

    def digest(self) -> str:
        """A stable hash of the resolved arguments (stored in every checkpoint's COMPLETE)."""
        return hashlib.sha256(json.dumps(self, sort_keys=True).encode()).hexdigest()[:16]



# ---------------------------------------------------------------------------------------------
# The generated config reference
# ---------------------------------------------------------------------------------------------

def render_reference() -> str:
    """docs/config-reference.md, generated from the schema (a test fails when it is stale)."""
    lines = [
        "# Config reference",
        "",
        "Generated from `trainer/config/schema.py` by `python -m trainer.config.schema --markdown`; do not edit by hand.",
        "",
        "Precedence: parser default < YAML (`--config FILE`) < `--key value` on the command line.",
        "YAML sections are free-form and flattened: any section may hold any key, but a key may be",
        "set only once. Unknown keys, wrong types and contradictions are errors before anything",
        "starts. Lists and mappings on the command line use YAML syntax (`--patch_size [1,4,4]`),",
        "booleans are `true|false`, `null` clears a nullable key. `${oc.env:VAR}` (and",
        "`${oc.env:VAR,default}`) in a command-line value reads the environment as in the YAML; an",
        "unset variable without a default is an error.",
        "",
    ]
    for section, args in SECTIONS.items():
        lines += [f"## `{section}`", "", "| key | type | default | help |", "| --- | --- | --- | --- |"]
        for arg in args:
            kind = arg.kind + (" \\| null" if arg.nullable else "")
            if arg.choices:
                kind = " \\| ".join(arg.choices)
            default = json.dumps(arg.default)
            lines.append(f"| `{arg.name}` | {kind} | `{default}` | {arg.help.replace('|', '/')} |")
        lines.append("")
    lines += ["## Old key names", "", "| old | new |", "| --- | --- |"]
    lines += [f"| `{old}` | `{new}` |" for old, new in LEGACY_KEYS.items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(render_reference())
    else:
        sys.exit("usage: python -m trainer.config.schema --markdown")
