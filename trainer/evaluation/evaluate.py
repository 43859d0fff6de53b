"""The pixel evaluator: does a generated clip show the caption's colour and motion?

This is the number users trust, so it is deliberately plain and strict:
- foreground = pixels whose brightest channel is above a threshold (the background is black);
- colour = the reference colour nearest to the mean foreground colour, after scaling that mean
  so its brightest channel is 1 (anti-aliased edges and dim samples keep their hue), and only
  if it is close enough: a grey or orange blob is no colour, not the nearest one;
- direction = the sign of the least-squares slope of the foreground centroid over time on the
  dominant axis, and only if the motion is real (enough displacement), one-directional (the
  dominant axis clearly beats the other) and steady (the straight-line fit explains most of
  the centroid's variance). A clip whose frames jump back and forth does not "move left".
It knows nothing about the model; it reads uint8 frames [T, H, W, 3].

The benchmark's scenes (trainer.data.synthetic_bench) have a checker of their own,
trainer.evaluation.scene_checker; `evaluation_suite` picks the captions and checker of a run's generator.
"""

from __future__ import annotations

import itertools

import numpy as np

from trainer.data.synthetic import COLOUR_RGB, COLOURS, DIRECTIONS, SHAPES, make_caption
from trainer.encoders.text import tokenize

# Every colour x direction x shape, in a fixed order: 48 captions.
EVAL_CAPTIONS = tuple(
    make_caption(shape, colour, direction)
    for colour, direction, shape in itertools.product(COLOURS, DIRECTIONS, SHAPES)
)

_REFERENCE_NAMES = list(COLOUR_RGB)
_REFERENCE_RGB = np.asarray([COLOUR_RGB[c] for c in _REFERENCE_NAMES], dtype=np.float64) / 255.0


def evaluation_suite(generator: str = "shapes"):
    """(the fixed evaluation captions, the scoring function) of a synthetic generator: the 48
    captions and score_clips for "shapes", the benchmark's 64 captions and
    trainer.evaluation.scene_checker.score_scenes for "bench". Both scorers take (clips, captions)."""
    if generator == "bench":
        from trainer.evaluation.scene_checker import score_scenes
        from trainer.data.synthetic_bench import eval_captions

        return eval_captions(), score_scenes
    return EVAL_CAPTIONS, score_clips


def summary_scores(report: dict) -> dict[str, float]:
    """The headline numbers of a score report: every top-level float (accuracies, mean_score,
    fidelity, ...), without the per-caption rows and counts."""
    return {k: v for k, v in report.items() if isinstance(v, float)}


def parse_caption(caption: str) -> tuple[str | None, str | None, str | None]:
    """(shape, colour, direction) named in a caption; None for a part it does not name.

    "a green circle moving up" -> ("circle", "green", "up"). Raises ValueError if a caption
    names two different values of one part (e.g. two colours): it has no single expected answer.
    """
    words = tokenize(caption)
    found = []
    for vocabulary in (SHAPES, COLOURS, DIRECTIONS):
        hits = sorted({w for w in words if w in vocabulary})
        if len(hits) > 1:
            raise ValueError(f"caption {caption!r} names several of {hits}")
        found.append(hits[0] if hits else None)
    return tuple(found)


def detect_clip(
    frames: np.ndarray,
    *,
    brightness_threshold: int = 80,
    max_colour_distance: float = 0.5,
    min_displacement: float = 2.0,
    min_axis_ratio: float = 2.0,
    min_r2: float = 0.5,
) -> dict:
    """Detect the colour and direction of the one moving object in a clip.

    frames: uint8 [T, H, W, 3]. Thresholds: brightness on the brightest channel (0-255);
    colour distance between hue-normalised RGB vectors (0-1 scale, red to yellow is 1.0);
    displacement in pixels over the whole clip, along the dominant axis; axis ratio of the
    dominant to the other axis's displacement; r2 of the dominant axis's straight-line fit.

    Returns {"colour": name or None, "direction": name or None} plus diagnostics:
    foreground_fraction, frames_with_foreground, mean_rgb, colour_distance, slope_x, slope_y
    (pixels per frame), displacement, r2. Raises ValueError if frames is not [T, H, W, 3].
    """
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames [T, H, W, 3], got shape {frames.shape}")
    num_frames, height, width, _ = frames.shape
    rgb = frames.astype(np.float64) / 255.0
    foreground = frames.max(axis=-1) > brightness_threshold  # [T, H, W]
    result = {
        "colour": None,
        "direction": None,
        "foreground_fraction": float(foreground.mean()),
        "frames_with_foreground": int(foreground.any(axis=(1, 2)).sum()),
        "mean_rgb": None,
        "colour_distance": None,
        "slope_x": None,
        "slope_y": None,
        "displacement": None,
        "r2": None,
    }
    if not foreground.any():
        return result

    mean_rgb = rgb[foreground].mean(axis=0)
    result["mean_rgb"] = [round(float(v) * 255, 1) for v in mean_rgb]
    hue = mean_rgb / mean_rgb.max()
    distances = np.linalg.norm(_REFERENCE_RGB - hue, axis=1)
    nearest = int(distances.argmin())
    result["colour_distance"] = float(distances[nearest])
    if distances[nearest] <= max_colour_distance:
        result["colour"] = _REFERENCE_NAMES[nearest]

    result.update(_detect_direction(rgb.max(axis=-1), foreground, min_displacement, min_axis_ratio, min_r2))
    return result


def _detect_direction(brightness, foreground, min_displacement, min_axis_ratio, min_r2) -> dict:
    num_frames, height, width = brightness.shape
    present = foreground.any(axis=(1, 2))
    # A trajectory needs the object in most frames, not a flicker in two of them.
    if present.sum() < max(2, (num_frames + 1) // 2):
        return {}
    # Brightness-weighted centroid: anti-aliased edges give sub-pixel positions.
    weights = np.where(foreground, brightness, 0.0)
    rows = np.arange(height)[:, None] + 0.5
    cols = np.arange(width)[None, :] + 0.5
    times = np.flatnonzero(present).astype(np.float64)
    mass = weights[present].sum(axis=(1, 2))
    cx = (weights[present] * cols).sum(axis=(1, 2)) / mass
    cy = (weights[present] * rows).sum(axis=(1, 2)) / mass

    slope_x, r2_x = _fit_line(times, cx)
    slope_y, r2_y = _fit_line(times, cy)
    span = num_frames - 1
    dx, dy = slope_x * span, slope_y * span
    horizontal = abs(dx) >= abs(dy)
    major, minor, r2 = (dx, dy, r2_x) if horizontal else (dy, dx, r2_y)
    found = {"slope_x": float(slope_x), "slope_y": float(slope_y),
             "displacement": float(abs(major)), "r2": float(r2)}
    if abs(major) >= min_displacement and abs(major) >= min_axis_ratio * abs(minor) and r2 >= min_r2:
        if horizontal:
            found["direction"] = "right" if major > 0 else "left"
        else:
            found["direction"] = "down" if major > 0 else "up"  # rows grow downward
    return found


def _fit_line(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of y over t and the fit's r^2 (0 when y does not vary)."""
    t_centered = t - t.mean()
    y_centered = y - y.mean()
    slope = float((t_centered * y_centered).sum() / (t_centered**2).sum())
    total = float((y_centered**2).sum())
    residual = float(((y_centered - slope * t_centered) ** 2).sum())
    r2 = 1.0 - residual / total if total > 1e-12 else 0.0
    return slope, r2


def score_clips(clips, captions, **detect_kwargs) -> dict:
    """Score clips against their captions.

    clips: a sequence of uint8 [T, H, W, 3] arrays (see latents_to_frames); captions: one per
    clip. detect_kwargs go to detect_clip. Returns {"num_clips", "colour_accuracy",
    "direction_accuracy", "both_accuracy", "mean_score" (of colour and direction), "per_caption": [{caption, expected_colour,
    detected_colour, expected_direction, detected_direction, colour_ok, direction_ok}]}.
    A detection of None is wrong. Raises ValueError if the counts differ or are zero, or if a
    caption names no colour or no direction (nothing to check it against).
    """
    clips, captions = list(clips), list(captions)
    if len(clips) != len(captions):
        raise ValueError(f"{len(clips)} clips but {len(captions)} captions")
    if not clips:
        raise ValueError("no clips to score")
    rows = []
    for frames, caption in zip(clips, captions):
        _, colour, direction = parse_caption(caption)
        if colour is None or direction is None:
            raise ValueError(f"caption {caption!r} names no colour or no direction")
        detected = detect_clip(frames, **detect_kwargs)
        rows.append({
            "caption": caption,
            "expected_colour": colour,
            "detected_colour": detected["colour"],
            "expected_direction": direction,
            "detected_direction": detected["direction"],
            "colour_ok": detected["colour"] == colour,
            "direction_ok": detected["direction"] == direction,
        })
    count = len(rows)
    colour = sum(r["colour_ok"] for r in rows) / count
    direction = sum(r["direction_ok"] for r in rows) / count
    return {
        "num_clips": count,
        "colour_accuracy": colour,
        "direction_accuracy": direction,
        "both_accuracy": sum(r["colour_ok"] and r["direction_ok"] for r in rows) / count,
        # The number the Stage2 health gate watches, named as the benchmark's.
        "mean_score": (colour + direction) / 2,
        "per_caption": rows,
    }
