"""Builds what a run is made of (models, text encoder, data, the stage) for training, inference
and the kernel warm-up alike, so all three get the same model from the same arguments.

Stages (trainer/stages/) compute losses; this module decides how their parts are constructed:
the DiT from `model_config(args)`, activation checkpointing and torch.compile as the args ask,
the frozen teacher and trainable critic of Stage2, the data iterator of this rank.
"""

from __future__ import annotations

import torch

from trainer.distributed import Topology, barrier
from trainer.schema import ResolvedArgs, model_config


def build_model(args: ResolvedArgs, device: torch.device, config: dict | None = None):
    """The run's VideoDiT (or one with `config` instead of the run's model config) on `device`."""
    from trainer.model import VideoDiT

    return VideoDiT(**(config or model_config(args))).to(device)


def build_score_models(args: ResolvedArgs, device: torch.device):
    """Stage2's (teacher, critic): bidirectional single-time copies of the student's config,
    the teacher frozen, both prepared for training (compile, checkpointing) like the student."""
    from trainer.stages.dmd_sgf import teacher_model_config

    config = teacher_model_config(model_config(args))
    teacher = build_model(args, device, config).eval().requires_grad_(False)
    critic = build_model(args, device, config)
    return prepare_for_training(teacher, args), prepare_for_training(critic, args)


def prepare_for_training(model: torch.nn.Module, args: ResolvedArgs) -> torch.nn.Module:
    """Activation checkpointing and torch.compile of the blocks, as the args ask; returns model.

    enable_gradient_checkpointing recomputes each block's activations in the backward pass
    (torch's composable `checkpoint`: it hooks the block's forward and keeps parameter names,
    so checkpoints and warm starts do not see it). compile_transformer compiles the blocks'
    two streams. Training and the kernel warm-up both come through here, so they compile the
    same graphs and the warm-up measures the memory training will need (docs/kernels.md).
    """
    if args.enable_gradient_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if args.compile_transformer:
        from trainer.model import compile_transformer_blocks

        compile_transformer_blocks(model)
    return model


def build_text_encoder(args: ResolvedArgs):
    from trainer.text_encoder import build_text_encoder as build

    return build(args.text_encoder, text_dim=model_config(args)["text_dim"],
                 max_tokens=args.text_max_tokens)


def build_data(args: ResolvedArgs, topo: Topology, seed_offset: int = 0):
    """This rank's batch iterator over the run's parquet data (generating the embedded set first)."""
    from trainer.data import DistributedBatchIterator, ParquetLatentDataset, resolve_data_paths
    from trainer.synthetic import ensure_dataset

    if args.synthetic_data:
        if topo.is_main:
            ensure_dataset(args.data_path, args.synthetic_num_samples, seed=args.synthetic_seed,
                           num_frames=args.synthetic_num_frames, height=args.synthetic_height,
                           width=args.synthetic_width, text_dim=model_config(args)["text_dim"],
                           max_text_tokens=args.text_max_tokens)
        barrier()
    dataset = ParquetLatentDataset(resolve_data_paths(args.data_path),
                                   max_text_tokens=args.text_max_tokens)
    return DistributedBatchIterator(dataset, batch_size=args.train_batch_size,
                                    dp_rank=topo.dp_rank, dp_world=topo.dp_world,
                                    seed=args.seed + seed_offset)


def sample_latent_shape(args: ResolvedArgs) -> tuple[int, int, int, int]:
    """[C, T, H, W] of one training sample, as the data delivers it; generates nothing.

    Raises FileNotFoundError / ValueError when the data cannot be read (as training would).
    """
    if args.synthetic_data:
        from trainer.synthetic import make_clip

        # One clip from the generator itself rather than a copy of its layout here.
        _, clip = make_clip(args.synthetic_seed, 0, num_frames=args.synthetic_num_frames,
                            height=args.synthetic_height, width=args.synthetic_width)
        return tuple(int(s) for s in clip.shape)
    from trainer.data import first_latent_shape

    return first_latent_shape(args.data_path)


def build_stage(args: ResolvedArgs, topo: Topology):
    """The stage object for args.stage, with its models, optimizers, schedulers and data."""
    if args.stage == "fm":
        from trainer.stages.fm import build_fm_stage

        return build_fm_stage(args, topo)
    if args.stage == "tf_anyflow":
        from trainer.stages.tf_anyflow import build_tf_anyflow_stage

        return build_tf_anyflow_stage(args, topo)
    if args.stage == "dmd_sgf":
        from trainer.stages.dmd_sgf import build_dmd_sgf_stage

        return build_dmd_sgf_stage(args, topo)
    raise ValueError(f"unknown stage {args.stage!r}")  # the schema's choices make this unreachable
