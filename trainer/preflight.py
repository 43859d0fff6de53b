"""Everything a run is checked for before it starts (no torch here).

`validate_args` runs in train.py (also for --dry-run), in `relay resolve` and in `relay submit`
on the login node, before any model, process group or Slurm job exists, so a job never fails
on the cluster for something that could have been said here. Stage-specific rules live in
trainer.stage_checks and are called from here only.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from trainer import stage_checks
from trainer.model_config import MODEL_CONFIG_DEFAULTS
from trainer.schema import ConfigError, ResolvedArgs, closest_key, model_config


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_args(args: ResolvedArgs, *, world_size: int | None = None,
                  check_paths: bool = True) -> None:
    """Reject contradictions before any model or process group exists. Raises ConfigError.

    world_size: the number of ranks the run will have (train.py passes WORLD_SIZE; the launcher
    passes nodes x gpus_per_node) so topology and batch arithmetic are checked early.
    """
    overrides = args.transformer_config_overrides
    _check(args.output_dir is not None,
           "`output_dir` is not set. Set it in the YAML's output section or with --output_dir.")
    _check("zero_init_modulation" not in overrides,
           "`zero_init_modulation` is repeated inside transformer_config_overrides. It is a "
           "top-level key only: move it out of the overrides.")
    if args.pretrained_transformer_path is not None and not args.load_transformer_weights:
        raise ConfigError(
            "`pretrained_transformer_path` is set but `load_transformer_weights` is false, so the "
            "path would be silently ignored. Set load_transformer_weights: true to warm start, or "
            "pretrained_transformer_path: null to train from scratch.")
    if args.load_transformer_weights and args.pretrained_transformer_path is None:
        raise ConfigError(
            "`load_transformer_weights` is true but `pretrained_transformer_path` is null. Name "
            "the checkpoint, state dict or output_dir to start from, or set "
            "load_transformer_weights: false.")
    for key in ("max_steps", "save_interval", "log_interval", "train_batch_size",
                "gradient_accumulation_steps", "cp_size", "text_max_tokens",
                "ema_update_every", "synthetic_num_samples", "synthetic_num_frames",
                "synthetic_height", "synthetic_width"):
        _check(args[key] >= 1, f"`{key}` must be at least 1, got {args[key]}.")
    for key in ("warmup_steps", "save_total_limit", "ema_start_step"):
        _check(args[key] >= 0, f"`{key}` must be >= 0, got {args[key]}.")
    for key in ("cfg_drop_prob", "image_cond_prob", "video_cond_prob", "lr_decay_floor_ratio",
                "flow_mix_uniform_ratio", "ema_decay"):
        _check(0.0 <= args[key] <= 1.0, f"`{key}` must lie in [0, 1], got {args[key]}.")
    _check(args.image_cond_prob + args.video_cond_prob <= 1.0,
           "`image_cond_prob` + `video_cond_prob` exceed 1. Lower one of them.")
    _check(args.learning_rate > 0, f"`learning_rate` must be > 0, got {args.learning_rate}.")
    _check(args.train_timestep_shift > 0,
           f"`train_timestep_shift` must be > 0, got {args.train_timestep_shift}.")
    _check(args.max_grad_norm >= 0, "`max_grad_norm` must be >= 0 (0 disables clipping).")
    if args.warmup_steps > args.max_steps:
        warnings.warn(f"`warmup_steps` ({args.warmup_steps}) exceeds `max_steps` "
                      f"({args.max_steps}): the run ends before the LR reaches its peak.")
    if args.lr_decay_steps is not None:
        _check(args.lr_decay_steps >= 1, "`lr_decay_steps` must be >= 1 or null.")
    _check(args.data_path is not None,
           "`data_path` is not set. Point it at a directory of parquet shards (or a mapping "
           "{directory: repeat_count}); with synthetic_data: true it is where the embedded data "
           "is generated and cached.")
    if isinstance(args.data_path, dict):
        _check(not args.synthetic_data,
               "`synthetic_data: true` needs `data_path` to be one directory, not a mapping.")
        for directory, repeat in args.data_path.items():
            _check(repeat >= 1, f"data_path: repeat count of {directory} must be >= 1, got {repeat}.")
    if check_paths:
        _validate_paths(args)
    _check(args.enable_gradient_checkpointing or not args.use_dedicated_gradient_checkpointing,
           "`use_dedicated_gradient_checkpointing` is true but `enable_gradient_checkpointing` "
           "is false, so it would be ignored. Set enable_gradient_checkpointing: true (it "
           "selects which activations the checkpointed blocks keep), or turn it off.")
    _validate_model_overrides(args)
    _validate_topology(args, world_size)
    stage_checks.validate_stage(args)
    if args.report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("`report_to: wandb` but the wandb package is not installed. "
                              "pip install wandb, or set report_to: none.") from None
    if args.cp_size > 1:
        _check(args.stage != "dmd_sgf",
               "cp_size > 1 with stage dmd_sgf: Stage2's KV-cached rollout does not run under "
               "Ulysses context parallel yet. Use cp_size: 1 for Stage2.")
        if args.stage == "tf_anyflow" and args.validation_interval >= 0:
            warnings.warn("cp_size > 1: Stage1's validation samples with the KV-cached rollout, "
                          "which does not run under cp; validation will fail (and be logged), "
                          "training goes on. Set validation_interval: -1.")


def _validate_paths(args: ResolvedArgs) -> None:
    if args.data_path is not None and not args.synthetic_data:
        dirs = [args.data_path] if isinstance(args.data_path, str) else list(args.data_path)
        for directory in dirs:
            _check(Path(directory).is_dir(),
                   f"data_path {directory} does not exist. Check the path, or generate the "
                   f"embedded data with synthetic_data: true.")
    # A warm-start path may be produced by an earlier stage of the same pipeline, so its
    # existence is checked at train time (and by `relay submit` only for stages run alone).


def _validate_model_overrides(args: ResolvedArgs) -> None:
    for key in args.transformer_config_overrides:
        if key not in MODEL_CONFIG_DEFAULTS:
            guess = closest_key(key, MODEL_CONFIG_DEFAULTS)
            hint = f" Did you mean `{guess}`?" if guess else ""
            raise ConfigError(
                f"transformer_config_overrides: unknown model argument `{key}`.{hint} Valid: "
                f"{', '.join(sorted(MODEL_CONFIG_DEFAULTS))}.")


def _validate_topology(args: ResolvedArgs, world_size: int | None) -> None:
    heads = model_config(args)["num_attention_heads"]
    _check(heads % args.cp_size == 0,
           f"num_attention_heads ({heads}) is not divisible by cp_size ({args.cp_size}). Ulysses "
           f"splits heads across the cp group: pick a cp_size that divides {heads}.")
    if args.cp_size > 1:
        video = _video_tokens(args, model_config(args))
        _check(video is None or video % args.cp_size == 0,
               f"cp_size {args.cp_size} does not divide the {video} video tokens of a sample: "
               f"Ulysses gives every cp rank the same number of tokens. Pick a cp_size that "
               f"divides {video}.")
    if world_size is None:
        return
    if args.hybrid_shard and args.shard_group_size is None:
        # The shard group is a node: the launcher (and train.py) know its ranks; the split is
        # checked with them in describe_plan.
        _check(world_size % args.cp_size == 0,
               f"world size {world_size} is not divisible by cp_size {args.cp_size}. Use a "
               f"cp_size that divides the number of GPUs (nodes x gpus_per_node).")
        dp = world_size // args.cp_size
    else:
        dp = _mesh(args, world_size, None).dp_world
    if args.global_batch_size is not None:
        got = args.train_batch_size * args.gradient_accumulation_steps * dp
        _check(got == args.global_batch_size,
               f"global_batch_size is {args.global_batch_size} but train_batch_size "
               f"({args.train_batch_size}) x gradient_accumulation_steps "
               f"({args.gradient_accumulation_steps}) x data-parallel size ({dp}) = {got}. Change "
               f"one of them so they agree.")
    if args.gpu_memory_gib is not None and not (args.hybrid_shard and args.shard_group_size is None):
        describe_plan(args, world_size, None)


def _mesh(args: ResolvedArgs, world_size: int, ranks_per_node: int | None):
    from trainer.topology import plan_mesh

    return plan_mesh(world_size, cp_size=args.cp_size, hybrid_shard=args.hybrid_shard,
                     shard_group_size=args.shard_group_size, ranks_per_node=ranks_per_node)


def describe_plan(args: ResolvedArgs, world_size: int, ranks_per_node: int | None) -> str:
    """The run's topology, global batch and memory per GPU, as printed by `relay submit` and
    `train.py --dry-run`. Raises ConfigError, with the arithmetic, when the split does not
    divide or the estimate exceeds gpu_memory_gib."""
    from trainer.memory_estimate import estimate_memory

    mesh = _mesh(args, world_size, ranks_per_node)
    accum = args.gradient_accumulation_steps
    global_batch = args.train_batch_size * accum * mesh.dp_world
    cfg = model_config(args)
    video = _video_tokens(args, cfg)
    estimate = estimate_memory(
        cfg, stage=args.stage, use_muon=args.use_muon, use_ema=args.use_ema,
        shard_group=mesh.shard_group, cp=mesh.cp, batch_per_rank=args.train_batch_size,
        video_tokens=video or 0, text_tokens=args.text_max_tokens,
        checkpointing=args.enable_gradient_checkpointing,
        selective=args.use_dedicated_gradient_checkpointing)
    lines = [f"topology: {mesh.describe()}",
             f"global batch: train_batch_size {args.train_batch_size} x gradient accumulation "
             f"{accum} x dp {mesh.dp_world} = {global_batch} samples a step",
             "memory per GPU (estimate, trainer.memory_estimate):", estimate.describe()]
    if video is None:
        lines.append("  (activations left out: the data's latent shape is not readable here)")
    text = "\n".join(lines)
    if args.gpu_memory_gib is not None and estimate.total_gib > args.gpu_memory_gib:
        raise ConfigError(
            f"stage {args.stage} does not fit the GPU: ~{estimate.total_gib:.1f} GiB per GPU "
            f"needed, gpu_memory_gib is {args.gpu_memory_gib:g}.\n{text}\nShard over more "
            f"ranks (hybrid_shard: false or a larger shard_group_size), turn on "
            f"enable_gradient_checkpointing, lower train_batch_size, or split the sequence "
            f"with cp_size.")
    return text


def _video_tokens(args: ResolvedArgs, cfg: dict) -> int | None:
    """Video tokens of one sample: from the synthetic settings, the first shard's latent shape
    or expected_latent_shape (None when none of them is known here)."""
    pt, ph, pw = cfg["patch_size"]
    if args.synthetic_data:
        shape = (cfg["in_channels"], args.synthetic_num_frames, args.synthetic_height,
                 args.synthetic_width)
    else:
        shape = _first_latent_shape(args.data_path)
    expected = args.expected_latent_shape
    if expected is not None:
        _check(len(expected) == 4, f"expected_latent_shape is {expected}; give [C, T, H, W].")
        _check(shape is None or tuple(expected) == tuple(shape),
               f"expected_latent_shape is {list(expected)} but the data's latents are "
               f"{list(shape or ())}. Fix it or remove it (it only feeds the memory estimate).")
        shape = tuple(expected)
    if shape is None:
        return None
    _, t, h, w = shape
    return (t // pt) * (h // ph) * (w // pw)


def _first_latent_shape(data_path) -> tuple[int, ...] | None:
    # pyarrow, not trainer.data (which needs torch): one row of one shard's shape column.
    import pyarrow.parquet as pq

    directory = data_path if isinstance(data_path, str) else next(iter(data_path), None)
    if directory is None or not Path(directory).is_dir():
        return None
    shard = next(iter(sorted(Path(directory).rglob("*.parquet"))), None)
    if shard is None:
        return None
    try:
        table = pq.ParquetFile(shard).read_row_group(0, columns=["vae_latent_shape"])
        return tuple(int(v) for v in table.column("vae_latent_shape")[0].as_py())
    except Exception:  # an unreadable shard is training's error to report, not the estimate's
        return None
