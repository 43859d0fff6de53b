"""Counted FLOPs of one training step, for MFU, as each relay model family counts them (the `wan`
family's count is also diffusers' WanTransformer3DModel's: same config keys, same products).

Only matrix products count (linear layers, the patch embedding, the two products of each
attention); norms, activations and the optimizer are left out, as is usual for MFU. A
training step is counted as 3x the forward (the backward computes two products per forward
product), whatever activation checkpointing recomputes: MFU measures useful work.
`model_forward_flops` counts one sample; multiply by the batch.

`stage_step_flops` counts what one step of each stage objective runs, per sample, for any
family, from the family's own count of a forward (`ModelFamily.forward_flops`), read as
a + b n + c n^2 in the video tokens n (a: the caption and the time inputs; b n: every
per-token product, the video's products with the caption included; c n^2: the video's
self-attention). Attention counts the query-key pairs the mask lets through: the whole clip
for a bidirectional forward; for teacher forcing over [clean | noisy] (2n tokens) and for a
KV-cache chunk, the pairs of the block-causal chunk rule (trainer.models.attention), which a
block-sparse kernel (flex) computes and a dense masked one (SDPA) computes and discards.
"""

from __future__ import annotations

import math
from typing import Any


def model_forward_flops(family: str, config: dict[str, Any], video_tokens: int,
                        text_tokens: int) -> int:
    """Forward FLOPs of one sample of relay's model family `family` with model config `config`,
    as the family counts them (trainer.models.family.ModelFamily.forward_flops)."""
    from trainer.models.registry import get_family

    return int(get_family(family).forward_flops(config, video_tokens, text_tokens))


def train_flops(forward_flops: int) -> int:
    """Model FLOPs of one training step from its forward FLOPs (see the module docstring)."""
    return 3 * forward_flops


# ---- one step of a stage -------------------------------------------------------------------

class _Counts:
    """A family's forward count of one config as a + b n + c n^2 in the video tokens n."""

    def __init__(self, family: str, config: dict[str, Any], n: int, text_tokens: int):
        def f(tokens: int) -> float:
            return float(model_forward_flops(family, config, tokens, text_tokens))

        self.a = f(0)
        one, two = f(n) - self.a, f(2 * n) - self.a
        self.c = (two - 2 * one) / (2 * n * n)
        self.b = one / n - self.c * n
        three = f(3 * n) - self.a
        if not math.isclose(3 * self.b * n + 9 * self.c * n * n, three, rel_tol=1e-9,
                            abs_tol=1.0):
            raise ValueError(f"model family {family!r} counts a forward that is not quadratic "
                             "in the video tokens; stage_step_flops cannot split it")

    def full(self, n: int) -> float:
        """A bidirectional forward over n video tokens."""
        return self.a + self.b * n + self.c * n * n

    def teacher_forcing(self, chunks: list[int], window: int | None) -> float:
        """One forward over [clean | noisy]: 2n tokens, each chunk's queries over its keys."""
        return self.a + 2 * self.b * sum(chunks) + 2 * self.c * _chunk_pairs(chunks, window)

    def chunk(self, tokens: int, keys: int) -> float:
        """A KV-cache chunk forward (the caption's K/V are in the cache, not recomputed)."""
        return self.b * tokens + self.c * tokens * keys


def _chunk_keys(chunks: list[int], window: int | None) -> list[int]:
    """Keys each chunk's queries see under the chunk rule: itself and the `window` chunks
    before it (all before it when None)."""
    return [sum(chunks[max(0, i - window) if window is not None else 0:i + 1])
            for i in range(len(chunks))]


def _chunk_pairs(chunks: list[int], window: int | None) -> int:
    """Query-key pairs of block-causal attention over chunks of these token counts (= the
    sum of trainer.models.attention.block_causal_mask)."""
    return sum(s * k for s, k in zip(chunks, _chunk_keys(chunks, window)))


class _Step:
    """What a step runs, per sample: FLOPs, forward calls of the blocks over video, the video
    tokens those calls carry, and passes (forward calls + 2 per call with gradient)."""

    def __init__(self):
        self.flops = self.calls = self.tokens = self.passes = 0.0

    def run(self, flops: float, tokens: float, calls: float = 1.0, grad: bool = False):
        self.flops += flops * (3 if grad else 1)
        self.calls += calls
        self.tokens += tokens
        self.passes += calls * (3 if grad else 1)
        return self

    def plus(self, other: "_Step") -> "_Step":
        out = _Step()
        for key in ("flops", "calls", "tokens", "passes"):
            setattr(out, key, getattr(self, key) + getattr(other, key))
        return out

    def as_dict(self) -> dict[str, float]:
        return {"flops": self.flops, "passes": self.passes, "forward_calls": self.calls,
                "forward_tokens": self.tokens}


def _get(args, key: str, default=None):
    value = getattr(args, key, None)
    if value is None and hasattr(args, "get"):
        value = args.get(key)
    return default if value is None else value


def _latent_shape(args) -> tuple[int, int, int]:
    shape = _get(args, "expected_latent_shape")
    if shape:
        return tuple(int(x) for x in shape[-3:])
    return (int(args.synthetic_num_frames), int(args.synthetic_height), int(args.synthetic_width))


def stage_step_flops(family: str, config: dict[str, Any], args, *,
                     latent_shape: tuple[int, ...] | None = None, text_tokens: int | None = None,
                     exit_index: float | None = None) -> dict[str, Any]:
    """FLOPs and forward passes of one training step of `args.stage`, per sample (multiply by
    the samples of a step), for model family `family` with the trained model's config `config`.

    args: the run's resolved arguments (or anything with their attributes): stage,
    train_batch_size, cfg_drop_prob, anyflow_fuse_guidance_scale, dmd_denoising_steps,
    generator_update_interval, real_guidance_scale, rollout_mode, text_max_tokens and the latent
    shape (expected_latent_shape, else synthetic_num_frames / _height / _width).
    latent_shape: [..., T, H, W] latent frames and size (default: from args); text_tokens: the
    caption length every forward carries (default text_max_tokens: a batch's captions are
    padded to it; a wan model attends to every position, padding included; a dit runs its
    caption stream over them). exit_index: Stage2's rollout exit step j* (default: its mean,
    j* being uniform over the step list).

    What each stage runs (trainer/stages/):
    - fm: one forward with gradient over the clip.
    - tf_anyflow: five teacher-forcing forwards over [clean | noisy], the first with gradient,
      the fifth (the null caption's) only when guidance is fused and a micro-batch keeps a
      caption (probability 1 - cfg_drop_prob ** train_batch_size); with
      anyflow_guidance_reference: teacher that fifth call is instead the frozen teacher's
      bidirectional forward over the clip, its two branches batched (twice the tokens), once
      per causal chunk with anyflow_teacher_context: causal.
    - dmd_sgf, the critic update (every step): the student's rollout without gradient (the
      caption's K/V once; per chunk j* + 1 steps and the commit, each a KV-cache chunk
      forward) or, with rollout_mode data_latent, one teacher-forcing forward without
      gradient; then the critic's forward with gradient. The student update (every
      generator_update_interval-th step): its own rollout, the student's teacher-forcing
      replay with gradient, the teacher's forward (its CFG pair batched into one call: twice
      the tokens, when real_guidance_scale != 0) and the critic's, without gradient.

    Returns video_tokens, text_tokens, forward_flops (a bidirectional forward of `config` over
    the clip), flops_per_sample and passes (a step; for dmd_sgf averaged over outer steps) and
    steps: {"step": ...} or, for dmd_sgf, {"critic": the critic-only step, "student": a step
    that also updates the student}, each {flops, passes, forward_calls, forward_tokens}.
    """
    from trainer.models.registry import get_family

    fam = get_family(family)
    frames, height, width = (tuple(latent_shape) if latent_shape is not None
                             else _latent_shape(args))[-3:]
    pt, ph, pw = fam.geometry(config).patch_size
    per_frame = (height // ph) * (width // pw)
    n = (frames // pt) * per_frame
    length = int(text_tokens if text_tokens is not None else _get(args, "text_max_tokens"))
    counts = _Counts(family, config, n, length)
    stage = args.stage
    geometry = fam.geometry(config)
    chunk_frames = geometry.causal_chunk_frames
    window = config.get("attn_window_chunks")
    chunks = ([((min(start + chunk_frames, frames) - start) // pt) * per_frame
               for start in range(0, frames, chunk_frames)] if chunk_frames else [])
    out: dict[str, Any] = {"stage": stage, "video_tokens": n, "text_tokens": length,
                           "forward_flops": counts.full(n)}
    if stage == "fm":
        step = _Step().run(counts.full(n), n, grad=True)
        out.update(flops_per_sample=step.flops, passes=step.passes, steps={"step": step.as_dict()})
        return out
    if not chunks:
        raise ValueError(f"stage {stage} needs a causal config (causal chunks)")
    tf = counts.teacher_forcing(chunks, window)
    if stage == "tf_anyflow":
        fused = 0.0
        if float(_get(args, "anyflow_fuse_guidance_scale", 1.0)) != 1.0:
            fused = 1.0 - float(_get(args, "cfg_drop_prob", 0.0)) ** int(
                _get(args, "train_batch_size", 1))
        step = _Step().run(tf, 2 * n, grad=True).run(3 * tf, 6 * n, calls=3)
        if _get(args, "anyflow_guidance_reference", "student") == "teacher":
            teacher = _Counts(family, fam.bidirectional_config(config), n, length)
            views = len(chunks) if _get(args, "anyflow_teacher_context", "clip") == "causal" else 1
            step = step.run(fused * views * 2 * teacher.full(n), fused * views * 2 * n,
                            calls=fused * views)
        else:
            step = step.run(fused * tf, fused * 2 * n, calls=fused)
        out.update(flops_per_sample=step.flops, passes=step.passes, steps={"step": step.as_dict()})
        return out
    if stage != "dmd_sgf":
        raise ValueError(f"unknown stage objective {stage!r}")
    bidirectional = fam.bidirectional_config(config)
    critic = _Counts(family, bidirectional, n, length)
    steps = len(_get(args, "dmd_denoising_steps"))
    j = (steps - 1) / 2 if exit_index is None else float(exit_index)
    per_chunk = j + 2  # steps 0..j* and the commit

    simulate = _get(args, "rollout_mode", "simulate") != "data_latent"

    def rollout() -> _Step:
        keys = _chunk_keys(chunks, window)
        chunk_flops = sum(counts.chunk(s, k) for s, k in zip(chunks, keys))
        # the caption's K/V into the cache (a caption-only call, no video), then the chunks
        return _Step().run(counts.a, 0, calls=0).run(per_chunk * chunk_flops, per_chunk * n,
                                                      calls=per_chunk * len(chunks))

    guided = float(_get(args, "real_guidance_scale", 0.0)) != 0.0
    # data_latent: no rollout; the critic's sample is the replay without gradient
    critic_update = (rollout() if simulate else _Step().run(tf, 2 * n)).run(
        critic.full(n), n, grad=True)
    student_update = ((rollout() if simulate else _Step())
                      .run(tf, 2 * n, grad=True)
                      .run((2 if guided else 1) * critic.full(n), (2 if guided else 1) * n)
                      .run(critic.full(n), n))
    student_step = student_update.plus(critic_update)
    interval = int(_get(args, "generator_update_interval", 1))
    out.update(flops_per_sample=critic_update.flops + student_update.flops / interval,
               passes=critic_update.passes + student_update.passes / interval,
               steps={"critic": critic_update.as_dict(), "student": student_step.as_dict()})
    return out


def stage_step_flops_of(args, **kwargs) -> dict[str, Any]:
    """stage_step_flops for a run's resolved arguments: its family and model config."""
    from trainer.models.registry import family_of, model_config

    return stage_step_flops(family_of(args).name, model_config(args), args, **kwargs)
