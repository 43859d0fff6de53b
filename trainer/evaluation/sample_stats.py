"""What any sampled clip shows without a checker: how much it moves and how much a frame varies.

The pixel checker (trainer.evaluation.scene_checker) knows the embedded datasets only; on a
user's own data (a Wan fine-tune, say) it scores nothing. Two collapses of distillation are
visible in the pixels of any data, and the health gate (trainer.runtime.health) watches them:
- a static video: every frame the same, `motion` (the mean absolute change of a pixel from one
  frame to the next, over [0, 1] pixel values) falls toward 0;
- a colour flood: frames of one colour, `contrast` (the spread of a frame's pixel values, its
  standard deviation per channel, averaged over frames and clips) falls toward 0.
"""

from __future__ import annotations

import numpy as np


def clip_statistics(clips: np.ndarray) -> dict[str, float]:
    """{"motion", "contrast"} of uint8 clips [N, T, H, W, 3] (module docstring), averaged over
    the clips. One clip at a time in float32: a Wan clip (81 frames of 832x480) is 390 MB so."""
    motion, contrast = [], []
    for clip in clips:
        frames = clip.astype(np.float32) / 255.0
        motion.append(float(np.abs(np.diff(frames, axis=0)).mean()) if len(frames) > 1 else 0.0)
        contrast.append(float(frames.reshape(len(frames), -1, frames.shape[-1]).std(axis=1).mean()))
    return {"motion": float(np.mean(motion)), "contrast": float(np.mean(contrast))}
