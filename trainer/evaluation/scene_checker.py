"""The benchmark's pixel checker: does a clip show every attribute its caption asks for?

Independent of the model and of the parquet metadata: it reads uint8 frames [T, H, W, 3] and
the caption, and knows only how trainer.data.synthetic_bench draws (its shapes, colours, sizes and
the speed split). For each clip:
1. segment by colour: a pixel is foreground when its brightest channel is above a threshold,
   and belongs to the reference colour nearest its hue (RGB scaled so its brightest channel
   is 1, which anti-aliased edges keep). Every reference colour has a channel at 255, so the
   brightest channel is the pixel's coverage. A colour with enough coverage in most frames is
   candidate object, so the object count is the number of such colours that step 3 finds a
   shape for;
2. per object, fit a straight trajectory to its centroids: direction = the nearest of the
   eight directions to the displacement (when it is long enough and the fit steady), speed =
   slowly / quickly by the travel over the clip against the generator's split;
3. shape: for every candidate shape, size it from the object's area, place it on the fitted
   trajectory, render it as the generator would and take the soft IoU with the object's
   coverage, frame by frame; the best candidate is the detected shape and its IoU the clip's
   fidelity; a colour no shape fits (IoU below 0.3: scattered pixels) is not an object.
   Temporal consistency is 1 - the mean relative deviation of the object's coverage
   from frame to frame (1 for a rigid object, lower when it flickers, grows or fades).
Expected objects are paired with detected ones by colour first, then by size; an expected
object without a partner scores wrong on every attribute.
"""

from __future__ import annotations

import math

import numpy as np

from trainer.data import synthetic_bench as bench
from trainer.encoders.text import tokenize

ATTRIBUTES = ("colour", "shape", "direction", "speed", "count")
_REFERENCE_NAMES = list(bench.COLOUR_RGB)
_REFERENCE_RGB = np.asarray([bench.COLOUR_RGB[c] for c in _REFERENCE_NAMES],
                            dtype=np.float64) / 255.0


def parse_caption(caption: str) -> list[dict]:
    """The objects a benchmark caption asks for: [{shape, colour, direction, speed}], None for a
    part an object's phrase does not name. "a red ring moving quickly up left and a blue square
    moving slowly down" -> two objects, the first {"ring", "red", "up left", "quickly"}."""
    objects = []
    for phrase in caption.split(" and "):
        words = tokenize(phrase)
        found = {"shape": None, "colour": None, "direction": None, "speed": None}
        for part, vocabulary in (("shape", bench.SHAPES), ("colour", bench.COLOURS),
                                 ("speed", bench.SPEEDS)):
            hits = [w for w in words if w in vocabulary]
            found[part] = hits[0] if hits else None
        vertical = [w for w in words if w in ("up", "down")]
        horizontal = [w for w in words if w in ("left", "right")]
        direction = " ".join(vertical[:1] + horizontal[:1])
        found["direction"] = direction or None
        objects.append(found)
    return objects


def segment_colours(frames: np.ndarray, *, brightness_threshold: int = 80,
                    max_colour_distance: float = 0.35,
                    min_presence: float = 0.5, min_coverage_fraction: float = 0.2) -> dict:
    """Coverage maps float [T, H, W] in [0, 1] of each detected colour: {colour: coverage}.

    A colour counts as an object when it covers pixels in at least min_presence of the frames
    and its total coverage is at least min_coverage_fraction of the largest colour's (stray
    edge pixels of another hue are not an object).
    """
    rgb = frames.astype(np.float64) / 255.0
    brightness = rgb.max(axis=-1)
    foreground = frames.max(axis=-1) > brightness_threshold
    hue = rgb / np.maximum(brightness, 1e-6)[..., None]
    distances = np.linalg.norm(hue[..., None, :] - _REFERENCE_RGB, axis=-1)  # [T, H, W, K]
    nearest = distances.argmin(axis=-1)
    close = distances.min(axis=-1) <= max_colour_distance
    maps = {}
    for k, name in enumerate(_REFERENCE_NAMES):
        mask = foreground & close & (nearest == k)
        if mask.any(axis=(1, 2)).mean() >= min_presence:
            maps[name] = np.where(mask, brightness, 0.0)
    if not maps:
        return {}
    largest = max(m.sum() for m in maps.values())
    return {n: m for n, m in maps.items() if m.sum() >= min_coverage_fraction * largest}


def fit_trajectory(cover: np.ndarray) -> dict | None:
    """Least-squares straight path of the coverage-weighted centroid: {x0, y0, vx, vy, r2}
    (pixels, pixels per frame, at frame 0), or None when the object is in fewer than half
    the frames."""
    num_frames, height, width = cover.shape
    mass = cover.sum(axis=(1, 2))
    present = mass > 0.5
    if present.sum() < max(2, (num_frames + 1) // 2):
        return None
    t = np.flatnonzero(present).astype(np.float64)
    cols = np.arange(width)[None, None, :] + 0.5
    rows = np.arange(height)[None, :, None] + 0.5
    cx = (cover[present] * cols).sum(axis=(1, 2)) / mass[present]
    cy = (cover[present] * rows).sum(axis=(1, 2)) / mass[present]
    tc = t - t.mean()
    vx = float((tc * (cx - cx.mean())).sum() / (tc**2).sum())
    vy = float((tc * (cy - cy.mean())).sum() / (tc**2).sum())
    residual = ((cx - cx.mean() - vx * tc) ** 2 + (cy - cy.mean() - vy * tc) ** 2).sum()
    total = ((cx - cx.mean()) ** 2 + (cy - cy.mean()) ** 2).sum()
    r2 = 1.0 - residual / total if total > 1e-12 else 0.0
    return {"x0": float(cx.mean() - vx * t.mean()), "y0": float(cy.mean() - vy * t.mean()),
            "vx": vx, "vy": vy, "r2": float(r2)}


def classify_motion(path: dict, num_frames: int, extent: int, *, min_travel: float = 0.08,
                    min_r2: float = 0.6) -> tuple[str | None, str | None, float]:
    """(direction, speed word, travel as a fraction of `extent`) of a fitted path. Direction is
    None when the object travels less than min_travel of the frame or its path is not
    straight (r2 below min_r2); speed is None when the direction is."""
    span = max(1, num_frames - 1)
    dx, dy = path["vx"] * span, path["vy"] * span
    travel = math.hypot(dx, dy) / extent
    if travel < min_travel or path["r2"] < min_r2:
        return None, None, travel
    angle = math.atan2(dy, dx)
    direction = min(bench.DIRECTIONS, key=lambda d: _angle_gap(angle, bench.DIRECTION_UNIT[d]))
    speed = "quickly" if travel >= bench.SPEED_SPLIT else "slowly"
    return direction, speed, travel


def _angle_gap(angle: float, unit: tuple[float, float]) -> float:
    gap = abs(angle - math.atan2(unit[1], unit[0])) % (2 * math.pi)
    return min(gap, 2 * math.pi - gap)


def fit_shapes(cover: np.ndarray, path: dict) -> dict[str, float]:
    """Mean soft IoU, over the frames, of the object's coverage with each candidate shape sized
    from the object's area and centred on the fitted path: {shape: IoU}."""
    num_frames, height, width = cover.shape
    area = float(cover.sum(axis=(1, 2)).mean())
    scores = {}
    for shape in bench.SHAPES:
        size = math.sqrt(max(area, 1e-6) / bench.area_factor(shape))
        ox, oy = bench.centroid_offset(shape, size)
        ious = []
        for t in range(num_frames):
            cx = path["x0"] + path["vx"] * t - ox
            cy = path["y0"] + path["vy"] * t - oy
            model = bench.coverage(shape, cx, cy, size, height, width)
            union = np.maximum(model, cover[t]).sum()
            ious.append(np.minimum(model, cover[t]).sum() / union if union > 0 else 0.0)
        scores[shape] = float(np.mean(ious))
    return scores


def temporal_consistency(cover: np.ndarray) -> float:
    """1 - mean |m_t - mean m| / mean m of the object's per-frame coverage m_t, in [0, 1]."""
    mass = cover.sum(axis=(1, 2))
    mean = mass.mean()
    if mean <= 0:
        return 0.0
    return float(max(0.0, 1.0 - np.abs(mass - mean).mean() / mean))


def detect_objects(frames: np.ndarray, *, min_object_iou: float = 0.3,
                   **segment_kwargs) -> list[dict]:
    """Every object in a clip: [{colour, shape, direction, speed, travel, iou, temporal,
    coverage}], largest first. A colour that no candidate shape on a straight path fits with
    at least min_object_iou (pixels of that hue sprayed over the frame, as noise is) is no
    object. Raises ValueError unless frames is uint8-like [T, H, W, 3]."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames [T, H, W, 3], got shape {frames.shape}")
    num_frames, height, width, _ = frames.shape
    found = []
    for colour, cover in segment_colours(frames, **segment_kwargs).items():
        item = {"colour": colour, "shape": None, "direction": None, "speed": None,
                "travel": None, "iou": 0.0, "temporal": temporal_consistency(cover),
                "coverage": float(cover.sum())}
        path = fit_trajectory(cover)
        if path is None:
            continue
        ious = fit_shapes(cover, path)
        item["shape"] = max(ious, key=ious.get)
        item["iou"] = ious[item["shape"]]
        if item["iou"] < min_object_iou:
            continue
        item["direction"], item["speed"], item["travel"] = classify_motion(
            path, num_frames, min(height, width))
        found.append(item)
    return sorted(found, key=lambda o: -o["coverage"])


def _pair(expected: list[dict], detected: list[dict]) -> list[dict | None]:
    """Each expected object's detected partner: the same colour first, then the largest left."""
    left = list(detected)
    partners: list[dict | None] = [None] * len(expected)
    for i, want in enumerate(expected):
        match = next((d for d in left if d["colour"] == want["colour"]), None)
        if match is not None:
            partners[i] = match
            left.remove(match)
    for i in range(len(expected)):
        if partners[i] is None and left:
            partners[i] = left.pop(0)
    return partners


def score_clip(frames: np.ndarray, caption: str) -> dict:
    """One clip against its caption: {caption, count_ok, detected_count, objects: [{expected,
    detected, colour_ok, shape_ok, direction_ok, speed_ok}], fidelity, temporal}."""
    expected = parse_caption(caption)
    detected = detect_objects(frames)
    rows = []
    for want, got in zip(expected, _pair(expected, detected)):
        row = {"expected": want, "detected": got and {k: got[k] for k in
                                                      ("colour", "shape", "direction", "speed")}}
        for part in ("colour", "shape", "direction", "speed"):
            row[f"{part}_ok"] = got is not None and got[part] == want[part]
        row["iou"] = got["iou"] if got else 0.0
        row["temporal"] = got["temporal"] if got else 0.0
        rows.append(row)
    return {"caption": caption, "count_ok": len(detected) == len(expected),
            "detected_count": len(detected), "objects": rows,
            "fidelity": float(np.mean([r["iou"] for r in rows])),
            "temporal": float(np.mean([r["temporal"] for r in rows]))}


def score_scenes(clips, captions) -> dict:
    """Score clips against benchmark captions.

    Returns {"num_clips", "<attribute>_accuracy" for colour, shape, direction, speed (over
    objects) and count (over clips), "mean_score" (their mean), "fidelity" (mean best-shape
    IoU), "temporal_consistency", "per_caption": [score_clip rows]}. Raises ValueError when
    the counts differ or are zero.
    """
    clips, captions = list(clips), list(captions)
    if len(clips) != len(captions):
        raise ValueError(f"{len(clips)} clips but {len(captions)} captions")
    if not clips:
        raise ValueError("no clips to score")
    rows = [score_clip(frames, caption) for frames, caption in zip(clips, captions)]
    objects = [o for r in rows for o in r["objects"]]
    report = {"num_clips": len(rows)}
    for part in ("colour", "shape", "direction", "speed"):
        report[f"{part}_accuracy"] = sum(o[f"{part}_ok"] for o in objects) / len(objects)
    report["count_accuracy"] = sum(r["count_ok"] for r in rows) / len(rows)
    report["mean_score"] = float(np.mean([report[f"{a}_accuracy"] for a in ATTRIBUTES]))
    report["fidelity"] = float(np.mean([r["fidelity"] for r in rows]))
    report["temporal_consistency"] = float(np.mean([r["temporal"] for r in rows]))
    report["per_caption"] = rows
    return report
