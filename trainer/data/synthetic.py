"""The embedded dataset: clips of one coloured shape moving in one direction.

(`generator="bench"` writes the harder benchmark scenes of trainer.data.synthetic_bench instead,
through the same parquet writer and cache.)

Each clip is a T x H x W video on a black background with one shape (square, circle,
triangle) of one colour moving left, right, up or down at constant speed, captioned
"a red square moving left". The "VAE" is the identity, so pixels are the latents: float32
[C=3, T, H, W] in [-1, 1], black = -1. "up" means toward the top of the frame, i.e. toward
decreasing row index.

Shapes are rendered with 4x4 supersampling (pixel value = fraction of the pixel covered) so
sub-pixel motion is smooth rather than jerky. Start, size and speed are chosen so the whole
shape stays inside the frame on every frame.

Sample i depends only on (seed, i): a larger dataset with the same seed starts with the
smaller one's samples.

`generate_dataset` writes parquet shards in the data contract (docs/data.md,
"Layouts"); `ensure_dataset` builds such a cache once and reuses it, publishing atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer.encoders.text import StandInTextEncoder

SHAPES = ("square", "circle", "triangle")
COLOUR_RGB = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
COLOURS = tuple(COLOUR_RGB)
# (dx, dy) per frame in (column, row) units; rows grow downward, so "up" is dy = -1.
DIRECTION_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DIRECTIONS = tuple(DIRECTION_STEP)
CAPTION_VOCAB = ("a", "moving", *SHAPES, *COLOURS, *DIRECTIONS)

MANIFEST_NAME = "dataset.json"
MANIFEST_FORMAT = "relay.moving-shapes"
# Bump when the rendering or the row layout changes, so old caches are rebuilt.
MANIFEST_VERSION = 1
DEFAULT_FPS = 8.0
GENERATORS = ("shapes", "bench")

# Sizes and speeds are stated for a 16-pixel frame and scale with min(H, W).
_SIZE_RANGE_16 = (4.0, 5.0)
_SPEED_RANGE_16 = (1.0, 1.5)
_SUPERSAMPLE = 4

DATASET_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("vae_latent_bytes", pa.binary()),
        pa.field("vae_latent_shape", pa.list_(pa.int64())),
        pa.field("vae_latent_dtype", pa.string()),
        pa.field("text_embedding_bytes", pa.binary()),
        pa.field("text_embedding_shape", pa.list_(pa.int64())),
        pa.field("text_embedding_dtype", pa.string()),
        pa.field("file_name", pa.string()),
        pa.field("caption", pa.string()),
        pa.field("media_type", pa.string()),
        pa.field("width", pa.int64()),
        pa.field("height", pa.int64()),
        pa.field("num_frames", pa.int64()),
        pa.field("duration_sec", pa.float64()),
        pa.field("fps", pa.float64()),
        pa.field("first_frame_latent_bytes", pa.binary()),
        pa.field("first_frame_latent_shape", pa.list_(pa.int64())),
        pa.field("first_frame_latent_dtype", pa.string()),
        # Extra columns (allowed by the contract): what the clip shows.
        pa.field("shape", pa.string()),
        pa.field("colour", pa.string()),
        pa.field("direction", pa.string()),
        pa.field("start_x", pa.float64()),
        pa.field("start_y", pa.float64()),
        pa.field("size", pa.float64()),
        pa.field("speed", pa.float64()),
    ]
)
# The benchmark's rows: one JSON column lists the scene's objects instead of one object's fields.
BENCH_SCHEMA = pa.schema(
    [f for f in DATASET_SCHEMA if f.name not in
     ("shape", "colour", "direction", "start_x", "start_y", "size", "speed")]
    + [pa.field("scene", pa.string())]
)


def make_caption(shape: str, colour: str, direction: str) -> str:
    """The caption for a clip, e.g. make_caption("square", "red", "left") -> "a red square moving left"."""
    return f"a {colour} {shape} moving {direction}"


@dataclass(frozen=True)
class ClipSpec:
    """Everything that determines one clip. start_x/start_y: the shape's centre on frame 0, in
    pixels (x = column, y = row, pixel (0, 0) spans [0, 1) x [0, 1)); size: side / diameter in
    pixels; speed: pixels per frame along `direction`."""

    shape: str
    colour: str
    direction: str
    start_x: float
    start_y: float
    size: float
    speed: float

    @property
    def caption(self) -> str:
        return make_caption(self.shape, self.colour, self.direction)


def sample_clip_spec(rng: np.random.Generator, *, num_frames: int, height: int, width: int) -> ClipSpec:
    """Draw a random clip whose shape stays fully inside the frame on every frame.

    Speed is reduced below its usual range when the clip is too long for the path to fit.
    Raises ValueError if the frame is too small for a shape.
    """
    scale = min(height, width) / 16.0
    size = rng.uniform(*_SIZE_RANGE_16) * scale
    if min(height, width) < size + 1:
        raise ValueError(f"frame {height}x{width} is too small for a moving shape")
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = COLOURS[rng.integers(len(COLOURS))]
    direction = DIRECTIONS[rng.integers(len(DIRECTIONS))]
    dx, dy = DIRECTION_STEP[direction]

    extent = width if dx else height
    speed = rng.uniform(*_SPEED_RANGE_16) * scale
    if num_frames > 1:
        speed = min(speed, (extent - size) / (num_frames - 1))
    travel = speed * (num_frames - 1)

    half = size / 2
    step = dx or dy
    # Along the motion axis the start must leave room for the whole path; across it, anywhere.
    lo, hi = (half, extent - half - travel) if step > 0 else (half + travel, extent - half)
    along = rng.uniform(lo, max(lo, hi))  # max: rounding when the path spans the frame
    across_extent = height if dx else width
    across = rng.uniform(half, across_extent - half)
    start_x, start_y = (along, across) if dx else (across, along)
    return ClipSpec(shape, colour, direction, float(start_x), float(start_y), float(size), float(speed))


def _coverage(shape: str, cx: float, cy: float, size: float, height: int, width: int) -> np.ndarray:
    """Fraction of each pixel covered by the shape centred at (cx, cy): float32 [H, W]."""
    offsets = (np.arange(_SUPERSAMPLE) + 0.5) / _SUPERSAMPLE
    ys = (np.arange(height)[:, None] + offsets).reshape(-1)[:, None]
    xs = (np.arange(width)[:, None] + offsets).reshape(-1)[None, :]
    half = size / 2
    if shape == "square":
        inside = (np.abs(xs - cx) <= half) & (np.abs(ys - cy) <= half)
    elif shape == "circle":
        inside = (xs - cx) ** 2 + (ys - cy) ** 2 <= half**2
    elif shape == "triangle":
        # Apex at the top centre, base at the bottom: half-width grows linearly downward.
        depth = (ys - (cy - half)) / size
        inside = (depth >= 0) & (depth <= 1) & (np.abs(xs - cx) <= depth * half)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return inside.reshape(height, _SUPERSAMPLE, width, _SUPERSAMPLE).mean(axis=(1, 3), dtype=np.float32)


def render_clip(spec: ClipSpec, *, num_frames: int, height: int, width: int) -> np.ndarray:
    """Render a clip as latents: float32 [3, T, H, W] in [-1, 1] (black background = -1)."""
    dx, dy = DIRECTION_STEP[spec.direction]
    rgb = np.asarray(COLOUR_RGB[spec.colour], dtype=np.float32) / 255.0
    pixels = np.empty((3, num_frames, height, width), dtype=np.float32)
    for t in range(num_frames):
        cx = spec.start_x + dx * spec.speed * t
        cy = spec.start_y + dy * spec.speed * t
        cover = _coverage(spec.shape, cx, cy, spec.size, height, width)
        pixels[:, t] = rgb[:, None, None] * cover[None]
    return pixels * 2.0 - 1.0


def make_clip(
    seed: int, index: int, *, num_frames: int = 8, height: int = 16, width: int = 16
) -> tuple[ClipSpec, np.ndarray]:
    """Sample `index` of the dataset with `seed`: (its spec, its latents [3, T, H, W])."""
    rng = np.random.default_rng([seed, index])
    spec = sample_clip_spec(rng, num_frames=num_frames, height=height, width=width)
    return spec, render_clip(spec, num_frames=num_frames, height=height, width=width)


def make_sample(generator: str, seed: int, index: int, *, num_frames: int, height: int,
                width: int):
    """(spec with a .caption, latents [3, T, H, W]) of sample `index` of either generator."""
    if generator == "bench":
        from trainer.data.synthetic_bench import make_scene

        return make_scene(seed, index, num_frames=num_frames, height=height, width=width)
    if generator != "shapes":
        raise ValueError(f"unknown synthetic generator {generator!r}; known: {', '.join(GENERATORS)}")
    return make_clip(seed, index, num_frames=num_frames, height=height, width=width)


def _text_encoder(text_dim, max_text_tokens, text_encoder_seed, generator) -> StandInTextEncoder:
    # The benchmark's two-object captions need word order (see trainer.data.synthetic_bench).
    return StandInTextEncoder(text_dim, max_text_tokens, text_encoder_seed,
                              positional=generator == "bench")


def _dataset_params(num_samples, seed, num_frames, height, width, samples_per_shard, text_dim,
                    max_text_tokens, text_encoder_seed, fps, generator) -> dict:
    # Everything that changes the written bytes: a cache is reused only if all of it matches.
    # "generator" appears only for the benchmark, so existing caches of the default stay valid.
    extra = {} if generator == "shapes" else {"generator": generator}
    return {**extra,
        "num_samples": int(num_samples),
        "seed": int(seed),
        "num_frames": int(num_frames),
        "height": int(height),
        "width": int(width),
        "samples_per_shard": int(samples_per_shard),
        "fps": float(fps),
        "text_encoder": _text_encoder(text_dim, max_text_tokens, text_encoder_seed,
                                      generator).config,
    }


def generate_dataset(
    out_dir,
    num_samples: int,
    *,
    seed: int,
    num_frames: int = 8,
    height: int = 16,
    width: int = 16,
    samples_per_shard: int = 256,
    text_dim: int = 32,
    max_text_tokens: int = 8,
    text_encoder_seed: int = 0,
    fps: float = DEFAULT_FPS,
    generator: str = "shapes",
    workers: int | None = None,
) -> Path:
    """Write `num_samples` clips as parquet shards `shard-00000.parquet`, ... plus `dataset.json`.

    Rows follow the data contract; the text embedding is stored unpadded ([number of caption
    tokens, text_dim], as FastVideo stores it): readers pad and build the mask. The text
    encoder is StandInTextEncoder(text_dim, max_text_tokens, text_encoder_seed); its config is
    in the manifest, so sampling can rebuild the same encoder. The manifest is written last and
    marks the directory complete. Returns out_dir as a Path. generator: "shapes" (the default
    moving-shapes clips) or "bench" (trainer.data.synthetic_bench's scenes, positional captions).

    workers: processes writing shards at once (None: one per spare core for a set large enough
    to pay for starting them; the bytes written do not depend on it).

    Raises FileExistsError if out_dir already holds files (old shards would mix into the new
    data: use ensure_dataset to rebuild a cache), ValueError for non-positive counts.
    """
    if num_samples < 1 or samples_per_shard < 1 or num_frames < 1:
        raise ValueError("num_samples, samples_per_shard and num_frames must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; generate into an empty directory")
    if generator not in GENERATORS:
        raise ValueError(f"unknown synthetic generator {generator!r}; known: {', '.join(GENERATORS)}")
    params = _dataset_params(num_samples, seed, num_frames, height, width, samples_per_shard,
                             text_dim, max_text_tokens, text_encoder_seed, fps, generator)
    firsts = list(range(0, num_samples, samples_per_shard))
    jobs = [(out, index, range(first, min(first + samples_per_shard, num_samples)), seed,
             num_frames, height, width, text_dim, max_text_tokens, text_encoder_seed, fps,
             generator) for index, first in enumerate(firsts)]
    workers = _generation_workers(num_samples, len(jobs)) if workers is None else workers
    if workers > 1 and len(jobs) > 1:
        # Each shard depends only on (seed, its indices): worker processes write the same bytes.
        import concurrent.futures
        import multiprocessing

        # spawn, not fork: the caller may hold CUDA and OpenMP threads that a fork would copy
        with concurrent.futures.ProcessPoolExecutor(
                min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            shard_names = list(pool.map(_write_shard, jobs))
    else:
        shard_names = [_write_shard(job) for job in jobs]

    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "params": params,
                "shards": shard_names}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


# Below this many clips a worker's start (importing torch) costs more than the clips take.
PARALLEL_MIN_SAMPLES = 4096


def _generation_workers(num_samples: int, shards: int) -> int:
    if num_samples < PARALLEL_MIN_SAMPLES:
        return 1
    return max(1, min(shards, (os.cpu_count() or 1) - 1, 8))


def _write_shard(job) -> str:
    """Write one shard (a job of generate_dataset); returns its file name."""
    (out, index, indices, seed, num_frames, height, width, text_dim, max_text_tokens,
     text_encoder_seed, fps, generator) = job
    encoder = _text_encoder(text_dim, max_text_tokens, text_encoder_seed, generator)
    make_row, schema = (_make_bench_row, BENCH_SCHEMA) if generator == "bench" else \
        (_make_row, DATASET_SCHEMA)
    rows = [make_row(seed, i, encoder, num_frames, height, width, fps) for i in indices]
    name = f"shard-{index:05d}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), Path(out) / name)
    return name


def _make_row(seed, index, encoder, num_frames, height, width, fps) -> dict:
    spec, latent = make_clip(seed, index, num_frames=num_frames, height=height, width=width)
    return {**_common_row(f"shapes-s{seed}-{index:07d}", spec.caption, latent, encoder, fps),
            "shape": spec.shape,
            "colour": spec.colour,
            "direction": spec.direction,
            "start_x": spec.start_x,
            "start_y": spec.start_y,
            "size": spec.size,
            "speed": spec.speed}


def _make_bench_row(seed, index, encoder, num_frames, height, width, fps) -> dict:
    scene, latent = make_sample("bench", seed, index, num_frames=num_frames, height=height,
                                width=width)
    return {**_common_row(f"bench-s{seed}-{index:07d}", scene.caption, latent, encoder, fps),
            "scene": scene.to_json()}


def _common_row(sample_id, caption, latent, encoder, fps) -> dict:
    _, num_frames, height, width = latent.shape
    hidden, mask = encoder.encode([caption])
    text = hidden[0, mask[0]].numpy()
    first = np.ascontiguousarray(latent[:, :1])
    return {
        "id": sample_id,
        "vae_latent_bytes": latent.tobytes(),
        "vae_latent_shape": list(latent.shape),
        "vae_latent_dtype": "float32",
        "text_embedding_bytes": text.tobytes(),
        "text_embedding_shape": list(text.shape),
        "text_embedding_dtype": "float32",
        # Nothing was read from disk; name the generator so the row is traceable.
        "file_name": f"synthetic://moving-shapes/{sample_id}",
        "caption": caption,
        "media_type": "video",
        "width": width,
        "height": height,
        "num_frames": num_frames,
        "duration_sec": num_frames / fps,
        "fps": fps,
        "first_frame_latent_bytes": first.tobytes(),
        "first_frame_latent_shape": list(first.shape),
        "first_frame_latent_dtype": "float32",
    }


def read_manifest(out_dir) -> dict | None:
    """The dataset.json of a generated dataset, or None if it is missing or unreadable."""
    try:
        return json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out: Path, params: dict) -> bool:
    manifest = read_manifest(out)
    return (
        manifest is not None
        and manifest.get("format") == MANIFEST_FORMAT
        and manifest.get("version") == MANIFEST_VERSION
        and manifest.get("params") == params
        and all((out / name).is_file() for name in manifest.get("shards", []))
    )


def _check_replaceable(out: Path) -> None:
    # Only ever replace what this module wrote: never a directory of someone's real data.
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("format") == MANIFEST_FORMAT:
        return
    foreign = [p.name for p in out.iterdir() if not (p.name.startswith("shard-") and p.suffix == ".parquet")]
    if foreign:
        raise FileExistsError(
            f"{out} exists and is not a generated moving-shapes dataset (it holds "
            f"{', '.join(sorted(foreign)[:5])}); refusing to replace it. Choose another directory."
        )


def ensure_dataset(out_dir, num_samples: int, *, seed: int, **kwargs) -> Path:
    """Make out_dir hold exactly the dataset generate_dataset(out_dir, num_samples, seed=seed,
    **kwargs) would write, regenerating only when its manifest is missing or differs.

    Generation happens in a hidden sibling temp directory that is renamed into place, so a
    killed or concurrent run never leaves a half-written dataset at out_dir; when several
    processes race, each builds its own copy and the first rename wins (the copies are
    identical). A killed run can leave a `.<name>.tmp-*` sibling behind. Returns out_dir as a
    Path. Raises FileExistsError if out_dir exists but was not written by this module.
    """
    out = Path(out_dir)
    defaults = {"num_frames": 8, "height": 16, "width": 16, "samples_per_shard": 256,
                "text_dim": 32, "max_text_tokens": 8, "text_encoder_seed": 0, "fps": DEFAULT_FPS,
                "generator": "shapes"}
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"ensure_dataset() got unknown arguments: {', '.join(sorted(unknown))}")
    options = {**defaults, **kwargs}
    params = _dataset_params(num_samples, seed, **options)
    if _is_complete(out, params):
        return out
    if out.exists():
        _check_replaceable(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        generate_dataset(tmp, num_samples, seed=seed, **options)
        _publish(tmp, out, params)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path, params: dict) -> None:
    # Renames are atomic within one filesystem; retry because another process may be
    # moving the same directory at the same moment.
    for _ in range(10):
        if _is_complete(out, params):
            return  # another process published the same dataset first
        if out.exists():
            _check_replaceable(out)
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(out, old)
            except FileNotFoundError:
                continue
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out)
            return
        except OSError:
            continue  # out reappeared (another publisher): look again
    raise RuntimeError(f"could not publish the generated dataset at {out}: it keeps changing")
