"""The causal student's rollout: step lists, the chunked KV-cache rollout, its teacher-forcing
replay, and the Stage2 sampler (docs/algorithms.md, "Step list", "Rollout and KV cache", "Student sampler").

A rollout makes a clip chunk by chunk (the causal chunk of the model's geometry, in latent
frames). Every chunk starts from noise and runs the step list sigma_0 > sigma_1 > ... with the
student's x0 prediction x0 = x - sigma * F, re-noising to the next step with fresh noise, until the exit
step j*: its x0 prediction is the chunk's output. That output is then committed (run at
t = 0, K/V appended to the cache, detached) so later chunks see it. The sampler is the same
loop with j* = the last step.

Training (SolarWM's two-pass form): `simulate_rollout` runs the whole loop without gradient
and records, per chunk, the input at the exit step (`noisy_at_exit`) and the committed x0;
`replay_exit` then recomputes every chunk's exit prediction with gradient in one
teacher-forcing forward, clean half = the committed x0s. Its values equal the reference
(Self-Forcing: the exit forward of each chunk with grad, on a detached cache). Its gradient
is the reference's plus the path through the context: the clean half's and the caption's
K/V are recomputed with grad in the replay (the model has no switch to detach them), so the
student also learns how its encoding of earlier chunks shapes later ones. That extra term is
part of the full (back-propagated-through-time) gradient, which the reference cuts entirely.
docs/stages.md records the choice; tests pin which parameters see which gradient.

Image conditioning: with `anchored` [B] bool and `anchor` [B, C, 1, H, W], frame 0 of an
anchored sample is the clean anchor at t = 0 everywhere (in every forward, in the output).

Packs (samples of different shapes): `simulate_packed_rollout` and `replay_exit_packed` do the
same per sample, the model running the pack at once through a packed KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.diffusion import flow
from trainer.diffusion.sample_draws import SampleDraws

N = flow.NUM_TRAIN_TIMESTEPS


# ---- step lists (docs/algorithms.md, "Step list") -------------------------------------------

def warp_denoising_steps(raw_steps, shift: float) -> list[float]:
    """The raw steps moved onto the shifted timestep table: a -> table'[N - a].

    table'[i] = N * S(1 - i/N; shift) for i < N and table'[N] = 0 ("Shift"), so for an integer
    a in [0, N] the warped value is N * S(a / N; shift); that closed form is what is computed
    (float64). Returns floats in raw units, e.g. [1000, 750, 500, 250] with shift 5 ->
    [1000, 937.5, 833.33.., 625]. Raises ValueError for a step outside [0, N] or shift <= 0.
    """
    out = []
    for a in raw_steps:
        if not 0 <= a <= N:
            raise ValueError(f"denoising step {a} lies outside [0, {N}]")
        out.append(float(N * flow.shift_sigma(float(a) / N, shift)))
    return out


def rollout_sigmas(raw_steps, shift: float, warp: bool) -> list[float]:
    """Normalised noise levels of the training rollout: the (warped) raw steps / N."""
    steps = warp_denoising_steps(raw_steps, shift) if warp else [float(a) for a in raw_steps]
    return [s / N for s in steps]


def inference_sigmas(steps: int, shift: float) -> list[float]:
    """Noise levels of a `steps`-step student sample: N (1 - k/steps), k < steps, warped.

    steps = 4 gives warp([1000, 750, 500, 250]); the values equal the FM sampler's grid
    S(1 - k/steps; shift) without its final 0. Raises ValueError when steps < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return [float(flow.shift_sigma(1.0 - k / steps, shift)) for k in range(steps)]


def sample_exit_index(num_steps: int, generator: torch.Generator | None = None) -> int:
    """The exit step j* ~ U{0 .. num_steps - 1}, one for the whole rollout (all chunks)."""
    return int(torch.randint(num_steps, (1,), generator=generator))


# ---- anchors and times ----------------------------------------------------------------------

def apply_anchor(x: torch.Tensor, anchor: torch.Tensor | None,
                 anchored: torch.Tensor | None) -> torch.Tensor:
    """x [B, C, T, H, W] with frame 0 replaced by the anchor where `anchored` (no grad path)."""
    if anchored is None or not bool(anchored.any()):
        return x
    keep = anchored.to(x.device)[:, None, None, None, None]
    first = torch.where(keep, anchor.to(x), x[:, :, :1])
    return torch.cat([first, x[:, :, 1:]], dim=2)


def frame_sigmas(sigma, batch: int, frames: int, anchored: torch.Tensor | None,
                 frame_start: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """Noise level per frame [B, frames]: `sigma` (float or [B]), 0 on anchored frame 0."""
    s = torch.as_tensor(sigma, device=device).to(dtype)
    s = (s.reshape(-1, 1) if s.ndim == 1 else s.reshape(1, 1)).expand(batch, frames).clone()
    if anchored is not None and frame_start == 0:
        s[:, 0] = torch.where(anchored.to(s.device), torch.zeros_like(s[:, 0]), s[:, 0])
    return s


def _time_dtype(x: torch.Tensor) -> torch.dtype:
    # float64 inputs (tests) keep float64 times; everything else computes times in float32
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def loss_frame_mask(anchored: torch.Tensor | None, batch: int, frames: int,
                    device=None) -> torch.Tensor:
    """bool [B, T]: the frames that enter the losses (all but an anchored frame 0)."""
    mask = torch.ones(batch, frames, dtype=torch.bool, device=device)
    if anchored is not None:
        mask[:, 0] = ~anchored.to(mask.device)
    return mask


def _randn(shape, like: torch.Tensor, generator) -> torch.Tensor:
    """Gaussian noise like `like`: from the global RNG, from `generator` (drawn on its
    device, then moved) so seeded samples do not depend on the compute device, or from each
    sample's own stream when `generator` is a SampleDraws (training: split-independent)."""
    if generator is None:
        return torch.randn(shape, device=like.device, dtype=like.dtype)
    if isinstance(generator, SampleDraws):
        return generator.normal_like(like)
    return torch.randn(shape, generator=generator, device=generator.device).to(like)


# ---- the cached student -----------------------------------------------------------------------

class CachedStudent:
    """A causal model with a KV cache over one caption batch, optionally guided.

    guidance w != 1 runs the conditional and the null-caption branch as one doubled batch
    with a doubled cache (each branch commits the same chunk into its own cache half, because
    a committed chunk's deeper K/V depend on the caption it was run with) and returns the
    standard CFG velocity u + w (c - u). Built in the caller's grad mode (no_grad for a
    detached cache).
    """

    def __init__(self, model: nn.Module, text: torch.Tensor, text_mask: torch.Tensor | None,
                 null_text: torch.Tensor | None = None, null_mask: torch.Tensor | None = None,
                 guidance: float = 1.0):
        self.model = model
        self.guidance = float(guidance)
        self.guided = self.guidance != 1.0
        if self.guided:
            if null_text is None:
                raise ValueError("guidance != 1 needs the null caption (null_text, null_mask)")
            text, text_mask = _with_null_caption(text, text_mask, null_text, null_mask)
        self.cache = model.new_kv_cache(text, text_mask)

    @property
    def next_frame(self) -> int:
        return self.cache.next_frame

    def velocity(self, x: torch.Tensor, t_raw: torch.Tensor) -> torch.Tensor:
        """The (guided) prediction [B, C, Tc, H, W] for the next chunk x at raw times t_raw."""
        start = self.cache.next_frame
        if not self.guided:
            return self.model.forward_chunk(x, t_raw, self.cache, start)
        both = self.model.forward_chunk(torch.cat([x, x]), torch.cat([t_raw, t_raw]),
                                        self.cache, start)
        cond, uncond = both.chunk(2)
        return uncond + self.guidance * (cond - uncond)

    @torch.no_grad()
    def commit(self, x0: torch.Tensor) -> None:
        """Append the clean chunk x0 (at t = 0, detached) to the cache."""
        x0 = x0.detach()
        self.model.commit_chunk(torch.cat([x0, x0]) if self.guided else x0, self.cache,
                                self.cache.next_frame)


def _with_null_caption(text, mask, null_text, null_mask):
    """[text ; null caption repeated] and their masks, padded to one length."""
    b = text.shape[0]
    null_text = null_text.to(text).reshape(1, -1, text.shape[-1]).expand(b, -1, -1)
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
    null_mask = null_mask.to(mask.device).reshape(1, -1).expand(b, -1)
    length = max(text.shape[1], null_text.shape[1])

    def pad(x, fill):
        if x.shape[1] == length:
            return x
        extra = torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill,
                           dtype=x.dtype, device=x.device)
        return torch.cat([x, extra], dim=1)

    return (torch.cat([pad(text, 0), pad(null_text, 0)]),
            torch.cat([pad(mask, False), pad(null_mask, False)]))


# ---- the rollout ("Rollout and KV cache") ------------------------------------------------------

@dataclass
class Rollout:
    """What a rollout leaves: per-chunk inputs at the exit step and the outputs.

    noisy_at_exit, output: [B, C, T, H, W]. `output` is the exit-step x0 prediction of every
    chunk (what was committed); it carries grad only from `simulate_rollout(grad_at_exit=True)`.
    exit_index: j*; sigmas: the step list used.
    """

    noisy_at_exit: torch.Tensor
    output: torch.Tensor
    exit_index: int
    sigmas: list[float]


def simulate_rollout(student: CachedStudent, noise: torch.Tensor, sigmas: list[float],
                     exit_index: int, *, anchor: torch.Tensor | None = None,
                     anchored: torch.Tensor | None = None,
                     generator: torch.Generator | SampleDraws | None = None,
                     grad_at_exit: bool = False) -> Rollout:
    """Roll the student out chunk by chunk from `noise` [B, C, T, H, W] ("Rollout and KV cache", the reference loop).

    Every forward runs without gradient, except each chunk's exit forward when grad_at_exit
    (the Self-Forcing reference; training uses False and `replay_exit`). Re-noising draws from
    `generator` (or the global RNG). The cache must be empty (build the CachedStudent under
    torch.no_grad() for the reference's detached cache); it holds every chunk afterwards.
    Returns a Rollout. Raises ValueError for an exit index outside the step list.
    """
    if not 0 <= exit_index < len(sigmas):
        raise ValueError(f"exit index {exit_index} outside the {len(sigmas)}-step list")
    chunk = student.model.geometry.causal_chunk_frames
    b, _, frames = noise.shape[:3]
    noisy_parts, outputs = [], []
    for start in range(0, frames, chunk):
        x = noise[:, :, start:start + chunk]
        x = apply_anchor(x, anchor, anchored) if start == 0 else x
        x_at_exit, x0 = _denoise_chunk(student, x, sigmas, exit_index, start, anchor, anchored,
                                       generator, grad_at_exit)
        noisy_parts.append(x_at_exit)
        outputs.append(x0)
        student.commit(x0)
    return Rollout(torch.cat(noisy_parts, dim=2), torch.cat(outputs, dim=2), exit_index,
                   list(sigmas))


def _denoise_chunk(student: CachedStudent, x, sigmas, exit_index, start, anchor, anchored,
                   generator, grad_at_exit):
    """Steps 0..j* of one chunk: (input at step j*, x0 prediction at step j*)."""
    b, frames = x.shape[0], x.shape[2]
    anchored_here = anchored if start == 0 else None
    for j, sigma in enumerate(sigmas):
        at_exit = j == exit_index
        s = frame_sigmas(sigma, b, frames, anchored_here, device=x.device,
                         dtype=_time_dtype(x))
        with torch.set_grad_enabled(grad_at_exit and at_exit):
            v = student.velocity(x, s * N).to(x.dtype)  # bf16 under autocast -> x's dtype
            x0 = flow.x0_from_velocity(x, s, v)
            x0 = apply_anchor(x0, anchor, anchored_here)
        if at_exit:
            return x, x0
        nxt = sigmas[j + 1]
        x = flow.interpolate(x0, _randn(x0.shape, x0, generator), nxt)
        x = apply_anchor(x, anchor, anchored_here)
    raise AssertionError("unreachable: the exit index is checked by simulate_rollout")


def replay_exit(model: nn.Module, noisy_at_exit: torch.Tensor, clean: torch.Tensor,
                sigma: float, text: torch.Tensor, text_mask: torch.Tensor | None, *,
                anchor: torch.Tensor | None = None,
                anchored: torch.Tensor | None = None) -> torch.Tensor:
    """Every chunk's exit x0 prediction in one teacher-forcing forward, in the caller's grad
    mode: x_hat = noisy - sigma * F_TF(noisy | clean context), anchored frame 0 = anchor.

    `clean` (the committed chunks, or data latents in data_latent mode) is detached here; the
    clean half's K/V are recomputed from it with the current weights (see the module
    docstring). Returns x_hat [B, C, T, H, W] in noisy_at_exit's dtype.
    """
    b, _, frames = noisy_at_exit.shape[:3]
    s = frame_sigmas(sigma, b, frames, anchored, device=noisy_at_exit.device,
                     dtype=_time_dtype(noisy_at_exit))
    v = model.forward_teacher_forcing(noisy_at_exit, clean.detach(), s * N, text, text_mask)
    x_hat = flow.x0_from_velocity(noisy_at_exit, s, v.to(noisy_at_exit.dtype))
    return apply_anchor(x_hat, anchor, anchored)


# ---- the Stage2 sampler --------------------------------------------------------------------------

@torch.no_grad()
def sample_student(model: nn.Module, text: torch.Tensor, text_mask: torch.Tensor,
                   null_text: torch.Tensor, null_mask: torch.Tensor, *, shape: tuple[int, ...],
                   steps: int, guidance: float, shift: float = 1.0,
                   generator: torch.Generator | None = None,
                   first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """A clip from the causal student: the KV-cache rollout with j* = the last step.

    Steps: `inference_sigmas(steps, shift)` (steps = 4: [1000, 750, 500, 250] warped by
    `shift`), `steps` function evaluations per chunk plus one commit. guidance: standard CFG
    u + w (c - u); w = 1 (conditional only) is the distilled student's setting. first_frame
    [B, C, 1, H, W]: kept clean at t = 0 as frame 0. Noise comes from the CPU `generator`, so
    results do not depend on the device. Returns latents [B, C, T, H, W].
    Raises ValueError for a non-causal model or steps < 1.
    """
    if getattr(model, "geometry", None) is None or model.geometry.causal_chunk_frames is None:
        raise ValueError("sample_student needs a causal model (a config with causal chunks)")
    sigmas = inference_sigmas(steps, shift)
    device = text.device
    noise = torch.randn(shape, generator=generator).to(device)
    anchored = anchor = None
    if first_frame is not None:
        anchor = first_frame.to(noise)
        anchored = torch.ones(shape[0], dtype=torch.bool, device=device)
    student = CachedStudent(model, text, text_mask, null_text, null_mask, guidance)
    out = simulate_rollout(student, noise, sigmas, len(sigmas) - 1, anchor=anchor,
                           anchored=anchored, generator=generator)
    return out.output


# ---- the rollout over a pack (Stage2 on packs) ----------------------------------------------

@dataclass
class PackedRollout:
    """A rollout over a pack: per sample [1, C, T_i, H_i, W_i] as Rollout's fields."""

    noisy_at_exit: list[torch.Tensor]
    output: list[torch.Tensor]
    exit_index: int


def simulate_packed_rollout(model: nn.Module, noises: list[torch.Tensor], texts, text_masks,
                            sigmas: list[float], exit_index: int, *,
                            anchors: list[torch.Tensor | None], anchored: list[torch.Tensor | None],
                            draws: list[SampleDraws], rounds: int) -> PackedRollout:
    """simulate_rollout (grad_at_exit False) for the samples of a pack at once, without
    gradient: noises[i] [1, C, T_i, H_i, W_i], texts[i] [L_i, D] (bool masks [L_i]); each
    sample's re-noising draws from its own draws[i] (anchors / anchored as simulate_rollout's,
    per sample). Round c runs chunk c of every sample that has one through one packed KV cache
    (the packed chunk call, forward_chunk_packed), so each sample gets what its own rollout gives. `rounds`
    (>= the pack's chunks) is what every rank of a sharded model runs: a round with no chunk
    left runs the same forwards on a placeholder chunk and drops them (trainer.parallel.distributed.
    max_across_ranks agrees on it). Raises ValueError for an exit index outside the list.
    """
    if not 0 <= exit_index < len(sigmas):
        raise ValueError(f"exit index {exit_index} outside the {len(sigmas)}-step list")
    chunk = model.geometry.causal_chunk_frames
    with torch.no_grad():
        cache = model.new_packed_kv_cache(list(texts), list(text_masks))
        noisy_parts = [[] for _ in noises]
        outputs = [[] for _ in noises]
        for c in range(rounds):
            start = c * chunk
            active = [i for i, x in enumerate(noises) if x.shape[2] > start]
            if not active:
                _idle_round(model, noises[0][0, :, :chunk], texts[0], text_masks[0],
                            forwards=exit_index + 2)  # the steps to the exit, and the commit
                continue
            xs = [noises[i][:, :, start:start + chunk] for i in active]
            xs = [apply_anchor(x, anchors[i], anchored[i]) if start == 0 else x
                  for x, i in zip(xs, active)]
            x_at_exit, x0s = _denoise_packed_chunk(model, cache, xs, active, sigmas, exit_index,
                                                   start, anchors, anchored, draws)
            for i, x, x0 in zip(active, x_at_exit, x0s):
                noisy_parts[i].append(x)
                outputs[i].append(x0)
            model.commit_chunk_packed([x0[0] for x0 in x0s], cache, active)
    return PackedRollout([torch.cat(p, dim=2) for p in noisy_parts],
                         [torch.cat(o, dim=2) for o in outputs], exit_index)


def _denoise_packed_chunk(model, cache, xs, active, sigmas, exit_index, start, anchors, anchored,
                          draws):
    """_denoise_chunk for the chunks xs ([1, C, Tc_i, H_i, W_i]) of the samples `active`."""
    for j, sigma in enumerate(sigmas):
        here = [anchored[i] if start == 0 else None for i in active]
        s = [frame_sigmas(sigma, 1, x.shape[2], a, device=x.device, dtype=_time_dtype(x))
             for x, a in zip(xs, here)]
        v = model.forward_chunk_packed([x[0] for x in xs], [si[0] * N for si in s], cache, active)
        x0s = [apply_anchor(flow.x0_from_velocity(x, si, vi[None].to(x.dtype)), anchors[i], a)
               for x, si, vi, i, a in zip(xs, s, v, active, here)]
        if j == exit_index:
            return xs, x0s
        xs = [apply_anchor(flow.interpolate(x0, _randn(x0.shape, x0, draws[i]), sigmas[j + 1]),
                           anchors[i], a) for x0, i, a in zip(x0s, active, here)]
    raise AssertionError("unreachable: the exit index is checked by simulate_packed_rollout")


def _idle_round(model, placeholder: torch.Tensor, text, text_mask, *, forwards: int) -> None:
    """`forwards` forwards whose outputs are dropped: a rank whose pack has no chunk left still
    takes part in the sharded model's all-gathers of the others' rounds. A packed forward of
    one placeholder chunk gathers what a chunk forward gathers (the root, then each block's
    modulation and the block); the finished samples' caches allow no further chunk."""
    for _ in range(forwards):
        model.forward_packed([torch.zeros_like(placeholder)], [0.0], [text], [text_mask])


def replay_exit_packed(model: nn.Module, noisys: list[torch.Tensor], cleans: list[torch.Tensor],
                       sigma: float, texts, text_masks, *, anchors, anchored) -> list[torch.Tensor]:
    """replay_exit over a pack, in one packed teacher-forcing forward in the caller's grad mode:
    each x_hat [1, C, T_i, H_i, W_i] equals replay_exit on that sample alone."""
    s = [frame_sigmas(sigma, 1, n.shape[2], a, device=n.device, dtype=_time_dtype(n))
         for n, a in zip(noisys, anchored)]
    v = model.forward_teacher_forcing_packed([n[0] for n in noisys],
                                             [c[0].detach() for c in cleans],
                                             [si[0] * N for si in s], list(texts), list(text_masks))
    return [apply_anchor(flow.x0_from_velocity(n, si, vi[None].to(n.dtype)), a_x, a)
            for n, si, vi, a_x, a in zip(noisys, s, v, anchors, anchored)]
