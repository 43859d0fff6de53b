"""The benchmark's scenes and their pixel checker (trainer.data.synthetic_bench, trainer.evaluation.scene_checker).

The checker must read the generator's own clips right on every attribute (else a low score
says nothing about a model), and read deliberately wrong clips as wrong (else a high score
says nothing either). The wrong clips are rendered by the generator with one attribute
changed and scored against the original caption.
"""

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from trainer.data import synthetic_bench as bench
from trainer.encoders.vae import latents_to_frames
from trainer.evaluation.scene_checker import parse_caption, score_scenes
from trainer.data.synthetic import ensure_dataset, make_clip
from trainer.encoders.text import StandInTextEncoder

FRAMES, SIZE = 16, 32


def _scenes(count, seed=11):
    return [bench.make_scene(seed, i, num_frames=FRAMES, height=SIZE, width=SIZE)[0]
            for i in range(count)]


def _frames(scene):
    return latents_to_frames(bench.render_scene(scene, num_frames=FRAMES, height=SIZE, width=SIZE))


def _changed(scene, **change):
    """The scene with its first object's attributes replaced (the rest as generated)."""
    first = dataclasses.replace(scene.objects[0], **change)
    return bench.SceneSpec((first, *scene.objects[1:]))


def test_generator_clips_score_full_marks_on_every_attribute():
    scenes = _scenes(120)
    report = score_scenes([_frames(s) for s in scenes], [s.caption for s in scenes])
    assert report["shape_accuracy"] >= 0.9, report["shape_accuracy"]
    for attribute in ("colour", "direction", "speed", "count"):
        assert report[f"{attribute}_accuracy"] >= 0.98, (attribute, report[f"{attribute}_accuracy"])
    assert report["fidelity"] > 0.85 and report["temporal_consistency"] > 0.9
    # The set exercises what it claims to: both object counts, outline shapes, diagonals.
    objects = [o for s in scenes for o in s.objects]
    assert {len(s.objects) for s in scenes} == {1, 2}
    assert {"frame", "ring"} <= {o.shape for o in objects}
    assert {o.direction for o in objects} == set(bench.DIRECTIONS)


def test_outline_shapes_are_told_from_filled_ones():
    scenes = [s for s in _scenes(200) if s.objects[0].shape in ("square", "circle")][:30]
    hollow = {"square": "frame", "circle": "ring"}
    swapped = [_changed(s, shape=hollow[s.objects[0].shape]) for s in scenes]
    right = score_scenes([_frames(s) for s in swapped], [s.caption for s in swapped])
    wrong = score_scenes([_frames(s) for s in swapped], [s.caption for s in scenes])
    first_ok = [row["objects"][0]["shape_ok"] for row in wrong["per_caption"]]
    assert right["shape_accuracy"] >= 0.9
    assert sum(first_ok) <= 3, first_ok  # a hollow shape is not read as the filled one


@pytest.mark.parametrize("attribute", ["colour", "shape", "direction"])
def test_wrong_clips_score_low_on_the_wrong_attribute(attribute):
    scenes = [s for s in _scenes(80) if len(s.objects) == 1][:30]
    rng = np.random.default_rng(0)
    vocab = {"colour": bench.COLOURS, "shape": bench.SHAPES, "direction": bench.DIRECTIONS}[attribute]
    wrong = []
    for scene in scenes:
        current = getattr(scene.objects[0], attribute)
        others = [v for v in vocab if v != current]
        if attribute == "direction":  # the opposite way: the path stays inside the frame
            ux, uy = bench.DIRECTION_UNIT[current]
            others = [d for d, u in bench.DIRECTION_UNIT.items() if u == (-ux, -uy) or
                      np.allclose(u, (-ux, -uy))]
            obj = scene.objects[0]
            span = FRAMES - 1
            end_x, end_y = obj.centre(span)
            wrong.append(bench.SceneSpec((dataclasses.replace(
                obj, direction=others[0], start_x=end_x, start_y=end_y),)))
            continue
        wrong.append(_changed(scene, **{attribute: others[rng.integers(len(others))]}))
    report = score_scenes([_frames(s) for s in wrong], [s.caption for s in scenes])
    assert report[f"{attribute}_accuracy"] <= 0.15, report[f"{attribute}_accuracy"]
    right = score_scenes([_frames(s) for s in wrong], [s.caption for s in wrong])
    assert right[f"{attribute}_accuracy"] >= 0.9


def test_blank_and_noise_clips_score_nothing():
    scenes = _scenes(8)
    blank = np.zeros((FRAMES, SIZE, SIZE, 3), dtype=np.uint8)
    noise = np.random.default_rng(1).integers(0, 256, (FRAMES, SIZE, SIZE, 3)).astype(np.uint8)
    for clip in (blank, noise):
        report = score_scenes([clip] * len(scenes), [s.caption for s in scenes])
        assert report["colour_accuracy"] <= 0.25 and report["shape_accuracy"] <= 0.25
        assert report["direction_accuracy"] <= 0.25 and report["mean_score"] < 0.3


def test_a_missing_second_object_fails_the_count():
    scene = next(s for s in _scenes(60) if len(s.objects) == 2)
    alone = bench.SceneSpec(scene.objects[:1])
    report = score_scenes([_frames(alone)], [scene.caption])
    assert report["count_accuracy"] == 0.0
    row = report["per_caption"][0]
    assert row["objects"][0]["colour_ok"] and not row["objects"][1]["colour_ok"]


def test_captions_parse_into_their_objects():
    parsed = parse_caption("a red ring moving quickly up left and a white square moving slowly down")
    assert parsed == [
        {"shape": "ring", "colour": "red", "direction": "up left", "speed": "quickly"},
        {"shape": "square", "colour": "white", "direction": "down", "speed": "slowly"}]
    assert parse_caption("an orange frame moving slowly down right")[0]["colour"] == "orange"
    for scene in _scenes(40):
        assert [o["shape"] for o in parse_caption(scene.caption)] == [o.shape for o in scene.objects]


def test_objects_stay_inside_the_frame_and_speeds_keep_their_gap():
    for scene in _scenes(200, seed=3):
        for obj in scene.objects:
            for t in (0, FRAMES - 1):
                cx, cy = obj.centre(t)
                assert obj.size / 2 - 1e-6 <= cx <= SIZE - obj.size / 2 + 1e-6
                assert obj.size / 2 - 1e-6 <= cy <= SIZE - obj.size / 2 + 1e-6
            travel = obj.speed * (FRAMES - 1) / SIZE
            lo, hi = bench.SPEED_TRAVEL[obj.speed_word]
            assert lo - 1e-9 <= travel <= hi + 1e-9


def test_bench_dataset_writes_scenes_and_leaves_the_default_alone(tmp_path):
    out = ensure_dataset(tmp_path / "bench", 6, seed=5, num_frames=FRAMES, height=SIZE,
                         width=SIZE, max_text_tokens=16, generator="bench")
    rows = [r for p in sorted(out.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["params"]["generator"] == "bench"
    assert manifest["params"]["text_encoder"]["positional"] is True
    for i, row in enumerate(rows):
        scene, latent = bench.make_scene(5, i, num_frames=FRAMES, height=SIZE, width=SIZE)
        stored = np.frombuffer(row["vae_latent_bytes"], np.float32).reshape(row["vae_latent_shape"])
        assert row["caption"] == scene.caption and np.array_equal(stored, latent)
        assert len(json.loads(row["scene"])) == len(scene.objects)
    # The default generator's cache keeps its manifest (no generator key, no positional text).
    tiny = ensure_dataset(tmp_path / "tiny", 2, seed=0)
    params = json.loads((tiny / "dataset.json").read_text())["params"]
    assert "generator" not in params and "positional" not in params["text_encoder"]
    row = pq.read_table(next(tiny.glob("*.parquet"))).to_pylist()[0]
    assert row["caption"] == make_clip(0, 0)[0].caption


def test_positional_captions_bind_words_to_their_place():
    plain, positional = StandInTextEncoder(32, 16), StandInTextEncoder(32, 16, positional=True)
    swapped = ["a red ring and a blue square", "a blue ring and a red square"]
    for encoder, differ in ((plain, False), (positional, True)):
        hidden, _ = encoder.encode(swapped)
        # Bag of words: the same set of vectors in both captions unless positions are added.
        same_set = np.allclose(np.sort(hidden[0].numpy(), axis=0), np.sort(hidden[1].numpy(), axis=0))
        assert same_set != differ
