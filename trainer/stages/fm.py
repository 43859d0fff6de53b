"""Flow matching (pretrain and SFT): docs/algorithms.md, "Flow matching: pretrain and SFT".

One sigma per sample from the configured sampler and shift; the model regresses the velocity
n - x0. Conditioning tasks: a caption dropped to the null caption with cfg_drop_prob; with
image_cond_prob / video_cond_prob the first 1 / video_cond_frames latent frames stay clean
(t = 0) and are left out of the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.diffusion import flow
from trainer.parallel.distributed import gradient_sync
from trainer.diffusion.sample_draws import SampleDraws
from trainer.models.lora_targets import lora_enabled
from trainer.stages.base import (Stage, WarmStartSource, autocast_context, batch_to_device, clip_and_step,
                                  learning_rates)


def sample_condition_frames(u: torch.Tensor, num_frames: int, *, image_prob: float,
                            video_prob: float, video_frames: int) -> torch.Tensor:
    """Per sample, how many leading latent frames are given clean (0, 1 or video_frames), from
    one uniform draw per sample `u` [B]."""
    clean = torch.zeros(u.shape[0], dtype=torch.long, device=u.device)
    clean[u < image_prob] = 1
    clean[(u >= image_prob) & (u < image_prob + video_prob)] = min(video_frames, num_frames - 1)
    return clean


def drop_captions(text: torch.Tensor, mask: torch.Tensor, null_text: torch.Tensor,
                  null_mask: torch.Tensor, drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the captions of the samples where `drop` [B] is True by the null caption (padded,
    masked out, to whichever of the two is longer)."""
    drop = drop.to(text.device)
    if not bool(drop.any()):
        return text, mask
    length = max(text.shape[1], null_text.shape[0])
    text, mask = _pad_tokens(text, mask, length)
    null_text, null_mask = _pad_tokens(null_text[None], null_mask[None], length)
    null_text, null_mask = null_text[0], null_mask[0]
    text = torch.where(drop[:, None, None], null_text.to(text)[None], text)
    mask = torch.where(drop[:, None], null_mask.to(mask.device)[None], mask)
    return text, mask


def _pad_tokens(text: torch.Tensor, mask: torch.Tensor, length: int):
    """Captions [B, L, D] and masks [B, L] padded with masked-out tokens to `length`."""
    extra = length - text.shape[1]
    if extra <= 0:
        return text, mask
    return (torch.cat([text, text.new_zeros(text.shape[0], extra, text.shape[2])], dim=1),
            torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1))


def training_sigma(draws: SampleDraws, args, num_tokens: int) -> torch.Tensor:
    """One training sigma per sample [B] from the diffusion keys ("Noise levels"), each from its own
    generator."""
    return draws.stack(lambda g: _one_sigma(g, args, num_tokens))


def _one_sigma(generator: torch.Generator, args, num_tokens: int) -> torch.Tensor:
    return flow.SigmaSampling.of(args).draw(1, num_tokens, generator, generator.device)[0]


def fm_loss_packed(model: nn.Module, batch: dict, args, null_text: torch.Tensor,
                   null_mask: torch.Tensor, patch_size, draws: SampleDraws) -> tuple[torch.Tensor, dict]:
    """The FM loss of one pack (trainer.data.loader.collate_pack): the same draws, in the same
    order, and the same loss as fm_loss per sample (each its own caption drop, sigma at its own
    token count, clean frames and noise), the model run once over the pack; the loss is the
    mean over its samples."""
    pt, ph, pw = patch_size
    xs, texts, masks = batch["latents"], list(batch["text"]), list(batch["text_mask"])
    inputs, times, targets = [], [], []
    for i, x0 in enumerate(xs):
        one = draws.one(i)
        _, frames, h, w = x0.shape
        if bool(one.uniform()[0] < args.cfg_drop_prob):
            texts[i], masks[i] = null_text.to(x0), null_mask.to(x0.device)
        sigma = training_sigma(one, args, (frames // pt) * (h // ph) * (w // pw)).to(x0.device)
        clean = sample_condition_frames(one.uniform(), frames, image_prob=args.image_cond_prob,
                                        video_prob=args.video_cond_prob,
                                        video_frames=args.video_cond_frames).to(x0.device)
        frame_mask = torch.arange(frames, device=x0.device)[None] >= clean[:, None]   # [1, T]
        sigma_frames = sigma[:, None] * frame_mask.float()
        noise = one.normal_like(x0[None])[0]
        inputs.append(flow.interpolate(x0[None], noise[None], sigma_frames)[0])
        times.append(flow.NUM_TRAIN_TIMESTEPS * sigma_frames[0])
        targets.append((x0, noise, frame_mask, sigma))
    preds = model(inputs, times, texts, masks)
    losses = []
    for pred, (x0, noise, frame_mask, sigma) in zip(preds, targets):
        weight = None
        if args.loss_weighting != "none":
            weight = flow.loss_weight(sigma, args.loss_weighting, args.train_timestep_shift)
        loss, _ = flow.flow_matching_loss(pred[None].float(), x0[None].float(), noise[None].float(),
                                          weight=weight, frame_mask=frame_mask)
        losses.append(loss)
    sigmas = torch.cat([t[3] for t in targets])
    return torch.stack(losses).mean(), sigma_stats(sigmas)


def sigma_stats(sigma: torch.Tensor) -> dict[str, torch.Tensor]:
    """The diagnostics of a micro-batch's noise levels: their mean, least and greatest (the
    greatest and least show that train_timestep_range holds)."""
    sigma = sigma.detach()
    return {"sigma_mean": sigma.mean(), "sigma_min": sigma.min(), "sigma_max": sigma.max()}


class PackedForward(nn.Module):
    """`forward` = model.forward_packed, so DDP's and FSDP's hooks see every packed call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, xs, ts, texts, text_masks):
        return self.model.forward_packed(xs, ts, texts, text_masks)


def fm_loss(model: nn.Module, batch: dict, args, null_text: torch.Tensor,
            null_mask: torch.Tensor, num_tokens: int,
            draws: SampleDraws | None = None) -> tuple[torch.Tensor, dict]:
    """The FM loss of one micro-batch ("The FM loss") and a few diagnostics.

    draws: the micro-batch's per-sample generators (trainer.diffusion.sample_draws); without them
    (the kernel warm-up) the samples are keyed 0..B-1 at step 0.
    """
    x0 = batch["latents"]
    device = x0.device
    b, _, t_frames = x0.shape[:3]
    if draws is None:
        draws = SampleDraws(args.seed, 0, range(b), device)
    # One fixed order of draws per sample: caption drop, sigma, conditioning, noise.
    drop = draws.uniform() < args.cfg_drop_prob
    text, mask = batch["text"], batch["text_mask"]
    if args.cfg_drop_prob > 0:  # (drop_captions reads `drop` on the host)
        text, mask = drop_captions(text, mask, null_text, null_mask, drop)
    sigma = training_sigma(draws, args, num_tokens).to(device)
    clean = sample_condition_frames(draws.uniform(), t_frames, image_prob=args.image_cond_prob,
                                    video_prob=args.video_cond_prob,
                                    video_frames=args.video_cond_frames).to(device)
    frame_idx = torch.arange(t_frames, device=device)
    frame_mask = frame_idx[None, :] >= clean[:, None]              # [B, T]: frames in the loss
    sigma_frames = sigma[:, None] * frame_mask.float()             # clean frames at t = 0
    noise = draws.normal_like(x0)
    x_t = flow.interpolate(x0, noise, sigma_frames)
    # Without clean frames every frame has the sample's time: given per sample, the model need
    # not read the times on the host to see that they agree.
    conditioned = args.image_cond_prob > 0 or args.video_cond_prob > 0
    pred = model(x_t, flow.NUM_TRAIN_TIMESTEPS * (sigma_frames if conditioned else sigma), text,
                 mask)
    weight = None
    if args.loss_weighting != "none":
        weight = flow.loss_weight(sigma, args.loss_weighting, args.train_timestep_shift)
    loss, _ = flow.flow_matching_loss(pred.float(), x0.float(), noise.float(), weight=weight,
                                      frame_mask=frame_mask)
    # Diagnostics stay tensors: a host read here would stall the GPU between forward and backward.
    return loss, sigma_stats(sigma)


class FlowMatchingStage(Stage):
    """Pretrain and SFT: one transformer, one optimizer, an optional EMA."""

    name = "fm"

    def __init__(self, model: nn.Module, train_model: nn.Module, optimizer, scheduler, ema,
                 data, args, text_encoder, device: torch.device, dp_rank: int = 0,
                 dp_world: int = 1):
        self.model = model                    # the bare module (checkpoints, sampling)
        self.train_model = train_model        # what runs forward/backward (the model, or
                                              # Stage1's teacher-forcing view of it)
        self.roles = {"transformer": model}
        self.optimizers = {"transformer": optimizer}
        self.schedulers = {"transformer": scheduler}
        self.emas = {"transformer": ema} if ema is not None else {}
        self.data = data
        self.args = args
        self.device = device
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.text_encoder = text_encoder
        self.tokens_per_sample = 0
        null_text, null_mask = text_encoder.null_embedding()
        self.null_text = null_text[0].to(device)  # [L, D]: one null caption
        self.null_mask = null_mask[0].to(device)

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over gradient_accumulation_steps micro-batches; the numbers to log."""
        args = self.args
        accum = args.gradient_accumulation_steps
        optimizer = self.optimizers["transformer"]
        total, samples, stats = None, 0, []
        for micro in range(accum):
            batch = batch_to_device(self.data.next_batch(), self.device)
            samples += len(batch["sample_index"])
            self.tokens_per_sample = self.num_tokens(batch)
            with gradient_sync(self.model, enabled=micro == accum - 1):
                with autocast_context(self.device, args.dtype):
                    loss, micro_stats = self.micro_batch_loss(batch, micro, self.draws(batch, step))
                (loss / accum).backward()
            part = loss.detach().double() / accum  # read by the host after the update
            total = part if total is None else total + part
            stats.append(micro_stats)
        lrs = learning_rates(optimizer)  # the LRs this step uses (the scheduler moves them on)
        total, grad_norm = clip_and_step(step, self.model, optimizer, total, args.max_grad_norm)
        self.schedulers["transformer"].step()
        optimizer.zero_grad(set_to_none=True)
        if "transformer" in self.emas:
            self.emas["transformer"].update(self.model, step)
        merged = {k: float(v) for k, v in self.merge_stats(stats).items()}
        return {"loss": total, "grad_norm": grad_norm, **lrs, "samples": samples, **merged}

    def draws(self, batch: dict, step: int) -> SampleDraws:
        """The per-sample generators of a batch at `step`, keyed by its global sample indices."""
        return SampleDraws(self.args.seed, step, batch["sample_keys"], self.device)

    def micro_batch_loss(self, batch: dict, micro: int,
                         draws: SampleDraws) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (index `micro` within the step) and its diagnostics."""
        if batch.get("packed"):
            return fm_loss_packed(self.train_model, batch, self.args, self.null_text,
                                  self.null_mask, self.model.geometry.patch_size, draws)
        return fm_loss(self.train_model, batch, self.args, self.null_text, self.null_mask,
                       self.tokens_per_sample, draws)

    @staticmethod
    def merge_stats(stats: list[dict]) -> dict:
        """One step's diagnostics from its micro-batches': the last micro-batch's, but the
        least and greatest noise level of them all."""
        merged = dict(stats[-1])
        if "sigma_min" in merged:
            merged["sigma_min"] = torch.stack([s["sigma_min"] for s in stats]).min()
            merged["sigma_max"] = torch.stack([s["sigma_max"] for s in stats]).max()
        return merged

    def warm_start_sources(self) -> list[WarmStartSource]:
        """The pretrained transformer, when load_transformer_weights asks for one."""
        args = self.args
        if not args.load_transformer_weights or lora_enabled(args):
            return []  # a LoRA run's base was loaded when its model was built
        return [WarmStartSource("transformer", args.pretrained_transformer_path,
                                args.pretrained_weights, tuple(args.warm_start_allow_missing),
                                tuple(args.warm_start_allow_unexpected))]

    def num_tokens(self, batch: dict) -> int:
        pt, ph, pw = self.model.geometry.patch_size
        if batch.get("packed"):  # the pack's mean, so samples x tokens_per_sample is its total
            sizes = [(t // pt) * (h // ph) * (w // pw) for _, t, h, w in (x.shape for x in batch["latents"])]
            return sum(sizes) // len(sizes)
        _, _, t, h, w = batch["latents"].shape
        return (t // pt) * (h // ph) * (w // pw)

    def sampling_model(self, weights: str = "live") -> nn.Module:
        return self.model


# ---- the stage's construction and kernel warm-up (its declaration names these) ----------------

def build(args, topo) -> FlowMatchingStage:
    """Pretrain / SFT: one transformer, its optimizer, schedule and EMA."""
    from trainer.build import (build_data, build_ema, build_optimization, build_text_encoder,
                               build_trained_model, packing_budget)

    model = build_trained_model(args, topo, warm_start=True)
    optimizer, scheduler = build_optimization(args, model, max_steps=args.max_steps)
    # Packs run through forward_packed (registered with FSDP2 in trainer.parallel.distributed).
    runs = PackedForward(model) if packing_budget(args) is not None else model
    encoder = build_text_encoder(args, topo.device)
    return FlowMatchingStage(model, runs, optimizer, scheduler,
                             build_ema(args, model), build_data(args, topo, text_encoder=encoder),
                             args, encoder, topo.device, dp_rank=topo.dp_rank,
                             dp_world=topo.dp_world)


def warmup_null_caption(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The null caption [L, D] and its mask [L], as the stages keep it for caption dropout."""
    from trainer.build import build_text_encoder

    null_text, null_mask = build_text_encoder(args).null_embedding()
    # null_embedding has a batch dim of 1, which drop_captions would broadcast to [1, B, L, D].
    return (null_text.reshape(null_text.shape[-2:]).to(device),
            null_mask.reshape(null_mask.shape[-1:]).to(device))


def warmup_loss(model: nn.Module, batch: dict, args, shapes: dict) -> torch.Tensor:
    """The loss of one micro-batch for the kernel warm-up (trainer.warmup)."""
    null_text, null_mask = warmup_null_caption(args, batch["latents"].device)
    loss, _ = fm_loss(model, batch, args, null_text, null_mask, shapes["video_tokens"])
    return loss
