"""Builds what a run is made of (models, text encoder, data, the stage) for training, inference
and the kernel warm-up alike, so all three get the same model from the same arguments.

Stages (trainer/stages/) compute losses, and each stage's builder puts it together from the
parts constructed here: the model from its family (`model_family`, trainer.models.registry) and
`model_config(args)`, activation checkpointing and torch.compile as the args ask, FSDP2 and
context parallel, optimizers, schedules and EMAs, the text encoder, the data iterator of this
rank.
"""

from __future__ import annotations

import logging

import torch

from trainer.parallel.distributed import Topology, barrier, shard_model
from trainer.models.fa4_ops import FA4_OPS
from trainer.config.schema import ResolvedArgs
from trainer.models.lora_targets import lora_enabled
from trainer.models.registry import family_of, model_config

log = logging.getLogger(__name__)


def build_model(args: ResolvedArgs, device: torch.device, config: dict | None = None):
    """The run's model (or one with `config` instead of the run's model config) on `device`."""
    return family_of(args).build(config or model_config(args)).to(device)


def geometry(args: ResolvedArgs):
    """The run's model geometry (trainer.models.family.Geometry)."""
    return family_of(args).geometry(model_config(args))


def build_trained_model(args: ResolvedArgs, topo: Topology, *,
                        warm_start: bool = False) -> torch.nn.Module:
    """The run's transformer as training uses it: checkpointing, compile, then FSDP2 over the
    mesh (fully_shard goes last, around blocks that are already wrapped and compiled) and
    context parallel over the cp group. A LoRA run (lora_rank > 0) loads its frozen base and
    applies its adapters here (trainer.models.lora), so FSDP2 shards each adapter with its
    block; the stage's warm start is then the base already loaded.

    `warm_start`: the stage starts this model from pretrained_transformer_path. When that is
    safetensors and FSDP2 shards the model (`streams_weights`), it is built on the meta device,
    sharded, and only then given storage (each rank its shards) and its initialisation: no
    rank ever holds the whole model; the warm start then reads the files tensor by tensor
    into the shards (trainer.checkpoint.warm_start)."""
    if warm_start and streams_weights(args, topo):
        with torch.device("meta"):
            meta = family_of(args).build(model_config(args))
        if hasattr(meta, "init_weights"):  # else built whole, as below
            from trainer.parallel.distributed import materialise

            log.info("building the model sharded (meta device, then each rank's shards): its "
                     "weights stream from %s", args.pretrained_transformer_path)
            return materialise(distribute(prepare_for_training(meta, args), topo), topo.device)
        del meta
    model = build_model(args, topo.device)
    if lora_enabled(args):  # the frozen base and its adapters, before checkpointing and FSDP2
        from trainer.checkpoint.lora_weights import prepare_lora

        model = prepare_lora(model, args)
    return distribute(prepare_for_training(model, args), topo)


def streams_weights(args: ResolvedArgs, topo: Topology) -> bool:
    """Whether a warm start of this run reads pretrained_transformer_path tensor by tensor into
    FSDP2 shards of a model built on the meta device: more than one rank sharding it, no LoRA
    (its base loads before the adapters), and a safetensors source (a diffusers or original
    release directory, relay's model.safetensors). A source that cannot be resolved is left
    to the warm start, which names the problem."""
    if (topo.fsdp_mesh is None or lora_enabled(args) or not args.load_transformer_weights
            or not args.pretrained_transformer_path):
        return False
    from trainer.checkpoint.layout import CheckpointError
    from trainer.checkpoint.weights_source import resolve_weights_source

    try:
        source = resolve_weights_source(args.pretrained_transformer_path,
                                        weights=args.pretrained_weights)
    except (CheckpointError, OSError, ValueError):
        return False
    return source.kind in ("safetensors", "safetensors_dir")


def distribute(model: torch.nn.Module, topo: Topology) -> torch.nn.Module:
    """`model` sharded with FSDP2 over the mesh and, when cp_size > 1, running its sequence
    context-parallel over this rank's cp group (trainer.parallel.context_parallel); returns it."""
    model = shard_model(model, topo)
    if topo.cp_size > 1:
        from trainer.parallel.context_parallel import attach

        attach(model, topo.cp_group, topo.cp_size, topo.cp_rank)
    return model


def prepare_for_training(model: torch.nn.Module, args: ResolvedArgs) -> torch.nn.Module:
    """Activation checkpointing and torch.compile of the blocks, as the args ask; returns model.

    enable_gradient_checkpointing recomputes each block's activations in the backward pass
    (torch's composable `checkpoint`: it hooks the block's forward and keeps parameter names,
    so checkpoints and warm starts do not see it); use_dedicated_gradient_checkpointing
    makes it selective: attention outputs are kept, everything else is recomputed.
    compile_transformer compiles the blocks (the family's `compile_blocks`). Training and the
    kernel warm-up both come through here, so they compile the same graphs and the warm-up measures the memory training will need (docs/kernels.md).
    """
    if args.enable_gradient_checkpointing:
        from torch.distributed._composable import checkpoint

        options = {}
        if args.use_dedicated_gradient_checkpointing:
            options["context_fn"] = _keep_attention_outputs
        for unit in model.checkpoint_units():
            checkpoint(unit, **options)
    if args.compile_transformer:
        model.compile_blocks()
    return model


# Attention kernels, the one part of a block whose recompute costs more than its memory: the
# selective policy keeps their outputs (the fused kernels' logsumexp/seeds come with them).
# FA4 counts because it runs as a registered operator (trainer/models/fa4_ops.py).
_ATTENTION_OPS = tuple(
    getattr(torch.ops.aten, name) for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(torch.ops.aten, name)) + FA4_OPS


def _keep_attention_outputs():
    """Selective checkpointing contexts: save attention outputs, recompute every other op."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if getattr(op, "overloadpacket", op) in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def build_text_encoder(args: ResolvedArgs, device="cpu"):
    """The run's text encoder (`text_encoder`: the stand-in or a directory), on `device`."""
    from trainer.encoders.text import build_text_encoder as build

    extra = {}
    if args.text_encoder == "standin" and args.get("synthetic_generator") == "bench":
        extra["positional"] = True  # as the benchmark's data was encoded (trainer.data.synthetic)
    return build(args.text_encoder, text_dim=geometry(args).text_dim,
                 max_tokens=args.text_max_tokens,
                 skip_layer=args.text_encoder_hidden_state_skip_layer, device=device, **extra)


def build_data(args: ResolvedArgs, topo: Topology, seed_offset: int = 0, text_encoder=None):
    """This rank's batch iterator over the run's parquet data (generating the embedded set first).
    Under context parallel only cp rank 0 of a group reads, and the group shares its batches.
    text_encoder encodes the captions of data that stores no caption embeddings.

    Raises ValueError when the data cannot make the batches asked for (see BatchPlan).
    """
    from trainer.data.synthetic import ensure_dataset

    if args.synthetic_data and args.vae_path is not None:
        # Through the run's real VAE and text encoder (trainer.data.synthetic_encoded).
        if topo.is_main:
            from trainer.data.synthetic_encoded import ensure_encoded_dataset

            ensure_encoded_dataset(args.data_path, args.synthetic_num_samples,
                                   seed=args.synthetic_seed, vae_dir=args.vae_path,
                                   text_encoder_dir=args.text_encoder,
                                   num_frames=args.synthetic_num_frames,
                                   height=args.synthetic_height, width=args.synthetic_width,
                                   generator=args.synthetic_generator,
                                   skip_layer=args.text_encoder_hidden_state_skip_layer,
                                   max_text_tokens=args.text_max_tokens)
        barrier()
    elif args.synthetic_data:
        if topo.is_main:
            ensure_dataset(args.data_path, args.synthetic_num_samples, seed=args.synthetic_seed,
                           num_frames=args.synthetic_num_frames, height=args.synthetic_height,
                           width=args.synthetic_width, text_dim=geometry(args).text_dim,
                           max_text_tokens=args.text_max_tokens,
                           generator=args.synthetic_generator)
        barrier()
    if topo.cp_size == 1:
        return _data_reader(args, topo, seed_offset, text_encoder)
    from trainer.parallel.context_parallel import GroupSharedBatches

    reader = _data_reader(args, topo, seed_offset, text_encoder) if topo.cp_rank == 0 else None
    return GroupSharedBatches(reader, topo.cp_group)


def packing_budget(args: ResolvedArgs) -> int | None:
    """The joint tokens of a pack, or None for stacked batches: packing_token_budget, or a
    budget derived from the data when a stream mixes latent shapes (trainer.data.checks)."""
    from trainer.data.checks import batching
    from trainer.models.registry import data_widths

    return batching(args, data_widths(args)).budget


def _data_reader(args: ResolvedArgs, topo: Topology, seed_offset: int, text_encoder):
    """The DistributedBatchIterator of this rank's data-parallel share."""
    from trainer.data import DistributedBatchIterator, ParquetLatentDataset

    budget = packing_budget(args)
    packing = budget is not None
    # Packs keep every caption at its own length; stacked batches need one length.
    dataset = ParquetLatentDataset(args.data_path, pad_text=not packing,
                                   max_text_tokens=None if packing else args.text_max_tokens,
                                   caption_tokens=args.text_max_tokens)
    bad = dataset.index.bad_rows
    if bad:
        log.warning("%d rows of the data are unreadable and left out; first: %s", len(bad), bad[0])
    return DistributedBatchIterator(
        dataset, batch_size=args.train_batch_size, dp_rank=topo.dp_rank, dp_world=topo.dp_world,
        seed=args.seed + seed_offset, token_budget=budget,
        patch_size=geometry(args).patch_size, image_sample_prob=args.image_sample_prob,
        num_workers=args.packed_dataloader_num_workers,
        prefetch_factor=args.packed_dataloader_prefetch_factor,
        pin_memory=topo.device.type == "cuda",
        reset_streams=() if args.resume_video_csv else ("video",),
        grad_accum=args.gradient_accumulation_steps, caption_encoder=text_encoder)


def sample_latent_shape(args: ResolvedArgs) -> tuple[int, int, int, int]:
    """[C, T, H, W] of one training sample, as the data delivers it; generates nothing.

    Raises FileNotFoundError / ValueError when the data cannot be read (as training would).
    """
    if args.synthetic_data and args.vae_path is not None:
        from trainer.data.synthetic_encoded import encoded_latent_shape

        return encoded_latent_shape(args.vae_path, num_frames=args.synthetic_num_frames,
                                    height=args.synthetic_height, width=args.synthetic_width)
    if args.synthetic_data:
        from trainer.data.synthetic import make_sample

        # One clip from the generator itself rather than a copy of its layout here.
        _, clip = make_sample(args.get("synthetic_generator", "shapes"), args.synthetic_seed, 0,
                              num_frames=args.synthetic_num_frames,
                              height=args.synthetic_height, width=args.synthetic_width)
        return tuple(int(s) for s in clip.shape)
    from trainer.data import first_latent_shape

    return first_latent_shape(args.data_path)


def build_optimization(args: ResolvedArgs, model: torch.nn.Module, *, max_steps: int,
                  use_muon: bool | None = None, learning_rate: float | None = None,
                  betas: tuple[float, float] | None = None):
    """(optimizer, LR scheduler) of one trained role from the training keys; a role with its
    own keys (Stage2's critic) passes them instead."""
    from trainer.optim.optimizers import build_lr_scheduler, build_optimizer

    optimizer = build_optimizer(
        model, use_muon=args.use_muon if use_muon is None else use_muon,
        learning_rate=args.learning_rate if learning_rate is None else learning_rate,
        muon_learning_rate=args.muon_learning_rate, weight_decay=args.weight_decay,
        betas=betas or (args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        muon_excluded=family_of(args).muon_excluded_name_parts)
    scheduler = build_lr_scheduler(
        optimizer, lr_scheduler_type=args.lr_scheduler_type, warmup_steps=args.warmup_steps,
        max_steps=max_steps, lr_decay_steps=args.lr_decay_steps,
        lr_decay_floor_ratio=args.lr_decay_floor_ratio)
    return optimizer, scheduler


def build_ema(args: ResolvedArgs, model: torch.nn.Module):
    from trainer.optim.ema import EMA

    return (EMA(model, args.ema_decay, start=args.ema_start_step,
                update_every=args.ema_update_every, trainable_only=lora_enabled(args))
            if args.use_ema else None)
