"""Stage2: DMD via SGF (self-gradient forcing), docs/algorithms.md, "Stage2: DMD via SGF".

Three roles: the causal student G (trained; init: Stage1 EMA without its second time input),
the frozen bidirectional teacher (real score; init: SFT) and the trainable bidirectional critic (fake
score; init: SFT). Outer step k = step - 1 (the loop counts steps from 1): the student updates
when k > 0 and k % generator_update_interval == 0, then the critic updates, every step
(SolarWM order, "Cadence"). Each update draws its own batch and its own rollout.

Student update: rollout (trainer/stages/rollout.py: no-grad simulation, then one
teacher-forcing replay of the exit step with grad) -> x_hat; noise it to a score level
sigma_s; teacher x0 with reference CFG R_s = c + s (c - u) and critic x0 (conditional);
g = (x0_fake - x0_real) / per-sample mean |x_hat - x0_real|; L_G = 0.5 masked_mean((x_hat -
sg(x_hat - g))^2), whose gradient w.r.t. x_hat is g / #valid elements ("Student loss"). Critic update:
a fresh no-grad rollout x_hat, FM loss of the critic on it ("Critic loss"). EMA of the student after
its updates, counted in student updates ("Cadence", "EMA"). Every step also logs what the health
gate (trainer.runtime.health) watches: dmd_grad_rms, critic_loss_rel (the critic's FM loss over its
first value) and generator_critic_loss_ratio.

A micro-batch may be a pack of samples of different shapes (packing_token_budget): each sample
draws and loses what it would alone, the models run the pack at once, and the losses are the
per-sample means (the *_packed methods; docs/stages.md, "On packs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.diffusion import flow
from trainer.models.registry import family_of, model_config
from trainer.parallel.distributed import max_across_ranks
from trainer.diffusion.sample_draws import SampleDraws, step_generator
from trainer.stages import rollout as ro
from trainer.stages.base import (Stage, WarmStartSource, autocast_context, batch_to_device,
                                 clip_and_step)

N = flow.NUM_TRAIN_TIMESTEPS

ROLES = ("student", "teacher", "critic")


# ---- configuration -----------------------------------------------------------------------

# ---- cadence -----------------------------------------------------------------------------

def outer_index(step: int) -> int:
    """The 0-based outer step k of the loop's 1-based `step`."""
    return step - 1


def is_student_step(k: int, interval: int) -> bool:
    """Whether outer step k updates the student: k > 0 and k % interval == 0 (the critic is
    warmed first; the j-th student update happens at k = j * interval)."""
    return k > 0 and k % interval == 0


def student_updates_through(step: int, interval: int) -> int:
    """Student updates done after loop steps 1..step (outer steps 0..step-1)."""
    return max(0, step - 1) // interval


# ---- losses ------------------------------------------------------------------------------

@dataclass
class Captions:
    """A batch's caption states and the null caption ([L, D], [L]) for the unconditional."""

    text: torch.Tensor
    mask: torch.Tensor
    null_text: torch.Tensor
    null_mask: torch.Tensor


def sample_score_sigmas(batch: int, *, shift: float, min_ratio: float, max_ratio: float,
                        device=None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Score noise levels [B] float32: raw ~ U{0..N-1}, sigma = clamp(S(raw/N; shift), min,
    max) ("Student loss"). Drawn from `generator` (its device) or the global RNG on `device`."""
    where = generator.device if generator is not None else device
    raw = torch.randint(N, (batch,), generator=generator, device=where).to(torch.float64)
    sigma = flow.shift_sigma(raw / N, shift).clamp(min_ratio, max_ratio)
    return sigma.to(device=device, dtype=torch.float32)


def reference_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Guidance in the reference convention R_s(c, u) = c + s (c - u) (= standard w = 1 + s)."""
    return cond + scale * (cond - uncond)


def teacher_x0(teacher: nn.Module, x_noisy: torch.Tensor, sigma_frames: torch.Tensor,
               captions: Captions, guidance_scale: float) -> torch.Tensor:
    """The teacher's guided x0 = x - sigma R_s(F(x | c), F(x | null)), float32.

    R_s is computed as the standard u + w (c - u) with w = 1 + s (trainer.diffusion.flow.guided, one
    batched forward; s = 0 runs the conditional branch only).
    """
    v = flow.guided(teacher, x_noisy, sigma_frames * N, captions.text, captions.mask,
               captions.null_text, captions.null_mask, 1.0 + guidance_scale)
    return flow.x0_from_velocity(_work(x_noisy), sigma_frames, _work(v))


def critic_x0(critic: nn.Module, x_noisy: torch.Tensor, sigma_frames: torch.Tensor,
              captions: Captions) -> torch.Tensor:
    """The critic's conditional x0 = x - sigma F_critic(x | c) (no guidance), float32."""
    v = critic(x_noisy, sigma_frames * N, captions.text, captions.mask)
    return flow.x0_from_velocity(_work(x_noisy), sigma_frames, _work(v))


def teacher_x0_packed(teacher: nn.Module, x_noisys: list[torch.Tensor],
                      sigma_frames: list[torch.Tensor], captions: Captions,
                      guidance_scale: float) -> list[torch.Tensor]:
    """teacher_x0 over a pack (x_noisys[i] [1, C, T_i, H_i, W_i], sigma_frames[i] [1, T_i],
    captions.text / mask: lists [L_i, D] / [L_i]): both branches in one packed forward."""
    xs, ts, n = [x[0] for x in x_noisys], [s[0] * N for s in sigma_frames], len(x_noisys)
    w = 1.0 + guidance_scale
    if w == 1.0:
        v = teacher.forward_packed(xs, ts, list(captions.text), list(captions.mask))
    else:
        null = captions.null_text.to(captions.text[0])
        null_mask = captions.null_mask.to(captions.mask[0].device)
        both = teacher.forward_packed(xs + xs, ts + ts, [*captions.text, *[null] * n],
                                      [*captions.mask, *[null_mask] * n])
        v = [u + w * (c - u) for c, u in zip(both[:n], both[n:])]
    return [flow.x0_from_velocity(_work(x), s, _work(vi[None]))
            for x, s, vi in zip(x_noisys, sigma_frames, v)]


def critic_x0_packed(critic: nn.Module, x_noisys: list[torch.Tensor],
                     sigma_frames: list[torch.Tensor], captions: Captions) -> list[torch.Tensor]:
    """critic_x0 over a pack (arguments as teacher_x0_packed)."""
    v = critic.forward_packed([x[0] for x in x_noisys], [s[0] * N for s in sigma_frames],
                              list(captions.text), list(captions.mask))
    return [flow.x0_from_velocity(_work(x), s, _work(vi[None]))
            for x, s, vi in zip(x_noisys, sigma_frames, v)]


def _work(x: torch.Tensor) -> torch.Tensor:
    # losses in float32 at least (float64 inputs, as in the tests, stay float64)
    return x if x.dtype == torch.float64 else x.float()


def _valid(frame_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return frame_mask.to(like.device)[:, None, :, None, None].expand_as(like)


def masked_mean(x: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, C, T, H, W] over the elements of frames marked True in frame_mask [B, T]
    (all valid elements of the batch together). Masked elements are zeroed before the sum,
    so a NaN there reaches neither the value nor the gradient."""
    valid = _valid(frame_mask, x)
    x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() / valid.sum().clamp_min(1)


def dmd_gradient(x_hat: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor,
                 frame_mask: torch.Tensor) -> torch.Tensor:
    """The DMD gradient g = (x0_fake - x0_real) / max(mean |x_hat - x0_real|, 1e-8) ("Student loss").

    The normaliser is per sample, over its valid elements (DMD eq. 8); g is 0 on masked
    frames and NaN-free. Inputs are treated as constants (call under no_grad or detach).
    Returns g like x_hat, float32.
    """
    x_hat, x0_fake, x0_real = _work(x_hat), _work(x0_fake), _work(x0_real)
    valid = _valid(frame_mask, x_hat)
    zero = torch.zeros((), dtype=x_hat.dtype, device=x_hat.device)
    b = x_hat.shape[0]
    dist_abs = torch.where(valid, (x_hat - x0_real).abs(), zero).reshape(b, -1).sum(1)
    count = valid.reshape(b, -1).sum(1).clamp_min(1)
    normaliser = (dist_abs / count).clamp_min(1e-8).view(b, 1, 1, 1, 1)
    g = torch.where(valid, (x0_fake - x0_real) / normaliser, zero)
    return torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)


def dmd_surrogate_loss(x_hat: torch.Tensor, g: torch.Tensor,
                       frame_mask: torch.Tensor) -> torch.Tensor:
    """L = 0.5 masked_mean((x_hat - sg(x_hat - g))^2): value 0.5 mean(g^2), gradient w.r.t.
    x_hat = g / (number of valid elements) on valid frames, 0 elsewhere (the MSE trick)."""
    x_hat = _work(x_hat)
    target = (x_hat - g).detach()
    return 0.5 * masked_mean((x_hat - target).square(), frame_mask)


def critic_flow_loss(critic_velocity: torch.Tensor, x_hat: torch.Tensor, noise: torch.Tensor,
                     frame_mask: torch.Tensor) -> torch.Tensor:
    """The critic's FM loss on student samples: masked_mean((F - (noise - x_hat))^2) ("Critic loss");
    x_hat is a constant (no gradient reaches the student)."""
    target = flow.velocity_target(_work(x_hat.detach()), _work(noise))
    return masked_mean((_work(critic_velocity) - target).square(), frame_mask)


# ---- the stage -----------------------------------------------------------------------------

class DMDSGFStage(Stage):
    """Stage2: student, teacher and critic; two optimizers; the student's EMA."""

    name = "dmd_sgf"
    # train.py warm-starts this stage from its three *_init_path keys whenever output_dir has
    # no checkpoint (it has no pretrained_transformer_path / load_transformer_weights).

    def __init__(self, student: nn.Module, teacher: nn.Module, critic: nn.Module, optimizers,
                 schedulers, ema, data, args, text_encoder, device: torch.device):
        self.student, self.teacher, self.critic = student, teacher, critic
        self.roles = {"student": student, "teacher": teacher, "critic": critic}
        self.optimizers = dict(optimizers)
        self.schedulers = dict(schedulers)
        self.emas = {"student": ema} if ema is not None else {}
        self.data = data
        self.args = args
        self.text_encoder = text_encoder
        self.device = device
        self.interval = args.generator_update_interval
        self.sigmas = ro.rollout_sigmas(args.dmd_denoising_steps, args.train_timestep_shift,
                                        args.warp_denoising_step)
        null_text, null_mask = text_encoder.null_embedding()
        self.null_text = null_text[0].to(device)
        self.null_mask = null_mask[0].to(device)
        self.student_updates = 0
        self.last_generator: dict[str, float] = {}
        self.critic_loss_start: float | None = None  # the first critic loss of this Stage2
        self.tokens_per_sample = 0
        self.last_batch_samples = 0

    # ---- one outer step ------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        k = outer_index(step)
        numbers: dict[str, float] = {}
        samples = 0
        if is_student_step(k, self.interval):
            numbers.update(self._student_update(step))
            samples += self.last_batch_samples
        critic = self._critic_update(step)
        samples += self.last_batch_samples
        numbers.update(critic)
        numbers.update(self.last_generator)
        numbers.update(self._health_numbers(critic["critic_loss"]))
        numbers.update({
            "student_updates": self.student_updates,
            "lr": self.optimizers["student"].param_groups[0]["lr"],
            "samples": samples,
        })
        return numbers

    def _update_inputs(self, step: int):
        """(batch, its captions, its draws, whether it is packed, the student's sampler) of one
        update, generator's or critic's."""
        batch = self._next_batch()
        packed = bool(batch.get("packed"))
        sample = self.student_sample_packed if packed else self.student_sample
        return batch, self._captions(batch), self._draws(batch, step), packed, sample

    def _student_update(self, step: int) -> dict[str, float]:
        args = self.args
        batch, captions, draws, packed, sample = self._update_inputs(step)
        losses = self.generator_loss_packed if packed else self.generator_loss
        with autocast_context(self.device, args.dtype):
            x_hat, frame_mask, exit_index = sample(
                batch, with_grad=True, draws=draws, exit_generator=self._exit_generator(step, 0))
            loss, stats = losses(x_hat, frame_mask, captions, draws)
        loss.backward()
        optimizer = self.optimizers["student"]
        loss_value, grad_norm = clip_and_step(step, self.student, optimizer, loss,
                                              args.max_grad_norm)
        self.schedulers["student"].step()
        optimizer.zero_grad(set_to_none=True)
        self.student_updates += 1
        if "student" in self.emas:
            self.emas["student"].update(self.student, self.student_updates)
        self.last_generator = {"generator_loss": loss_value,
                               "student_grad_norm": grad_norm,
                               "exit_index": float(exit_index), **stats}
        return dict(self.last_generator)

    def _critic_update(self, step: int) -> dict[str, float]:
        args = self.args
        batch, captions, draws, packed, sample = self._update_inputs(step)
        with autocast_context(self.device, args.dtype):
            with torch.no_grad():
                x_hat, frame_mask, _ = sample(batch, with_grad=False, draws=draws,
                                              exit_generator=self._exit_generator(step, 1))
            losses = self.critic_loss_packed if packed else self.critic_loss
            loss = losses(x_hat, frame_mask, captions, draws)
        loss.backward()
        optimizer = self.optimizers["critic"]
        loss_value, grad_norm = clip_and_step(step, self.critic, optimizer, loss,
                                              args.critic_max_grad_norm)
        self.schedulers["critic"].step()
        optimizer.zero_grad(set_to_none=True)
        return {"critic_loss": loss_value, "critic_grad_norm": grad_norm,
                "critic_lr": optimizer.param_groups[0]["lr"]}

    def _health_numbers(self, critic_loss: float) -> dict[str, float]:
        """What trainer.runtime.health watches: the critic's FM loss over its first value in this
        Stage2 run, and the latest student loss over this step's critic loss (a student whose
        DMD loss grows while the critic's does not is drifting from the teacher)."""
        if self.critic_loss_start is None:
            self.critic_loss_start = critic_loss
        numbers = {"critic_loss_rel": critic_loss / max(self.critic_loss_start, 1e-12)}
        if "generator_loss" in self.last_generator:
            numbers["generator_critic_loss_ratio"] = (self.last_generator["generator_loss"]
                                                      / max(critic_loss, 1e-12))
        return numbers

    # ---- pieces ---------------------------------------------------------------------------
    def _draws(self, batch: dict, step: int) -> SampleDraws:
        """The batch's per-sample generators at `step` (keyed by its global sample indices)."""
        return SampleDraws(self.args.seed, step, batch["sample_keys"], self.device)

    def _exit_generator(self, step: int, update: int) -> torch.Generator:
        # Every rank must take the same exit: it decides how many sharded forwards run.
        return step_generator(self.args.seed, 2 * step + update)

    def student_sample(self, batch: dict, *, with_grad: bool, draws: SampleDraws | None = None,
                       exit_generator: torch.Generator | None = None):
        """The student's sample x_hat [B, C, T, H, W] for a batch: (x_hat, loss frame mask
        [B, T], exit index). with_grad: x_hat carries the exit step's gradient ("Rollout and KV cache").
        draws / exit_generator: the batch's per-sample generators and the one all ranks share
        for the exit step (default: samples keyed 0..B-1 and the exit of step 0)."""
        x0 = batch["latents"]
        b, _, frames = x0.shape[:3]
        draws = draws or SampleDraws(self.args.seed, 0, range(b), self.device)
        anchored = self._anchored(draws)
        anchor = x0[:, :, :1] if anchored is not None else None
        text, mask = batch["text"], batch["text_mask"]
        exit_index = ro.sample_exit_index(len(self.sigmas),
                                          exit_generator or step_generator(self.args.seed, 0))
        sigma = self.sigmas[exit_index]
        noise = draws.normal_like(x0)
        if self.args.rollout_mode == "data_latent":
            # No simulation: the data noised to the exit level, with the data as clean context.
            s = ro.frame_sigmas(sigma, b, frames, anchored, device=x0.device)
            noisy, clean = flow.interpolate(x0, noise, s), x0
        else:
            with torch.no_grad():
                student = ro.CachedStudent(self.student, text, mask)
                rollout = ro.simulate_rollout(student, noise, self.sigmas, exit_index,
                                              anchor=anchor, anchored=anchored, generator=draws)
            if not with_grad:
                return rollout.output, ro.loss_frame_mask(anchored, b, frames,
                                                                  x0.device), exit_index
            noisy, clean = rollout.noisy_at_exit, rollout.output
        with torch.set_grad_enabled(with_grad):
            x_hat = ro.replay_exit(self.student, noisy, clean, sigma, text, mask, anchor=anchor,
                                   anchored=anchored)
        return x_hat, ro.loss_frame_mask(anchored, b, frames, x0.device), exit_index

    def _score_point(self, x_hat: torch.Tensor, frame_mask: torch.Tensor,
                     draws: SampleDraws | None = None):
        """(sigma [B], per-frame sigma [B, T], noise, noised sample) at a fresh score level,
        drawn from `draws` (default: samples keyed 0..B-1 at step 0)."""
        args = self.args
        b, frames = x_hat.shape[0], x_hat.shape[2]
        draws = draws or SampleDraws(args.seed, 0, range(b), self.device)
        sigma = draws.stack(lambda g: sample_score_sigmas(
            1, shift=args.train_timestep_shift, min_ratio=args.min_score_timestep_ratio,
            max_ratio=args.max_score_timestep_ratio, device=x_hat.device, generator=g)[0])
        anchored = None if bool(frame_mask[:, 0].all()) else ~frame_mask[:, 0]
        s = ro.frame_sigmas(sigma, b, frames, anchored, device=x_hat.device)
        noise = draws.normal_like(x_hat)
        return sigma, s, noise, flow.interpolate(x_hat.detach(), noise, s)

    def generator_loss(self, x_hat: torch.Tensor, frame_mask: torch.Tensor, captions: Captions,
                       draws: SampleDraws | None = None):
        """The student's DMD surrogate loss for its sample x_hat (with grad) and diagnostics."""
        with torch.no_grad():
            sigma, s, _, x_noisy = self._score_point(x_hat, frame_mask, draws)
            real = teacher_x0(self.teacher, x_noisy, s, captions, self.args.real_guidance_scale)
            fake = critic_x0(self.critic, x_noisy, s, captions)
            g = dmd_gradient(x_hat.detach(), fake, real, frame_mask)
        loss = dmd_surrogate_loss(x_hat, g, frame_mask)
        return loss, {"score_sigma_mean": float(sigma.mean()),
                      "dmd_grad_rms": float(g.square().mean().sqrt())}

    def critic_loss(self, x_hat: torch.Tensor, frame_mask: torch.Tensor, captions: Captions,
                    draws: SampleDraws | None = None) -> torch.Tensor:
        """The critic's FM loss on the (constant) student sample x_hat."""
        _, s, noise, x_noisy = self._score_point(x_hat, frame_mask, draws)
        velocity = self.critic(x_noisy, s * N, captions.text, captions.mask)
        return critic_flow_loss(velocity, x_hat, noise, frame_mask)

    # ---- packs: the same draws, forwards and losses per sample, the model run once a pack --
    def student_sample_packed(self, batch: dict, *, with_grad: bool, draws: SampleDraws,
                              exit_generator: torch.Generator):
        """student_sample for a pack (trainer.data.loader.collate_pack): (x_hat per sample
        [1, C, T_i, H_i, W_i], loss frame mask per sample [1, T_i], exit index). Each sample
        draws what it draws alone, in the same order; the rollout, the replay, the teacher and
        the critic run the pack at once (trainer.stages.rollout.simulate_packed_rollout)."""
        x0s = [x[None] for x in batch["latents"]]
        texts, masks = batch["text"], batch["text_mask"]
        ones = [draws.one(i) for i in range(len(x0s))]
        anchored = [self._anchored(one) for one in ones]
        anchors = [x0[:, :, :1] if a is not None else None for x0, a in zip(x0s, anchored)]
        exit_index = ro.sample_exit_index(len(self.sigmas), exit_generator)
        sigma = self.sigmas[exit_index]
        noises = [one.normal_like(x0) for one, x0 in zip(ones, x0s)]
        frame_masks = [ro.loss_frame_mask(a, 1, x0.shape[2], x0.device)
                       for x0, a in zip(x0s, anchored)]
        if self.args.rollout_mode == "data_latent":
            noisys = [flow.interpolate(x0, noise, ro.frame_sigmas(sigma, 1, x0.shape[2], a,
                                                                  device=x0.device))
                      for x0, noise, a in zip(x0s, noises, anchored)]
            cleans = x0s
        else:
            chunk = self.student.geometry.causal_chunk_frames
            # Every rank runs as many chunk rounds as the longest pack of any rank holds.
            rounds = max_across_ranks(max(-(-x0.shape[2] // chunk) for x0 in x0s))
            rollout = ro.simulate_packed_rollout(self.student, noises, texts, masks, self.sigmas,
                                                 exit_index, anchors=anchors, anchored=anchored,
                                                 draws=ones, rounds=rounds)
            if not with_grad:
                return rollout.output, frame_masks, exit_index
            noisys, cleans = rollout.noisy_at_exit, rollout.output
        with torch.set_grad_enabled(with_grad):
            x_hats = ro.replay_exit_packed(self.student, noisys, cleans, sigma, texts, masks,
                                           anchors=anchors, anchored=anchored)
        return x_hats, frame_masks, exit_index

    def _score_points(self, x_hats, frame_masks, draws: SampleDraws):
        """_score_point of each sample of a pack, from its own draws: lists of its fields."""
        points = [self._score_point(x, m, draws.one(i))
                  for i, (x, m) in enumerate(zip(x_hats, frame_masks))]
        return tuple(list(field) for field in zip(*points))

    def generator_loss_packed(self, x_hats: list[torch.Tensor], frame_masks: list[torch.Tensor],
                              captions: Captions, draws: SampleDraws):
        """The mean over the pack's samples of each one's generator_loss, and diagnostics."""
        with torch.no_grad():
            sigmas, s, _, x_noisy = self._score_points(x_hats, frame_masks, draws)
            real = teacher_x0_packed(self.teacher, x_noisy, s, captions,
                                     self.args.real_guidance_scale)
            fake = critic_x0_packed(self.critic, x_noisy, s, captions)
            gs = [dmd_gradient(x.detach(), f, r, m)
                  for x, f, r, m in zip(x_hats, fake, real, frame_masks)]
        loss = torch.stack([dmd_surrogate_loss(x, g, m)
                            for x, g, m in zip(x_hats, gs, frame_masks)]).mean()
        squares = sum(float(g.square().sum()) for g in gs) / sum(g.numel() for g in gs)
        return loss, {"score_sigma_mean": float(torch.cat(sigmas).mean()),
                      "dmd_grad_rms": squares ** 0.5}

    def critic_loss_packed(self, x_hats: list[torch.Tensor], frame_masks: list[torch.Tensor],
                           captions: Captions, draws: SampleDraws) -> torch.Tensor:
        """The mean over the pack's samples of each one's critic_loss, the critic run once."""
        _, s, noise, x_noisy = self._score_points(x_hats, frame_masks, draws)
        velocity = self.critic.forward_packed([x[0] for x in x_noisy], [si[0] * N for si in s],
                                              list(captions.text), list(captions.mask))
        return torch.stack([critic_flow_loss(v[None], x, n, m) for v, x, n, m
                            in zip(velocity, x_hats, noise, frame_masks)]).mean()

    def _anchored(self, draws: SampleDraws) -> torch.Tensor | None:
        """Which samples keep their first latent frame as a clean anchor (image_cond_prob)."""
        if self.args.image_cond_prob <= 0:
            return None
        return (draws.uniform() < self.args.image_cond_prob).to(self.device)

    def _captions(self, batch: dict) -> Captions:
        return Captions(batch["text"], batch["text_mask"], self.null_text, self.null_mask)

    def _next_batch(self) -> dict:
        batch = batch_to_device(self.data.next_batch(), self.device)
        pt, ph, pw = self.student.geometry.patch_size
        shapes = ([x.shape for x in batch["latents"]] if batch.get("packed")
                  else [batch["latents"].shape[1:]] * batch["latents"].shape[0])
        self.last_batch_samples = len(shapes)
        # A pack's mean, so samples x tokens_per_sample is its total.
        self.tokens_per_sample = sum((t // pt) * (h // ph) * (w // pw)
                                     for _, t, h, w in shapes) // len(shapes)
        return batch

    # ---- init, checkpoints, sampling -------------------------------------------------------
    def warm_start_sources(self) -> list[WarmStartSource]:
        """The three roles from their *_init_path sources; the student drops exactly the
        weights of Stage1's second time input (the family's `second_time_keys`; the Stage2
        student is single-time), plus warm_start_allow_unexpected. Stage2 always starts this
        way."""
        args = self.args
        dropped = family_of(args).second_time_keys
        return [WarmStartSource(
            role, args[f"{role}_init_path"], args[f"{role}_init_weights"],
            tuple(args.warm_start_allow_missing),
            (*(dropped if role == "student" else ()),
             *args.warm_start_allow_unexpected)) for role in ROLES]

    def extra_state(self) -> dict:
        state = super().extra_state()
        state["student_updates"] = self.student_updates
        state["last_generator"] = dict(self.last_generator)
        state["critic_loss_start"] = self.critic_loss_start
        return state

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.student_updates = int(state.get("student_updates", 0))
        self.last_generator = dict(state.get("last_generator", {}))
        self.critic_loss_start = state.get("critic_loss_start")

    def sampling_model(self, weights: str = "live") -> nn.Module:
        return self.student


# ---- the stage's construction and kernel warm-up (its declaration names these) ----------------

def build_score_models(args, device: torch.device):
    """(teacher, critic): bidirectional single-time copies of the student's config, the teacher
    frozen, both prepared for training (compile, checkpointing) like the student."""
    from trainer.build import build_model, prepare_for_training

    config = family_of(args).bidirectional_config(model_config(args))
    teacher = build_model(args, device, config).eval().requires_grad_(False)
    critic = build_model(args, device, config)
    return prepare_for_training(teacher, args), prepare_for_training(critic, args)


def build(args, topo) -> DMDSGFStage:
    """Stage2: student, frozen teacher and critic; the student's and the critic's optimizers."""
    from trainer.build import (build_data, build_ema, build_optimization, build_text_encoder,
                               build_trained_model, distribute)

    student = build_trained_model(args, topo)
    # Sharded like the student; the frozen teacher holds no gradient and no optimizer state.
    teacher, critic = (distribute(m, topo) for m in build_score_models(args, topo.device))
    # Each schedule counts its own role's updates: the student's runs over the student updates
    # the run will make, the critic's over every outer step.
    student_steps = max(1, student_updates_through(args.max_steps, args.generator_update_interval))
    student_opt, student_sched = build_optimization(args, student, max_steps=student_steps)
    critic_opt, critic_sched = build_optimization(
        args, critic, max_steps=args.max_steps, use_muon=False,
        learning_rate=args.critic_learning_rate,
        betas=(args.critic_adam_beta1, args.critic_adam_beta2))
    encoder = build_text_encoder(args, topo.device)
    return DMDSGFStage(student, teacher, critic, {"student": student_opt, "critic": critic_opt},
                       {"student": student_sched, "critic": critic_sched}, build_ema(args, student),
                       build_data(args, topo, text_encoder=encoder), args, encoder, topo.device)


def warmup_loss(student: nn.Module, batch: dict, args, shapes: dict) -> torch.Tensor:
    """The loss of one outer step for the kernel warm-up (trainer.warmup). It holds all three
    roles in memory, as training does: the student's rollout and its replay, then the teacher
    and critic scores (generator loss) and the critic's own flow-matching loss. Random weights:
    the shapes, not the values, pick the kernels."""
    from trainer.build import build_text_encoder

    device = batch["latents"].device
    teacher, critic = build_score_models(args, device)
    stage = DMDSGFStage(student, teacher, critic, {}, {}, None, None, args,
                        build_text_encoder(args), device)
    captions = stage._captions(batch)
    x_hat, frame_mask, _ = stage.student_sample(batch, with_grad=True)
    generator, _ = stage.generator_loss(x_hat, frame_mask, captions)
    return generator + stage.critic_loss(x_hat.detach(), frame_mask, captions)
