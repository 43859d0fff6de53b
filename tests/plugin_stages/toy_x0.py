"""The torch half of tests/plugin_stages/toy_stage.py: its stage object, builder and warm-up loss,
made of relay's parts (trainer.build, trainer.stages.fm's stage and caption handling)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.diffusion import flow
from trainer.diffusion.sample_draws import SampleDraws
from trainer.stages.fm import FlowMatchingStage, drop_captions


def x0_loss(model: nn.Module, batch: dict, args, null_text: torch.Tensor,
            null_mask: torch.Tensor, draws: SampleDraws) -> tuple[torch.Tensor, dict]:
    """Mean squared error of the clean sample the velocity implies; one uniform sigma per
    sample. Returns (loss, diagnostics)."""
    x0 = batch["latents"]
    text, mask = batch["text"], batch["text_mask"]
    drop = draws.uniform() < args.cfg_drop_prob
    if args.cfg_drop_prob > 0:
        text, mask = drop_captions(text, mask, null_text, null_mask, drop)
    sigma = draws.uniform().to(x0.device)
    noise = draws.normal_like(x0)
    x_t = flow.interpolate(x0, noise, sigma)
    velocity = model(x_t, flow.NUM_TRAIN_TIMESTEPS * sigma, text, mask)
    x0_hat = flow.x0_from_velocity(x_t, sigma, velocity.float())
    loss = (x0_hat - x0.float()).square().mean()
    return loss, {"toy_sigma_mean": sigma.detach().mean()}


class ToyX0Stage(FlowMatchingStage):
    name = "toy_x0"

    def micro_batch_loss(self, batch: dict, micro: int,
                         draws: SampleDraws) -> tuple[torch.Tensor, dict]:
        return x0_loss(self.train_model, batch, self.args, self.null_text, self.null_mask,
                       draws)


def build(args, topo) -> ToyX0Stage:
    from trainer.build import (build_data, build_ema, build_optimization, build_text_encoder,
                               build_trained_model)

    model = build_trained_model(args, topo, warm_start=True)
    optimizer, scheduler = build_optimization(args, model, max_steps=args.max_steps)
    encoder = build_text_encoder(args, topo.device)
    return ToyX0Stage(model, model, optimizer, scheduler, build_ema(args, model),
                      build_data(args, topo, text_encoder=encoder), args, encoder, topo.device,
                      dp_rank=topo.dp_rank, dp_world=topo.dp_world)


def warmup_loss(model: nn.Module, batch: dict, args, shapes: dict) -> torch.Tensor:
    from trainer.stages.fm import warmup_null_caption

    null_text, null_mask = warmup_null_caption(args, batch["latents"].device)
    draws = SampleDraws(args.seed, 0, range(batch["latents"].shape[0]), batch["latents"].device)
    return x0_loss(model, batch, args, null_text, null_mask, draws)[0]
