import numpy as np
import pytest
import torch

from trainer.encoders.vae import latents_to_frames
from trainer.evaluation.evaluate import EVAL_CAPTIONS, detect_clip, parse_caption, score_clips
from trainer.data.synthetic import COLOURS, DIRECTIONS, SHAPES, make_clip


@pytest.fixture(scope="module")
def generated():
    """200 real clips as uint8 frames, with their captions."""
    pairs = [make_clip(11, index) for index in range(200)]
    return [latents_to_frames(clip) for _, clip in pairs], [spec.caption for spec, _ in pairs]


def test_generated_clips_are_detected_correctly(generated):
    clips, captions = generated
    scores = score_clips(clips, captions)
    assert scores["num_clips"] == 200
    assert scores["colour_accuracy"] >= 0.98
    assert scores["direction_accuracy"] >= 0.98


def test_blank_clips_detect_nothing_and_score_zero():
    blank = np.zeros((8, 16, 16, 3), dtype=np.uint8)
    detected = detect_clip(blank)
    assert detected["colour"] is None and detected["direction"] is None
    scores = score_clips([blank] * 4, list(EVAL_CAPTIONS[:4]))
    assert scores["colour_accuracy"] == 0 and scores["direction_accuracy"] == 0


def test_clips_shuffled_in_time_lose_direction_but_keep_colour(generated):
    clips, captions = generated
    rng = np.random.default_rng(0)
    shuffled = [clip[rng.permutation(len(clip))] for clip in clips]
    scores = score_clips(shuffled, captions)
    assert scores["direction_accuracy"] <= 0.5
    assert scores["colour_accuracy"] >= 0.98


def test_reversed_clips_are_detected_as_the_opposite_direction(generated):
    clips, captions = generated
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    detected = [detect_clip(clip[::-1])["direction"] for clip in clips[:50]]
    expected = [opposite[parse_caption(caption)[2]] for caption in captions[:50]]
    assert detected == expected


def test_noise_scores_low(generated):
    _, captions = generated
    rng = np.random.default_rng(1)
    noise = [rng.integers(0, 256, size=(8, 16, 16, 3), dtype=np.uint8) for _ in captions]
    scores = score_clips(noise, captions)
    assert scores["colour_accuracy"] <= 0.1 and scores["direction_accuracy"] <= 0.1


def test_a_static_shape_has_a_colour_but_no_direction():
    _, clip = make_clip(0, 0)
    still = latents_to_frames(clip)[[0] * 8]
    detected = detect_clip(still)
    assert detected["colour"] is not None and detected["direction"] is None


def test_up_means_toward_the_top_row():
    frames = np.zeros((8, 16, 16, 3), dtype=np.uint8)
    for t in range(8):
        frames[t, 12 - t : 15 - t, 6:9] = (0, 0, 255)
    detected = detect_clip(frames)
    assert (detected["colour"], detected["direction"]) == ("blue", "up")


def test_off_palette_colour_is_not_forced_onto_the_nearest():
    frames = np.zeros((8, 16, 16, 3), dtype=np.uint8)
    for t in range(8):
        frames[t, 6:10, 2 + t : 6 + t] = (200, 200, 200)  # grey moving right
    detected = detect_clip(frames)
    assert detected["colour"] is None and detected["direction"] == "right"


def test_per_caption_rows_report_expected_and_detected(generated):
    clips, captions = generated
    row = score_clips(clips[:1], captions[:1])["per_caption"][0]
    _, colour, direction = parse_caption(captions[0])
    assert row == {"caption": captions[0], "expected_colour": colour, "detected_colour": colour,
                   "expected_direction": direction, "detected_direction": direction,
                   "colour_ok": True, "direction_ok": True}


def test_parse_caption_reads_shape_colour_direction():
    assert parse_caption("a green circle moving up") == ("circle", "green", "up")
    assert parse_caption("A Red thing") == (None, "red", None)
    with pytest.raises(ValueError):
        parse_caption("a red blue square moving left")


def test_eval_captions_cover_every_colour_direction_and_shape():
    parsed = {parse_caption(caption) for caption in EVAL_CAPTIONS}
    assert len(EVAL_CAPTIONS) == len(parsed) == len(SHAPES) * len(COLOURS) * len(DIRECTIONS)


def test_latents_to_frames_maps_minus_one_to_black_and_one_to_white():
    latent = torch.full((3, 2, 4, 4), -1.0)
    latent[:, 1] = 1.5  # out of range is clipped
    frames = latents_to_frames(latent)
    assert frames.shape == (2, 4, 4, 3) and frames.dtype == np.uint8
    assert (frames[0] == 0).all() and (frames[1] == 255).all()
    with pytest.raises(ValueError):
        latents_to_frames(torch.zeros(2, 3, 3, 4, 4))


def test_score_clips_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        score_clips([np.zeros((8, 16, 16, 3), np.uint8)], [])
    with pytest.raises(ValueError, match="no colour"):
        score_clips([np.zeros((8, 16, 16, 3), np.uint8)], ["a square moving left"])
