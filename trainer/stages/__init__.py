"""Training stages: one module per objective, chosen by the `stage` argument."""

from __future__ import annotations

import logging

import torch

from trainer.schema import ResolvedArgs, model_config
from trainer.distributed import Topology, barrier

log = logging.getLogger("relay")


def build_data(args: ResolvedArgs, topo: Topology, seed_offset: int = 0):
    """This rank's batch iterator over the run's parquet data (generating the embedded set first)."""
    from trainer.data import DistributedBatchIterator, ParquetLatentDataset, resolve_data_paths
    from trainer.synthetic import ensure_dataset

    config = model_config(args)
    if args.synthetic_data:
        if topo.is_main:
            ensure_dataset(args.data_path, args.synthetic_num_samples, seed=args.synthetic_seed,
                           num_frames=args.synthetic_num_frames, height=args.synthetic_height,
                           width=args.synthetic_width, text_dim=config["text_dim"],
                           max_text_tokens=args.text_max_tokens)
        barrier()
    dataset = ParquetLatentDataset(resolve_data_paths(args.data_path),
                                   max_text_tokens=args.text_max_tokens)
    return DistributedBatchIterator(dataset, batch_size=args.train_batch_size,
                                    dp_rank=topo.dp_rank, dp_world=topo.dp_world,
                                    seed=args.seed + seed_offset)


def build_text_encoder(args: ResolvedArgs):
    from trainer.text_encoder import build_text_encoder as build

    return build(args.text_encoder, text_dim=model_config(args)["text_dim"],
                 max_tokens=args.text_max_tokens)


def build_model(args: ResolvedArgs, device: torch.device):
    from trainer.model import VideoDiT

    return VideoDiT(**model_config(args)).to(device)


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
        from trainer.kernels import compile_transformer_blocks

        compile_transformer_blocks(model)
    return model


def wrap_for_training(model: torch.nn.Module, topo: Topology) -> torch.nn.Module:
    """Data parallel when there is more than one rank (FSDP2 comes with sharding)."""
    if not topo.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [topo.device.index] if topo.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


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
    raise ValueError(f"unknown stage {args.stage!r}")  # args.py's choices make this unreachable
