"""Validation during training: sample fixed captions, score them, keep the videos.

Every `validation_interval` steps (and at the end of the run) rank 0 samples a fixed, seeded
subset of the evaluation captions with the stage's own sampler, for the live weights and/or
the EMA (under FSDP every rank samples too, since each forward gathers the sharded blocks,
but only rank 0 decodes, scores and writes), and writes

    samples/step-<N>/grid.png              every caption's clip, captioned, one block per weights
    samples/step-<N>/<weights>/grid.png    one row of frames per caption
    samples/step-<N>/<weights>/frames.npy  uint8 [captions, T, H, W, 3]
    samples/step-<N>/<weights>/clip-<i>.mp4|gif
    (clips decoded through the VAE at vae_path when it is set; else latents are pixels)
    samples/step-<N>/manifest.json         written last: captions, sampler, scores, files

The scores, and the clips' checker-free motion and contrast (trainer.evaluation.sample_stats),
go into that step's metrics.jsonl record. A validation that fails is logged as an
error and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("relay")


@dataclasses.dataclass(frozen=True)
class ValidationSettings:
    """The keys validation reads, typed once per run: when it runs, which captions and weights,
    the seed, the compute dtype and VAE of the samples, and the stage's sampling plan (asked
    once: trainer.stages.declaration.SamplingPlan)."""

    interval: int            # validation_interval: < 0 never, 0 at the last step only
    max_steps: int
    num_captions: int
    seed: int
    weights: str             # validation_weights: live | ema | both
    generator: str           # synthetic_generator: whose captions and checker
    dtype: str
    vae_path: str | None
    stage: str
    plan: object             # SamplingPlan

    @classmethod
    def of(cls, args) -> "ValidationSettings":
        from trainer.stages.registry import sampling_plan

        return cls(interval=args.validation_interval, max_steps=args.max_steps,
                   num_captions=args.validation_num_captions, seed=args.validation_seed,
                   weights=args.validation_weights,
                   generator=args.get("synthetic_generator", "shapes"), dtype=args.dtype,
                   vae_path=args.vae_path, stage=args.stage, plan=sampling_plan(args))

    def due(self, step: int) -> bool:
        """Whether `step` validates: every `interval` steps and at the last step."""
        if self.interval < 0:
            return False
        if step == self.max_steps:
            return True
        return self.interval > 0 and step % self.interval == 0


def validation_captions(count: int, generator: str = "shapes") -> list[str]:
    """`count` captions spread evenly over the generator's fixed evaluation set (for the
    default: all colours, directions)."""
    from trainer.evaluation.evaluate import evaluation_suite

    captions = evaluation_suite(generator)[0]
    count = max(1, min(count, len(captions)))
    stride = len(captions) / count
    # An odd stride through colour x direction x shape order visits every colour and direction.
    picks = [captions[int(i * stride)] for i in range(count)]
    return picks


def run_validation(stage, settings: ValidationSettings, step: int, output_dir: Path,
                   latent_shape, main: bool = True) -> dict:
    """Sample, score and save; returns metrics {"val/<weights>/colour_accuracy": ...}.

    main=False only samples and returns {}: the other ranks of a sharded model, which must take
    part in every forward (the blocks' all-gathers) but leave the VAE decode, the pixel checks
    and the files to the main rank, whose samples are the same (one seeded generator).
    """
    from trainer.evaluation.evaluate import summary_scores
    from trainer.evaluation.sample_stats import clip_statistics

    started = time.perf_counter()
    generator = settings.generator
    captions = validation_captions(settings.num_captions, generator)
    out = output_dir / "samples" / f"step-{step}"
    manifest = {"step": step, "stage": settings.stage, "captions": captions,
                "sampler_steps": settings.plan.steps, "guidance": settings.plan.guidance,
                "seed": settings.seed, "weights": {}}
    # Every set of weights is sampled before anything is decoded: a decode that fails on the
    # main rank must not leave the others waiting in a forward it no longer runs.
    sampled = list(_sample_each_weights(stage, settings, captions, latent_shape))
    if not main:
        return {}
    from trainer.runtime.files import write_json
    from trainer.evaluation.media import write_validation_grid

    metrics, blocks = {}, []
    for weights, latents in sampled:
        clips, scores, files = _decode_and_score(settings, latents, captions, out / weights)
        # the checker's scores, and what any data shows (the health gate's collapse checks)
        summary = {**summary_scores(scores), **clip_statistics(clips)}
        manifest["weights"][weights] = {**summary, "per_caption": scores["per_caption"],
                                        "files": files}
        metrics.update({f"val/{weights}/{k}": v for k, v in summary.items()})
        blocks.append(_grid_block(output_dir.name, step, weights, clips, captions, scores))
    out.mkdir(parents=True, exist_ok=True)
    manifest["grid"] = str(write_validation_grid(out / "grid.png", blocks))
    write_json(out / "manifest.json", manifest)
    seconds = time.perf_counter() - started
    # scores are fractions; motion and contrast are small pixel statistics that a percentage
    # would round to 0 or 1 just where a collapse shows
    shown = [f"{k} {v:.4f}" if k.endswith(("/motion", "/contrast")) else f"{k} {v:.0%}"
             for k, v in metrics.items()]
    log.info("validation step %d: %s -> %s (%.1f s)", step, ", ".join(shown), out, seconds)
    # What validation costs the run: docs/training.md breaks a run's time down with it.
    metrics["val/seconds"] = seconds
    return metrics


def _sample_each_weights(stage, settings: ValidationSettings, captions: list[str],
                         latent_shape):
    """(weights name, sampled latents [captions, C, T, H, W]) for each validated set of
    weights, with the stage's sampler and settings (`settings.plan`); the model is in eval
    mode while sampling and back in its mode between yields."""
    from trainer.stages.base import autocast_context

    model = stage.sampling_model()
    device = next(model.parameters()).device
    text, mask = stage.text_encoder.encode(captions)
    null_text, null_mask = stage.text_encoder.null_embedding()
    plan = settings.plan
    sampler = plan.load_sampler()
    for weights, context in _weight_contexts(stage, model, settings.weights):
        was_training = model.training
        model.eval()
        try:
            # the training step's compute dtype: a float32 sample of a real-size clip runs
            # the attention at float32 (minutes at Wan2.1-1.3B's 32,760 tokens)
            with context, autocast_context(device, settings.dtype):
                latents = sampler(model, text.to(device), mask.to(device), null_text.to(device),
                                  null_mask.to(device), shape=(len(captions), *latent_shape),
                                  steps=plan.steps, guidance=plan.guidance, shift=plan.shift,
                                  generator=torch.Generator().manual_seed(settings.seed))
        finally:
            model.train(was_training)
        yield weights, latents


def _decode_and_score(settings: ValidationSettings, latents, captions: list[str], out: Path):
    """(uint8 clips, the pixel checker's report, the files written under `out`)."""
    from trainer.evaluation.evaluate import evaluation_suite
    from trainer.evaluation.media import write_validation_files
    from trainer.encoders.vae import latents_to_clips

    clips = latents_to_clips(latents, settings.vae_path)
    scores = evaluation_suite(settings.generator)[1](clips, captions)
    return clips, scores, write_validation_files(clips, out)


def _grid_block(run: str, step: int, weights: str, clips, captions, scores):
    from trainer.evaluation.media import GridBlock, detection_verdicts

    title = (f"{run} step {step}, {weights} weights: colour {scores['colour_accuracy']:.0%}, "
             f"direction {scores['direction_accuracy']:.0%}")
    if "shape_accuracy" in scores:  # the benchmark's checker
        title += f", shape {scores['shape_accuracy']:.0%}, mean {scores['mean_score']:.0%}"
    return GridBlock(title=title, clips=clips, labels=captions,
                     verdicts=detection_verdicts(scores["per_caption"]))


def _weight_contexts(stage, model, which: str):
    import contextlib

    ema = next(iter(stage.emas.values()), None) if stage.emas else None
    if which in ("live", "both"):
        yield "live", contextlib.nullcontext()
    if which in ("ema", "both") and ema is not None:
        yield "ema", ema.swapped_in(model)
