"""The validation grid: one picture per validation step, every caption's clip in its own panel."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from trainer.evaluation.evaluate import EVAL_CAPTIONS
from trainer.evaluation.media import GridBlock, detection_verdicts, write_validation_grid


def solid_clips(count: int, frames: int = 8, size: int = 16) -> list[np.ndarray]:
    """Clips whose every frame is one colour, distinct per clip and frame, so a panel's
    pixels say which clip and frame landed there."""
    clips = []
    for i in range(count):
        clip = np.zeros((frames, size, size, 3), dtype=np.uint8)
        for t in range(frames):
            clip[t] = (40 + 10 * i, 60 + 20 * t, 200)
        clips.append(clip)
    return clips


def test_grid_has_one_panel_per_clip_in_columns_with_frames_left_to_right(tmp_path):
    captions = list(EVAL_CAPTIONS[:16])
    blocks = [GridBlock("sft step 100, live", solid_clips(16), captions),
              GridBlock("sft step 100, ema", solid_clips(16), captions)]
    path = write_validation_grid(tmp_path / "grid.png", blocks, columns=4, frame_px=32)
    image = np.asarray(Image.open(path).convert("RGB"))
    # 8 frames of 16 px at 2x = 32 px each, 2 px apart: 270 px strips; 8 px around everything.
    strip, pad, gap = 8 * 32 + 7 * 2, 8, 2
    cell_h = 32 + 2 * 14  # the frames, then two lines of text
    block_h = 22 + 4 * (cell_h + pad)  # a title row, then 4 rows of 4 clips
    assert image.shape == (pad + 2 * (block_h + pad), pad + 4 * (strip + pad), 3)
    for b in range(2):
        for i in range(16):
            row, col = divmod(i, 4)
            x = pad + col * (strip + pad)
            y = pad + b * (block_h + pad) + 22 + row * (cell_h + pad)
            for t in (0, 7):
                centre = image[y + 16, x + t * (32 + gap) + 16]
                assert tuple(centre) == (40 + 10 * i, 60 + 20 * t, 200), (b, i, t)


def test_a_partial_last_row_and_clips_of_two_shapes(tmp_path):
    path = write_validation_grid(tmp_path / "g.png", [GridBlock("x", solid_clips(5), ["c"] * 5)],
                                 columns=4, frame_px=32)
    width, height = Image.open(path).size
    assert (width, height) == (8 + 4 * (270 + 8), 8 + 22 + 2 * (60 + 8) + 8)
    assert not list(tmp_path.glob("*.tmp"))
    mixed = solid_clips(1) + solid_clips(1, frames=4)
    with pytest.raises(ValueError, match="one shape"):
        write_validation_grid(tmp_path / "bad.png", [GridBlock("x", mixed, ["a", "b"])])


def test_wrong_detections_say_what_was_read():
    rows = [{"colour_ok": True, "direction_ok": True, "detected_colour": "red",
             "detected_direction": "left"},
            {"colour_ok": True, "direction_ok": False, "detected_colour": "red",
             "detected_direction": None}]
    assert detection_verdicts(rows) == [None, "read: red, no motion"]
