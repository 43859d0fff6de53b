"""Everything a run is checked for before it starts (no torch here).

`validate_args` runs in train.py (also for --dry-run), in `relay resolve` and in `relay submit`
on the login node, before any model, process group or Slurm job exists, so a job never fails
on the cluster for something that could have been said here. What a stage requires is what it
declares (trainer.stages.declaration, found by trainer.stages.registry), checked through
trainer.checks.stage.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path

from trainer.checks import stage as stage_checks
from trainer.checks.lora import adapter_params, lora_init_problem
from trainer.checks.sparse_attention import validate_sparse_attention
from trainer.checkpoint.saved_settings import saved_settings_problem
from trainer.models.lora_targets import lora_enabled
from trainer.checkpoint.frozen_roles import check_frozen_sources
from trainer.checkpoint.layout import CheckpointError, list_checkpoints
from trainer.config.schema import ARGS, ConfigError, ResolvedArgs
from trainer.data.synthetic_encoded import encoded_latent_shape
from trainer.diffusion.timesteps import NUM_TRAIN_TIMESTEPS
from trainer.encoders.directories import missing_component, pipeline_root, tiny_wan_pending
from trainer.models.family import ConfigDirError
from trainer.models.registry import family_of, model_config, model_config_file
from trainer.checkpoint.weights_source import (resolve_weights_source, stored_shapes,
                                               weights_fit_problem)
from trainer.stages.registry import builtin_stages, stage_of

# What example configs write where a user must put their own value.
PLACEHOLDER = re.compile(r"/path/to/|<[A-Za-z][A-Za-z0-9_ .-]*>|\bchangeme\b", re.IGNORECASE)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_args(args: ResolvedArgs, *, world_size: int | None = None,
                  check_paths: bool = True, check_weights: bool = False,
                  written_before: tuple[str, ...] = (),
                  pipeline_outputs: tuple[str, ...] | None = None) -> None:
    """Reject contradictions before any model or process group exists. Raises ConfigError.

    world_size: the number of ranks the run will have (train.py passes WORLD_SIZE; the launcher
    passes nodes x gpus_per_node) so topology and batch arithmetic are checked early.
    check_paths: the data, the output_dir and example placeholders are checked on this machine.
    check_weights: the weights a warm start would read exist (train.py and a stage run alone;
    a pipeline checks its own chain, where an earlier stage may still have to write them).
    written_before: diffusers pipeline directories an earlier stage of the same pipeline writes
    (make_tiny_wan) before this one starts: a vae_path or text_encoder inside one is checked
    when the stage starts, as the writing stage's own are.
    pipeline_outputs: the output_dirs of every stage of the pipeline being validated (relay
    submit / run): a path inside one is a stage's output, never a Hub id.
    """
    stage_of(args)  # a stage relay cannot find is refused before anything asks it
    if check_weights or pipeline_outputs is not None:
        # before anything that would read the missing directory's defaults
        _refuse_hub_ids(args, pipeline_outputs or ())
    _check(args.output_dir is not None,
           "`output_dir` is not set. Set it in the YAML's output section or with --output_dir.")
    _validate_model(args)
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
    _validate_timestep_range(args)
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
    _check(args.legacy_eager_mode,
           "`legacy_eager_mode: false` asks for the seed trainer's CUDA-graph mode, which relay does "
           "not have: relay runs eager PyTorch (with torch.compile per block when "
           "compile_transformer is set). Set legacy_eager_mode: true or remove the key.")
    _validate_data_keys(args)
    _validate_health_gate(args)
    _validate_validation_decoder(args)
    if check_paths:
        _validate_placeholders(args)
        _validate_paths(args, written_before)
        _validate_output_dir(args)
        _validate_resume_settings(args)
        _validate_transformer_weights(args, written_before)
    if check_weights:
        _validate_weight_sources(args)
    _check(args.enable_gradient_checkpointing or not args.use_dedicated_gradient_checkpointing,
           "`use_dedicated_gradient_checkpointing` is true but `enable_gradient_checkpointing` "
           "is false, so it would be ignored. Set enable_gradient_checkpointing: true (it "
           "selects which activations the checkpointed blocks keep), or turn it off.")
    _validate_topology(args, world_size)
    stage_checks.validate_stage(args)
    validate_sparse_attention(args)
    if args.report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("`report_to: wandb` but the wandb package is not installed. "
                              "pip install wandb, or set report_to: none.") from None


def _validate_timestep_range(args: ResolvedArgs) -> None:
    """train_timestep_range is [lo, hi] with 0 <= lo < hi <= 1, and only flow matching, whose
    one noise level per sample it restricts, is given one other than [0, 1]."""
    span = args.train_timestep_range
    _check(len(span) == 2 and 0.0 <= span[0] < span[1] <= 1.0,
           f"`train_timestep_range` must be [lo, hi] with 0 <= lo < hi <= 1 (fractions of the "
           f"train timesteps after the shift, e.g. [0.875, 1.0] for timesteps 875 to 1000), got "
           f"{list(span)}. Fix the value, or remove it to train on every timestep.")
    what = stage_of(args).timestep_range_refusal
    if what is not None and list(span) != [0.0, 1.0]:
        readers = " or ".join(d.name for d in builtin_stages() if d.timestep_range_refusal is None)
        raise ConfigError(
            f"`train_timestep_range` is {list(span)}, but it restricts flow matching's noise "
            f"levels (stage {readers}) only: {what}, and neither reads it. Remove it (or set it "
            f"to [0.0, 1.0]) for stage {args.stage}; to fine-tune one expert of a Wan2.2 A14B "
            f"directory on its timesteps, use stage {readers} (docs/wan.md).")


CONDITIONING_TASKS = ("t2v", "i2v", "continuation")


def _validate_health_gate(args: ResolvedArgs) -> None:
    _check(0.0 <= args.health_score_margin <= 1.0,
           f"`health_score_margin` must lie in [0, 1] (scores are fractions), got "
           f"{args.health_score_margin}.")
    for key in ("health_score_patience", "health_critic_patience"):
        _check(args[key] >= 1, f"`{key}` must be at least 1, got {args[key]}.")
    _check(args.health_critic_max_ratio == 0 or args.health_critic_max_ratio > 1,
           f"`health_critic_max_ratio` must be above 1 (a multiple of the critic's starting "
           f"loss) or 0 to turn the check off, got {args.health_critic_max_ratio}.")
    for key in ("health_critic_min_ratio", "health_sample_min_ratio"):
        _check(0 <= args[key] < 1,
               f"`{key}` must lie in [0, 1) (a fraction of a reference value; 0 turns the "
               f"check off), got {args[key]}.")
    if not args.health_gate:
        return
    critic_watched = stage_of(args).health_watches_critic and (
        args.health_critic_max_ratio > 0 or args.health_critic_min_ratio > 0)
    _check(args.validation_interval > 0 or critic_watched,
           f"`health_gate: true` has nothing to watch: validation runs only at the end "
           f"(validation_interval {args.validation_interval}), so the score gate never sees "
           f"{args.health_score_patience} validations in a row, and the critic check is "
           f"Stage2's. Set validation_interval to a number of steps, or health_gate: false.")
    if args.validation_interval <= 0:
        warnings.warn("`health_gate: true` with validation_interval <= 0 watches the critic "
                      "only: the score gate needs validations during the run.")


def _validate_data_keys(args: ResolvedArgs) -> None:
    _check(args.packed_dataloader_num_workers >= 0,
           f"`packed_dataloader_num_workers` must be >= 0 (0 reads in the training process), "
           f"got {args.packed_dataloader_num_workers}.")
    _check(args.packed_dataloader_prefetch_factor >= 1,
           f"`packed_dataloader_prefetch_factor` must be >= 1, got "
           f"{args.packed_dataloader_prefetch_factor}.")
    _check(args.text_encoder_hidden_state_skip_layer >= 0,
           "`text_encoder_hidden_state_skip_layer` must be >= 0 (0 takes the last layer).")
    if args.packing_token_budget is not None:
        _check(args.packing_token_budget >= 1,
               f"`packing_token_budget` must be >= 1 or null, got {args.packing_token_budget}.")
    if args.image_sample_prob is not None:
        _check(0.0 <= args.image_sample_prob <= 1.0,
               f"`image_sample_prob` must lie in [0, 1] or be null, got {args.image_sample_prob}.")
    unknown = [t for t in args.conditioning_schema if t not in CONDITIONING_TASKS]
    _check(not unknown, f"conditioning_schema: unknown task(s) {', '.join(unknown)}. Valid: "
                        f"{', '.join(CONDITIONING_TASKS)}.")
    for prob, task in (("image_cond_prob", "i2v"), ("video_cond_prob", "continuation")):
        _check(args[prob] == 0 or task in args.conditioning_schema,
               f"`{prob}` is {args[prob]} but conditioning_schema ({args.conditioning_schema}) "
               f"does not list {task}: the data does not support that task. Set {prob}: 0, or "
               f"add {task} to conditioning_schema if the data supports it.")
    if not args.resume_video_csv:
        if not args.resume_data_state:
            warnings.warn("`resume_video_csv: false` has no effect with `resume_data_state: "
                          "false`: every data stream restarts anyway.")
        elif args.image_sample_prob is None:
            warnings.warn("`resume_video_csv: false` has no effect without `image_sample_prob`: "
                          "images and videos are one stream, whose cursor is resumed.")


def _validate_text_encoder(args: ResolvedArgs) -> None:
    """'standin', or a transformers encoder directory whose width is the model's text_dim."""
    if args.text_encoder == "standin":
        return
    config = Path(args.text_encoder) / "config.json"
    _check(config.is_file(),
           f"`text_encoder` is {args.text_encoder!r}: neither 'standin' nor a directory holding a "
           f"transformers encoder (config.json). Point it at the encoder's local directory.")
    settings = _read_json("text_encoder", config)
    width = settings.get("hidden_size", settings.get("d_model"))
    text_dim = _geometry(args).text_dim
    _check(width == text_dim,
           f"`text_encoder` {args.text_encoder} gives {width}-wide embeddings but the model's "
           f"text_dim is {text_dim}. Set text_dim: {width} in transformer_config_overrides.")
    layers = settings.get("num_hidden_layers", settings.get("num_layers"))
    _check(layers is None or args.text_encoder_hidden_state_skip_layer < layers,
           f"`text_encoder_hidden_state_skip_layer` ({args.text_encoder_hidden_state_skip_layer}) "
           f"must be below the encoder's {layers} layers.")


def _read_json(key: str, path: Path) -> dict:
    """The JSON config a directory key points at; a ConfigError naming the key if unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"`{key}`: {path} is not readable JSON ({error}).") from None


def _validate_vae(args: ResolvedArgs) -> None:
    """vae_path, when set: a diffusers AutoencoderKLWan directory whose latents the model takes."""
    if args.vae_path is None:
        return
    directory = Path(args.vae_path)
    config = directory / "config.json"
    _check(config.is_file(),
           f"`vae_path` {directory} holds no config.json. Point it at a diffusers "
           f"AutoencoderKLWan directory as save_pretrained writes it (a Wan checkpoint's vae/).")
    settings = _read_json("vae_path", config)
    kind = settings.get("_class_name", "AutoencoderKLWan")
    _check(kind == "AutoencoderKLWan",
           f"`vae_path` {directory} holds a {kind}; validation decodes with an AutoencoderKLWan.")
    _check(any(directory.glob("*.safetensors")) or any(directory.glob("*.bin")),
           f"`vae_path` {directory} has a config.json but no weights (*.safetensors or *.bin).")
    channels = settings.get("z_dim")
    in_channels = _geometry(args).latent_channels
    _check(channels == in_channels,
           f"`vae_path` {directory} makes {channels}-channel latents but the model's in_channels "
           f"is {in_channels}: the VAE must be the one the data was encoded with.")
    for key in ("latents_mean", "latents_std"):
        _check(len(settings.get(key) or []) == channels,
               f"`vae_path` {config}: {key} needs {channels} values (one per latent channel), "
               f"got {settings.get(key)}.")


def _validate_validation_decoder(args: ResolvedArgs) -> None:
    """Validation decodes its samples through vae_path, or reads 3-channel latents as pixels
    (the identity VAE of the embedded data): other latents with no VAE cannot be decoded."""
    channels = _geometry(args).latent_channels
    _check(args.validation_interval < 0 or args.vae_path is not None or channels == 3,
           f"validation (validation_interval {args.validation_interval}: "
           f"{'at the end of the run' if args.validation_interval == 0 else 'every %d steps and at the end' % args.validation_interval}) "
           f"would decode {channels}-channel latents with no VAE: vae_path is null, and the "
           f"identity VAE reads only 3-channel latents as pixels. Set vae_path to the "
           f"AutoencoderKLWan directory the data was encoded with, or validation_interval: -1 "
           f"to train without validation.")


def _validate_caption_source(args: ResolvedArgs) -> None:
    """Data without caption embeddings needs a real text encoder to encode its captions."""
    from trainer.data.index import data_stores_text_embeddings

    try:
        stored = data_stores_text_embeddings(args.data_path)
    except Exception:  # noqa: BLE001 - unreadable data is training's error to report
        return
    _check(stored or args.text_encoder != "standin",
           f"the data in {args.data_path} stores captions but no caption embeddings "
           f"(text_embedding_*), and text_encoder is 'standin', the seeded stand-in of the "
           f"embedded data, which would train on random word vectors. Set text_encoder to the "
           f"directory of the encoder the captions are meant for (it encodes them as batches "
           f"are read), or store embeddings with `relay data encode`.")


def text_encoder_uses(args) -> list[str]:
    """What in the run encodes text, each with the setting that removes the need: validation
    prompts, captions stored without embeddings, the synthetic clips' captions, the empty
    caption of dropout and guidance; [] when nothing does."""
    uses = []
    if args.get("validation_interval", -1) >= 0:
        uses.append(f"validation prompts (validation_interval {args['validation_interval']}; -1 "
                    f"trains without validation)")
    if args.get("synthetic_data"):
        uses.append("the synthetic clips' captions (synthetic_data: true; point data_path at "
                    "encoded data instead)")
    elif args.get("data_path") is not None and not _data_stores_embeddings(args["data_path"]):
        uses.append("the data's captions, stored without embeddings (store them with relay "
                    "data encode)")
    return uses + stage_checks.null_caption_uses(args)


def _data_stores_embeddings(data_path) -> bool:
    """Whether the data stores caption embeddings; True when it cannot be read here (the data
    checks report unreadable data)."""
    from trainer.data.index import data_stores_text_embeddings

    try:
        return data_stores_text_embeddings(data_path)
    except Exception:  # noqa: BLE001 - reported by the data checks
        return True


def _validate_pipeline_components(args: ResolvedArgs, written_before: tuple[str, ...] = ()) -> bool:
    """The folders a diffusers pipeline directory (pretrained_transformer_path) gives the run
    by default are there (trainer.encoders.directories). Returns False while make_tiny_wan has
    yet to write the directory, this run's or (`written_before`) an earlier stage's that holds
    its vae_path or text_encoder: those folders are checked when the run starts."""
    if args.make_tiny_wan:
        _check(family_of(args).writes_tiny_pipeline and args.load_transformer_weights
               and args.pretrained_transformer_path is not None,
               "`make_tiny_wan: true` writes a tiny random Wan pipeline at "
               "pretrained_transformer_path and starts from it: it needs model_family: wan, "
               "load_transformer_weights: true and pretrained_transformer_path set (got "
               f"model_family {args.model_family}, load_transformer_weights "
               f"{args.load_transformer_weights}, pretrained_transformer_path "
               f"{args.pretrained_transformer_path}).")
    if tiny_wan_pending(args):
        return False
    for key in ("vae_path", "text_encoder"):
        value = args[key]
        if value is not None and value != "standin" and not Path(value).exists() and any(
                Path(value) == Path(d) or Path(d) in Path(value).parents for d in written_before):
            return False
    root = pipeline_root(args.pretrained_transformer_path) if args.load_transformer_weights else None
    if root is not None:
        for key in ("text_encoder", "vae_path"):
            if args[key] is not None and args[key] != "standin":
                uses = text_encoder_uses(args) if key == "text_encoder" else ()
                problem = missing_component(root, key, args[key], uses)
                _check(problem is None, problem or "")
    return True


def _validate_paths(args: ResolvedArgs, written_before: tuple[str, ...] = ()) -> None:
    if _validate_pipeline_components(args, written_before):
        _validate_text_encoder(args)
        _validate_vae(args)
    if args.synthetic_data and args.vae_path is not None:
        _check(args.text_encoder != "standin",
               f"`synthetic_data: true` with vae_path {args.vae_path} encodes the embedded clips "
               f"through that VAE and through text_encoder, but text_encoder is 'standin'. Set "
               f"text_encoder to the transformers encoder directory the model reads (a Wan "
               f"pipeline's text_encoder/), or vae_path: null for the pixel-space embedded data.")
    entries = args.data_path if isinstance(args.data_path, dict) else [args.data_path]
    written = any(Path(d) == Path(e) or Path(d) in Path(e).parents
                  for e in entries if e is not None for d in written_before)
    if args.data_path is not None and not args.synthetic_data and not written:
        # (data an earlier stage of the pipeline writes, an encode stage's, is checked when
        # this stage starts)
        from trainer.data.checks import check_data
        from trainer.models.registry import data_widths

        check_data(args, data_widths(args))  # footers, shapes, a sample of bytes: every problem in one ConfigError
        _validate_caption_source(args)
    # A warm-start path may be produced by an earlier stage of the same pipeline, so its
    # existence is checked at train time (and by `relay submit` only for stages run alone).


def _validate_model(args: ResolvedArgs) -> None:
    """The model family exists and its config (defaults < transformer_config_overrides) is one
    it can build; everything after this reads the config."""
    try:
        family = family_of(args)
    except ValueError as exc:
        raise ConfigError(f"{exc} Set model_family in the YAML's model section.") from None
    try:
        config = family.config(args.transformer_config_overrides, args)
    except ConfigDirError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(f"transformer_config_overrides: {exc}.") from None
    try:
        family.validate(config)  # the checks the model constructor would make
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"transformer_config_overrides cannot build a model (model_family "
                          f"{family.name}): {exc}. Fix the architecture in the YAML's model "
                          f"section.") from None


def _validate_placeholders(args: ResolvedArgs) -> None:
    """Refuse an example's placeholder (/path/to/..., <PATH_TO_X>, changeme) in a used field."""
    for key, value in args.items():
        arg = ARGS.get(key)
        if arg is None or arg.kind not in ("path", "str", "path_or_dict") or value is None:
            continue
        for text in ([value] if isinstance(value, str) else list(value)):
            if PLACEHOLDER.search(str(text)):
                raise ConfigError(
                    f"`{key}` still holds an example placeholder ({text}). Replace it with a real "
                    f"value before running (the example configs ship placeholders on purpose).")


def _validate_output_dir(args: ResolvedArgs) -> None:
    out = Path(args.output_dir)
    _check(not out.exists() or out.is_dir(),
           f"output_dir {out} exists and is not a directory. Point output_dir at a directory "
           f"(it is created if missing).")
    existing = out
    while not existing.exists():
        existing = existing.parent
    _check(_writable(existing),
           f"output_dir {out} cannot be written ({existing} is read-only or not writable by "
           f"this user): checkpoints, metrics and samples go there. Choose a writable directory.")


def _writable(directory: Path) -> bool:
    """Whether a file can be created in `directory`. Permission bits do not tell for root or
    for every read-only mount, so a probe file is created and removed at once."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".relay-write-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _validate_weight_sources(args: ResolvedArgs) -> None:
    """The weights a warm start reads must exist, unless the run resumes from its own checkpoint."""
    problem = lora_init_problem(args)
    if problem:
        raise ConfigError(problem)
    keys = stage_of(args).read_weight_keys(args)
    if not keys:
        return
    if tiny_wan_pending(args):
        return  # the run writes it (make_tiny_wan) before it reads it
    try:
        checkpoints = list_checkpoints(args.output_dir)
    except OSError:
        checkpoints = []
    if checkpoints:
        # it resumes: the warm-start sources are not read, but a frozen role the checkpoint left
        # out is (trainer.checkpoint.frozen_roles), and must hold the bytes it was saved with
        try:
            check_frozen_sources(args, checkpoints[-1], stage_of(args).frozen_roles(args))
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        return
    for weight_key in keys:
        key = weight_key.path
        if args[key] is None:
            continue
        try:
            resolve_weights_source(args[key], weights=args[weight_key.weights])
        except CheckpointError as exc:
            raise ConfigError(f"`{key}`: {exc}. The run would warm start from it; fix the path "
                              f"(or run the stage that writes it first).") from None


# A Hugging Face Hub repository id's parts (owner/name).
_HUB_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def _hub_id(value) -> str | None:
    """`value` read as a Hugging Face Hub id (owner/name) when it names nothing on this
    machine: a path made absolute against the current directory from two parts, neither of
    which exists there. None for anything else."""
    path = Path(value)
    if path.exists():
        return None
    try:
        here = Path.cwd()
        parts = path.relative_to(here).parts
    except (OSError, ValueError):
        return None
    if len(parts) != 2 or not all(_HUB_PART.match(part) for part in parts) \
            or (here / parts[0]).exists():
        return None
    return "/".join(parts)


def _refuse_hub_ids(args: ResolvedArgs, outputs: tuple[str, ...] = ()) -> None:
    """A warm-start path given as a Hub id (Wan-AI/Wan2.1-T2V-1.3B-Diffusers) is refused first,
    in one paragraph: relay downloads nothing, and every later check would read defaults in
    place of the missing directory's (vae_path, text_dim, ...)."""
    keys = [key.path for key in stage_of(args).weight_keys]
    if lora_enabled(args):
        keys.append("lora_init_path")
    for key in keys:
        value = args.get(key)
        if value is None or (key == "pretrained_transformer_path" and tiny_wan_pending(args)):
            continue
        if any(Path(value) == Path(d) or Path(d) in Path(value).parents for d in outputs):
            continue  # an output_dir of the pipeline, which its stage writes
        hub_id = _hub_id(value)
        if hub_id is not None:
            name = hub_id.split("/")[1]
            raise ConfigError(
                f"`{key}` {hub_id} reads as a Hugging Face Hub id, but it must be a local "
                f"directory: relay downloads nothing (compute nodes have no internet access), "
                f"and there is no {value} here. Download it once to shared storage, e.g. "
                f"`huggingface-cli download {hub_id} --local-dir <models>/{name}` (`hf "
                f"download` takes the same arguments), and set {key} to that directory.")


def _validate_resume_settings(args: ResolvedArgs) -> None:
    """A run that would resume output_dir's newest complete checkpoint with settings its saved
    state cannot load (another stage, optimizer, EMA, or LoRA adapters of another shape)."""
    try:
        checkpoints = list_checkpoints(args.output_dir)
    except OSError:
        return
    if checkpoints:
        problem = saved_settings_problem(args, checkpoints[-1])
        _check(problem is None, problem or "")


def _validate_transformer_weights(args: ResolvedArgs, written_before: tuple[str, ...] = ()) -> None:
    """The safetensors pretrained_transformer_path names, where they exist now, hold the
    model's linear layers with the model's shapes (headers only): a transformer/config.json
    that gives more layers than its weights hold, or other widths, stops the warm start when
    the job starts. A path an earlier stage writes, a relay checkpoint (DCP), or weights that a
    resume does not read are left alone; a path that does not resolve is
    _validate_weight_sources' (and relay submit's) to report."""
    path = args.pretrained_transformer_path
    if (not args.load_transformer_weights or path is None or tiny_wan_pending(args)
            or not Path(path).exists()
            or any(Path(path) == Path(d) or Path(d) in Path(path).parents for d in written_before)):
        return
    try:
        resuming = bool(list_checkpoints(args.output_dir))
    except OSError:
        resuming = False
    if resuming and not lora_enabled(args):
        return  # it resumes: the warm start is not read (a LoRA's base is, at every start)
    family = family_of(args)
    try:
        source = resolve_weights_source(path, weights=args.pretrained_weights)
        if source.kind not in ("safetensors", "safetensors_dir"):
            return
        stored, _ = stored_shapes(source, family)
        config = model_config(args)
        linears = family.linear_shapes(config)
    except (CheckpointError, ValueError, KeyError, OSError):
        return
    if not linears:
        return
    problem = weights_fit_problem(stored, linears, config, source.path, origin=_config_origin(args),
                                  allow_missing=(*args.warm_start_allow_missing,
                                                 *family.second_time_keys),
                                  allow_unexpected=(*args.warm_start_allow_unexpected,
                                                    *family.second_time_keys))
    _check(problem is None, f"`pretrained_transformer_path` {path}: {problem}")


def _config_origin(args: ResolvedArgs) -> str:
    try:
        file = model_config_file(args)
    except (ValueError, KeyError):
        file = None
    return str(file) if file else "transformer_config_overrides"


def _validate_context_parallel(args: ResolvedArgs) -> None:
    """What Ulysses needs of the model and the data (trainer.parallel.context_parallel): heads and the
    tokens of a latent frame split evenly over the cp group."""
    cp = args.cp_size
    heads = _geometry(args).num_heads
    _check(heads % cp == 0,
           f"the model's attention heads ({heads}) are not divisible by cp_size ({cp}): {heads} / {cp} = "
           f"{heads / cp:g}. Ulysses gives every cp rank the same number of heads: pick a cp_size "
           f"that divides {heads}.")
    grid = _patch_grid(args)
    if cp == 1 or grid is None or _packs(args):
        return  # a pack is padded to a multiple of cp_size by the model
    frames, rows, cols = grid
    _check(rows * cols % cp == 0,
           f"cp_size {cp} does not divide the tokens of one latent frame: {rows} x {cols} = "
           f"{rows * cols} patches a frame ({frames} frames, {frames * rows * cols} video tokens "
           f"a sample). Ulysses keeps each frame's tokens, which share a time, in equal shares "
           f"on the cp ranks: pick a cp_size that divides {rows * cols}, or a resolution or "
           f"patch size whose frames split.")


def _packs(args: ResolvedArgs) -> bool:
    """Batches are packs: packing_token_budget is set, or the data's mixed shapes derive one."""
    from trainer.data.checks import batching
    from trainer.models.registry import data_widths

    return batching(args, data_widths(args)).budget is not None


def _validate_topology(args: ResolvedArgs, world_size: int | None) -> None:
    _validate_context_parallel(args)
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
        # Under packing a micro-batch is one pack (train_batch_size is not used), so the
        # global batch counts packs.
        packed = args.packing_token_budget is not None
        per_micro = 1 if packed else args.train_batch_size
        what = "1 pack a micro-batch (packing_token_budget is set)" if packed \
            else f"train_batch_size ({args.train_batch_size})"
        got = per_micro * args.gradient_accumulation_steps * dp
        _check(got == args.global_batch_size,
               f"global_batch_size is {args.global_batch_size} but {what} x "
               f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) x "
               f"data-parallel size ({dp}) = {got}. Change one of them so they agree.")
    if args.gpu_memory_gib is not None and not (args.hybrid_shard and args.shard_group_size is None):
        describe_plan(args, world_size, None)


def _mesh(args: ResolvedArgs, world_size: int, ranks_per_node: int | None):
    from trainer.parallel.topology import plan_mesh

    return plan_mesh(world_size, cp_size=args.cp_size, hybrid_shard=args.hybrid_shard,
                     shard_group_size=args.shard_group_size, ranks_per_node=ranks_per_node)


def describe_plan(args: ResolvedArgs, world_size: int, ranks_per_node: int | None) -> str:
    """The run's topology, global batch and memory per GPU, as printed by `relay submit` and
    `train.py --dry-run`. Raises ConfigError, with the arithmetic, when the split does not
    divide or the estimate exceeds gpu_memory_gib."""
    from trainer.checks.memory import estimate_memory

    mesh = _mesh(args, world_size, ranks_per_node)
    accum = args.gradient_accumulation_steps
    from trainer.data.checks import batching as data_batching
    from trainer.models.registry import data_widths

    batching = data_batching(args, data_widths(args))  # stacked, packing_token_budget, or a budget from the data
    budget = batching.budget
    video = _video_tokens(args)
    estimate = estimate_memory(
        family_of(args), model_config(args), stage=args.stage, use_muon=args.use_muon, use_ema=args.use_ema,
        shard_group=mesh.shard_group, cp=mesh.cp, batch_per_rank=args.train_batch_size,
        video_tokens=video or 0, text_tokens=args.text_max_tokens,
        checkpointing=args.enable_gradient_checkpointing,
        selective=args.use_dedicated_gradient_checkpointing, pack_budget=budget,
        lora=lora_enabled(args), lora_params=adapter_params(args),
        gradient_accumulation_steps=accum, args=args)
    if budget is None:
        batch = (f"global batch: train_batch_size {args.train_batch_size} x gradient accumulation "
                 f"{accum} x dp {mesh.dp_world} = {args.train_batch_size * accum * mesh.dp_world} "
                 f"samples a step")
    else:  # trainer.data.order.BatchPlan: a micro-batch is one pack
        source = ("derived from the data" if batching.derived
                  else "packing_token_budget; train_batch_size is not used")
        batch = (f"global batch: 1 pack of <= {budget} joint tokens ({source}) x gradient "
                 f"accumulation {accum} x dp {mesh.dp_world} = {accum * mesh.dp_world} packs a step")
    lines = [f"topology: {mesh.describe()}", batch, batching.line]
    lo, hi = args.train_timestep_range
    if (lo, hi) != (0.0, 1.0):
        n = NUM_TRAIN_TIMESTEPS
        lines.append(f"timesteps: sigma in [{lo:g}, {hi:g}] after the shift (train_timestep_range: "
                     f"timesteps {lo * n:g} to {hi * n:g} of {n})")
    lines += ["memory per GPU (estimate, trainer.checks.memory):", estimate.describe()]
    if video is None and budget is None:
        lines.append("  (activations left out: the data's latent shape is not readable here)")
    text = "\n".join(lines)
    if args.gpu_memory_gib is not None and estimate.total_gib > args.gpu_memory_gib:
        fix = ("enable_gradient_checkpointing, lower train_batch_size" if budget is None
               else f"enable_gradient_checkpointing, {_budget_that_fits(args, estimate, budget)}")
        raise ConfigError(
            f"stage {args.stage} does not fit the GPU: ~{estimate.total_gib:.1f} GiB per GPU "
            f"needed, gpu_memory_gib is {args.gpu_memory_gib:g}.\n{text}\nShard over more "
            f"ranks (hybrid_shard: false or a larger shard_group_size), turn on "
            f"{fix}, or split the sequence with cp_size.")
    return text


def _budget_that_fits(args: ResolvedArgs, estimate, budget: int) -> str:
    """The advice on packing_token_budget when a pack does not fit: activations grow in
    proportion to the budget, so the room the activations may take (everything else, and the
    gradients they share the peak with, counted: MemoryEstimate.activation_room_gib) scales it
    down."""
    room = estimate.activation_room_gib(args.gpu_memory_gib)
    largest = int(budget * room / estimate.activations_gib) if room > 0 else 0
    if largest < 1:
        return ("lower packing_token_budget (though no budget fits: the states, gradients, "
                "working set and overhead alone exceed gpu_memory_gib)")
    return f"lower packing_token_budget to at most ~{largest} (the activations scale with it)"


def _geometry(args: ResolvedArgs):
    return family_of(args).geometry(model_config(args))


def _video_tokens(args: ResolvedArgs) -> int | None:
    """Video tokens of one sample: from the synthetic settings, the first shard's latent shape
    or expected_latent_shape (None when none of them is known here)."""
    grid = _patch_grid(args)
    return None if grid is None else grid[0] * grid[1] * grid[2]


def _patch_grid(args: ResolvedArgs) -> tuple[int, int, int] | None:
    """(frames, rows, cols) of one sample's patches, known as _video_tokens says, or None."""
    geometry = _geometry(args)
    pt, ph, pw = geometry.patch_size
    if args.synthetic_data and args.vae_path is not None:
        shape = encoded_latent_shape(args.vae_path, num_frames=args.synthetic_num_frames,
                                     height=args.synthetic_height, width=args.synthetic_width)
    elif args.synthetic_data:
        shape = (geometry.latent_channels, args.synthetic_num_frames, args.synthetic_height,
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
    return t // pt, h // ph, w // pw


def _first_latent_shape(data_path) -> tuple[int, ...] | None:
    """The data's first latent shape (trainer.data's torch-free index), or None when the data
    cannot be read here: an unreadable shard is training's error to report, not the estimate's."""
    from trainer.data import first_latent_shape

    try:
        return first_latent_shape(data_path)
    except Exception:  # noqa: BLE001
        return None
