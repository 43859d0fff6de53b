"""Checker-free sample statistics (trainer.evaluation.sample_stats): the motion and contrast the
health gate watches read a static video and a colour flood as such, on the generator's clips."""

from __future__ import annotations

import numpy as np

from trainer.data import synthetic_bench as bench
from trainer.encoders.vae import latents_to_frames
from trainer.evaluation.sample_stats import clip_statistics


def generator_clips(count: int = 8) -> np.ndarray:
    scenes = [bench.make_scene(5, i, num_frames=16, height=32, width=32)[0] for i in range(count)]
    return np.stack([latents_to_frames(bench.render_scene(s, num_frames=16, height=32, width=32))
                     for s in scenes])


def test_moving_clips_have_motion_and_contrast_that_collapses_read_near_zero():
    clips = generator_clips()
    moving = clip_statistics(clips)
    assert moving["motion"] > 0.005 and moving["contrast"] > 0.05, moving

    static = clips[:, :1].repeat(clips.shape[1], axis=1)  # every frame the first one
    frozen = clip_statistics(static)
    assert frozen["motion"] == 0.0
    assert frozen["contrast"] > 0.05  # a static video still has its picture

    flood = np.broadcast_to(clips.reshape(len(clips), -1, 3).mean(axis=1).astype(np.uint8)
                            [:, None, None, None], clips.shape)  # each clip its mean colour
    flooded = clip_statistics(np.ascontiguousarray(flood))
    assert flooded["contrast"] < 1e-6 and flooded["motion"] == 0.0

    # a slight flicker over a flood moves a little but keeps no picture: contrast catches it
    noisy = flood.astype(np.int16) + np.random.default_rng(0).integers(-2, 3, flood.shape)
    flicker = clip_statistics(np.clip(noisy, 0, 255).astype(np.uint8))
    assert flicker["contrast"] < 0.2 * moving["contrast"]
