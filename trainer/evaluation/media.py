"""The files a user looks at: clips as video + contact sheet + raw frames, and the picture of
a validation step.

Frames are uint8 [T, H, W, 3]. Tiny clips are upscaled by pixel repetition so they can be seen.
`write_validation_grid` draws each clip as a strip of its frames (time runs left to right), the
caption under it, several clips to a row, one block per set of weights (live, EMA) under a
title with that block's scores. A caption whose colour and direction the detector read right
is written in green; a wrong one in red, with what was read instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def upscale(frames: np.ndarray, min_side: int = 128) -> np.ndarray:
    """Frames [T, H, W, 3] repeated by a whole factor so the short side is at least min_side."""
    factor = max(1, min_side // max(1, min(frames.shape[1:3])))
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def write_clip_files(frames: np.ndarray, out_dir: Path, fps: float = 8.0) -> dict[str, Path]:
    """Write sample.mp4 (or sample.gif), frames.png (contact sheet) and frames.npy."""
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"frames": out_dir / "frames.npy"}
    np.save(paths["frames"], frames)
    big = upscale(frames)
    sheet = np.concatenate(list(big), axis=1)
    paths["contact_sheet"] = out_dir / "frames.png"
    Image.fromarray(sheet).save(paths["contact_sheet"])
    try:
        import imageio.v2 as imageio

        video = out_dir / "sample.mp4"
        imageio.mimwrite(video, list(_even(big)), fps=fps, macro_block_size=1)
    except Exception:  # no ffmpeg here: a GIF needs nothing beyond Pillow
        video = out_dir / "sample.gif"
        images = [Image.fromarray(f) for f in big]
        images[0].save(video, save_all=True, append_images=images[1:],
                       duration=int(1000 / fps), loop=0)
    paths["video"] = video
    return paths


def _even(frames: np.ndarray) -> np.ndarray:
    h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
    return frames[:, :h, :w]


def write_validation_files(clips: list[np.ndarray], out: Path) -> dict:
    """One validation weight set: frames.npy of every clip, grid.png (one row a clip) and a
    clip-<i>/ directory each (write_clip_files)."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    frames = np.stack(clips)
    np.save(out / "frames.npy", frames)
    rows = [np.concatenate(list(upscale(c, 64)), axis=1) for c in clips]
    Image.fromarray(np.concatenate(rows, axis=0)).save(out / "grid.png")
    # Each mp4 is an ffmpeg process (~45 ms, mostly its start-up), so the clips are written a
    # few at a time: 16 of them took 0.8-1.2 s of every validation one after the other.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        written = pool.map(write_clip_files, clips,
                           [out / f"clip-{i:02d}" for i in range(len(clips))])
        videos = [str(paths["video"]) for paths in written]
    return {"grid": str(out / "grid.png"), "frames": str(out / "frames.npy"), "videos": videos}


PAD = 8          # pixels around every clip and block
FRAME_GAP = 2    # pixels between the frames of a strip
LINE = 14        # height of one text line
TITLE = 22       # height of a block's title row
BACKGROUND = (24, 24, 24)
TEXT, RIGHT, WRONG = (230, 230, 230), (90, 210, 90), (235, 80, 80)


@dataclasses.dataclass(frozen=True)
class GridBlock:
    """One block of the grid: a title and clips with their labels."""

    title: str
    clips: Sequence[np.ndarray]             # uint8 [T, H, W, 3] each, all the same shape
    labels: Sequence[str]                   # drawn under each clip
    verdicts: Sequence[str | None] = ()     # per clip: None = read right, else what was read


@dataclasses.dataclass(frozen=True)
class GridLayout:
    """Where things go: every clip is a cell of cell_w x cell_h pixels."""

    columns: int
    scale: int
    cell_w: int
    cell_h: int
    clip_h: int

    def block_height(self, num_clips: int) -> int:
        rows = math.ceil(num_clips / self.columns)
        return TITLE + rows * (self.cell_h + PAD)

    def width(self) -> int:
        return PAD + self.columns * (self.cell_w + PAD)

    def cell_origin(self, top: int, index: int) -> tuple[int, int]:
        """(x, y) of clip `index`'s first frame in a block that starts at row `top`."""
        row, col = divmod(index, self.columns)
        return PAD + col * (self.cell_w + PAD), top + TITLE + row * (self.cell_h + PAD)


def grid_layout(clip_shape: Sequence[int], *, columns: int, frame_px: int) -> GridLayout:
    """The layout for clips of shape [T, H, W, 3]: frames upscaled by a whole factor so the
    shorter side is about frame_px, two text lines under each strip."""
    frames, height, width = (int(v) for v in clip_shape[:3])
    scale = max(1, frame_px // max(1, min(height, width)))
    cell_w = frames * width * scale + (frames - 1) * FRAME_GAP
    clip_h = height * scale
    return GridLayout(columns=columns, scale=scale, cell_w=cell_w, cell_h=clip_h + 2 * LINE,
                      clip_h=clip_h)


def render_grid(blocks: Sequence[GridBlock], *, columns: int = 4, frame_px: int = 32):
    """The grid as a PIL image. Raises ValueError for no clips or clips of differing shapes."""
    from PIL import Image, ImageDraw, ImageFont

    shapes = {tuple(np.shape(c)) for b in blocks for c in b.clips}
    if len(shapes) != 1:
        raise ValueError(f"a grid needs clips of one shape [T, H, W, 3], got {sorted(shapes)}")
    layout = grid_layout(next(iter(shapes)), columns=columns, frame_px=frame_px)
    height = PAD + sum(layout.block_height(len(b.clips)) + PAD for b in blocks)
    image = Image.new("RGB", (layout.width(), height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    top = PAD
    for block in blocks:
        draw.text((PAD, top + 4), block.title, fill=TEXT, font=font)
        for i, (clip, label) in enumerate(zip(block.clips, block.labels)):
            x, y = layout.cell_origin(top, i)
            image.paste(Image.fromarray(_strip(np.asarray(clip), layout.scale)), (x, y))
            verdict = block.verdicts[i] if i < len(block.verdicts) else None
            draw.text((x, y + layout.clip_h + 1), label, fill=WRONG if verdict else RIGHT,
                      font=font)
            if verdict:
                draw.text((x, y + layout.clip_h + 1 + LINE), verdict, fill=WRONG, font=font)
        top += layout.block_height(len(block.clips)) + PAD
    return image


def _strip(clip: np.ndarray, scale: int) -> np.ndarray:
    """Frames [T, H, W, 3] side by side, each upscaled `scale` times, FRAME_GAP apart."""
    big = clip.repeat(scale, axis=1).repeat(scale, axis=2)
    gap = np.full((big.shape[1], FRAME_GAP, 3), BACKGROUND, dtype=np.uint8)
    parts = []
    for i, frame in enumerate(big):
        if i:
            parts.append(gap)
        parts.append(frame)
    return np.concatenate(parts, axis=1)


def write_validation_grid(path: str | os.PathLike, blocks: Sequence[GridBlock], **layout) -> Path:
    """Render the grid and write it as PNG at `path` (atomically: readers never see half)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    render_grid(blocks, **layout).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def detection_verdicts(per_caption: Sequence[dict]) -> list[str | None]:
    """Per caption of trainer.evaluation.evaluate.score_clips: None when colour and direction were read
    right, else what the detector read ("read: red, none")."""
    verdicts = []
    for row in per_caption:
        if "objects" in row:  # trainer.evaluation.scene_checker's rows
            verdicts.append(_scene_verdict(row))
        elif row["colour_ok"] and row["direction_ok"]:
            verdicts.append(None)
        else:
            verdicts.append(f"read: {row['detected_colour'] or 'no colour'}, "
                            f"{row['detected_direction'] or 'no motion'}")
    return verdicts


def _scene_verdict(row: dict) -> str | None:
    """None when every object and the count were read right, else what the checker read."""
    parts = ("colour", "shape", "direction", "speed")
    if row["count_ok"] and all(o[f"{p}_ok"] for o in row["objects"] for p in parts):
        return None
    read = [" ".join(str(o["detected"][p]) for p in parts) if o["detected"] else "nothing"
            for o in row["objects"]]
    return f"read {row['detected_count']}: " + "; ".join(read)
