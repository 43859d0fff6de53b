"""The files a user looks at: clips as video + contact sheet + raw frames, validation grids.

Frames are uint8 [T, H, W, 3]. Tiny clips are upscaled by pixel repetition so they can be seen.
"""

from __future__ import annotations

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
    videos = []
    for i, clip in enumerate(clips):
        paths = write_clip_files(clip, out / f"clip-{i:02d}")
        videos.append(str(paths["video"]))
    return {"grid": str(out / "grid.png"), "frames": str(out / "frames.npy"), "videos": videos}
