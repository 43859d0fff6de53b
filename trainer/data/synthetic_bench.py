"""The benchmark variant of the embedded dataset: scenes a few-step sampler must earn.

Same idea as trainer.data.synthetic (a black background, shapes moving at constant speed, a caption
that says what to draw), made harder on every axis a distilled student tends to lose:
- six shapes, two pairs of which differ only in outline: square / frame (a hollow square),
  circle / ring (a hollow circle), plus triangle and diamond;
- eight colours, eight directions (the four diagonals as "up left", "down right", ...);
- a speed word per object: "slowly" travels 17-26 % of the frame over the clip, "quickly"
  45-62 % (a gap between them, so a checker can tell them apart);
- two objects in about a third of the captions, of different colours, whose paths never touch:
  "a red ring moving quickly up left and a white square moving slowly down".

Sizes and travel are fractions of the frame, so any frame size and clip length works (the
benchmark uses 32x32, 16 frames). Sample i depends only on (seed, i), as in trainer.data.synthetic.
Two-object captions bind words to objects by their order, so the benchmark's stand-in text
encoder runs with positional embeddings (trainer.encoders.text).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

SHAPES = ("square", "frame", "circle", "ring", "triangle", "diamond")
COLOUR_RGB = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "white": (255, 255, 255),
    "orange": (255, 128, 0),
}
COLOURS = tuple(COLOUR_RGB)
_DIAGONAL = 1 / math.sqrt(2)
# Unit (dx, dy) per direction in (column, row) units; rows grow downward, so "up" is dy < 0.
DIRECTION_UNIT = {
    "left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0),
    "up left": (-_DIAGONAL, -_DIAGONAL), "up right": (_DIAGONAL, -_DIAGONAL),
    "down left": (-_DIAGONAL, _DIAGONAL), "down right": (_DIAGONAL, _DIAGONAL),
}
DIRECTIONS = tuple(DIRECTION_UNIT)
# Travel over the whole clip as a fraction of min(H, W).
SPEED_TRAVEL = {"slowly": (0.17, 0.26), "quickly": (0.45, 0.62)}
SPEEDS = tuple(SPEED_TRAVEL)
# Where a checker splits the two speeds: the middle of the gap between their ranges.
SPEED_SPLIT = (SPEED_TRAVEL["slowly"][1] + SPEED_TRAVEL["quickly"][0]) / 2
SIZE_FRACTION = (0.27, 0.34)           # side / diameter as a fraction of min(H, W)
OUTLINE_FRACTION = 0.28                # an outline's thickness as a fraction of the size
TWO_OBJECT_PROB = 0.35
_SUPERSAMPLE = 4
_PLACEMENT_TRIES = 64


@dataclass(frozen=True)
class ObjectSpec:
    """One object: centre (start_x, start_y) on frame 0 in pixels (x = column, y = row), size
    (side / diameter) in pixels, speed in pixels per frame along `direction`."""

    shape: str
    colour: str
    direction: str
    speed_word: str
    start_x: float
    start_y: float
    size: float
    speed: float

    @property
    def phrase(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"  # "an orange ring"
        return f"{article} {self.colour} {self.shape} moving {self.speed_word} {self.direction}"

    def centre(self, t: float) -> tuple[float, float]:
        ux, uy = DIRECTION_UNIT[self.direction]
        return self.start_x + ux * self.speed * t, self.start_y + uy * self.speed * t


@dataclass(frozen=True)
class SceneSpec:
    """A clip: its objects, painted in order."""

    objects: tuple[ObjectSpec, ...]

    @property
    def caption(self) -> str:
        return " and ".join(o.phrase for o in self.objects)

    def to_json(self) -> str:
        return json.dumps([o.__dict__ for o in self.objects], sort_keys=True)


def inside(shape: str, xs: np.ndarray, ys: np.ndarray, cx: float, cy: float,
           size: float) -> np.ndarray:
    """Boolean mask of the points (xs, ys) inside `shape` centred at (cx, cy). The triangle's
    apex is at the top centre; the diamond is the square turned by 45 degrees with the same
    width; outlines are OUTLINE_FRACTION of the size thick."""
    half = size / 2
    ax, ay = np.abs(xs - cx), np.abs(ys - cy)
    hole = half * (1 - 2 * OUTLINE_FRACTION)
    if shape == "square":
        return (ax <= half) & (ay <= half)
    if shape == "frame":
        return (ax <= half) & (ay <= half) & ~((ax < hole) & (ay < hole))
    radius2 = (xs - cx) ** 2 + (ys - cy) ** 2
    if shape == "circle":
        return radius2 <= half**2
    if shape == "ring":
        return (radius2 <= half**2) & (radius2 >= hole**2)
    if shape == "triangle":
        depth = (ys - (cy - half)) / size
        return (depth >= 0) & (depth <= 1) & (ax <= depth * half)
    if shape == "diamond":
        return ax + ay <= half
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def coverage(shape: str, cx: float, cy: float, size: float, height: int,
             width: int) -> np.ndarray:
    """Fraction of each pixel covered by the shape (4x4 supersampling): float32 [H, W]."""
    out = np.zeros((height, width), dtype=np.float32)
    # Only the pixels of the shape's bounding box can be covered: sample those alone.
    half = size / 2
    r0, r1 = max(0, int(math.floor(cy - half))), min(height, int(math.ceil(cy + half)) + 1)
    c0, c1 = max(0, int(math.floor(cx - half))), min(width, int(math.ceil(cx + half)) + 1)
    if r0 >= r1 or c0 >= c1:
        return out
    offsets = (np.arange(_SUPERSAMPLE) + 0.5) / _SUPERSAMPLE
    ys = (np.arange(r0, r1)[:, None] + offsets).reshape(-1)[:, None]
    xs = (np.arange(c0, c1)[:, None] + offsets).reshape(-1)[None, :]
    hit = inside(shape, xs, ys, cx, cy, size)
    out[r0:r1, c0:c1] = hit.reshape(r1 - r0, _SUPERSAMPLE, c1 - c0, _SUPERSAMPLE).mean(
        axis=(1, 3), dtype=np.float32)
    return out


def area_factor(shape: str) -> float:
    """Area of the shape divided by size**2 (what a checker inverts to fit a size)."""
    hole = (1 - 2 * OUTLINE_FRACTION) ** 2
    return {"square": 1.0, "frame": 1.0 - hole, "circle": math.pi / 4,
            "ring": math.pi / 4 * (1.0 - hole), "triangle": 0.5, "diamond": 0.5}[shape]


def centroid_offset(shape: str, size: float) -> tuple[float, float]:
    """Centroid minus centre of the shape: the triangle's area sits low (two thirds down)."""
    return (0.0, size / 6) if shape == "triangle" else (0.0, 0.0)


def render_object(obj: ObjectSpec, t: int, height: int, width: int) -> np.ndarray:
    """The object's coverage on frame t: float32 [H, W]."""
    cx, cy = obj.centre(t)
    return coverage(obj.shape, cx, cy, obj.size, height, width)


def render_scene(scene: SceneSpec, *, num_frames: int, height: int, width: int) -> np.ndarray:
    """Render a scene as latents: float32 [3, T, H, W] in [-1, 1] (black background = -1)."""
    pixels = np.zeros((3, num_frames, height, width), dtype=np.float32)
    for obj in scene.objects:
        rgb = np.asarray(COLOUR_RGB[obj.colour], dtype=np.float32)[:, None, None] / 255.0
        for t in range(num_frames):
            cover = render_object(obj, t, height, width)[None]
            pixels[:, t] = pixels[:, t] * (1 - cover) + rgb * cover  # later objects on top
    return pixels * 2.0 - 1.0


def sample_object(rng: np.random.Generator, *, num_frames: int, height: int, width: int,
                  colours=COLOURS) -> ObjectSpec:
    """A random object whose whole path stays inside the frame."""
    extent = min(height, width)
    size = rng.uniform(*SIZE_FRACTION) * extent
    if extent < size + 2:
        raise ValueError(f"frame {height}x{width} is too small for a benchmark scene")
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = colours[rng.integers(len(colours))]
    direction = DIRECTIONS[rng.integers(len(DIRECTIONS))]
    speed_word = SPEEDS[rng.integers(len(SPEEDS))]
    travel = rng.uniform(*SPEED_TRAVEL[speed_word]) * extent
    speed = travel / max(1, num_frames - 1)
    ux, uy = DIRECTION_UNIT[direction]
    half = size / 2
    starts = []
    for unit, axis_extent in ((ux, width), (uy, height)):
        move = unit * travel
        lo, hi = half - min(0.0, move), axis_extent - half - max(0.0, move)
        starts.append(rng.uniform(lo, max(lo, hi)))
    return ObjectSpec(shape, colour, direction, speed_word, float(starts[0]), float(starts[1]),
                      float(size), float(speed))


def _paths_apart(a: ObjectSpec, b: ObjectSpec, num_frames: int) -> bool:
    # Bounding boxes one pixel apart on every frame: the checker never sees them merge.
    gap = (a.size + b.size) / 2 + 1.0
    for t in range(num_frames):
        (ax, ay), (bx, by) = a.centre(t), b.centre(t)
        if abs(ax - bx) < gap and abs(ay - by) < gap:
            return False
    return True


def sample_scene(rng: np.random.Generator, *, num_frames: int, height: int,
                 width: int) -> SceneSpec:
    """A random scene: one object, or (TWO_OBJECT_PROB) two of different colours whose paths
    stay apart. When no second placement fits after a few tries, the scene keeps one object."""
    first = sample_object(rng, num_frames=num_frames, height=height, width=width)
    if rng.uniform() >= TWO_OBJECT_PROB:
        return SceneSpec((first,))
    others = tuple(c for c in COLOURS if c != first.colour)
    for _ in range(_PLACEMENT_TRIES):
        second = sample_object(rng, num_frames=num_frames, height=height, width=width,
                               colours=others)
        if _paths_apart(first, second, num_frames):
            return SceneSpec((first, second))
    return SceneSpec((first,))


def make_scene(seed: int, index: int, *, num_frames: int = 16, height: int = 32,
               width: int = 32) -> tuple[SceneSpec, np.ndarray]:
    """Sample `index` of the benchmark dataset with `seed`: (its scene, latents [3, T, H, W])."""
    rng = np.random.default_rng([seed, index, 0xBE])  # its own stream, not the tiny set's
    scene = sample_scene(rng, num_frames=num_frames, height=height, width=width)
    return scene, render_scene(scene, num_frames=num_frames, height=height, width=width)


def eval_captions(count: int = 64, *, seed: int = 20261201) -> tuple[str, ...]:
    """The benchmark's fixed evaluation captions: `count` scenes drawn from their own seed, so
    they are not training captions by construction of the index (most are new combinations)."""
    return tuple(sample_scene(np.random.default_rng([seed, i, 0xBE]), num_frames=16,
                              height=32, width=32).caption for i in range(count))
