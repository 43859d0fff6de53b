import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from trainer.data import synthetic
from trainer.data.synthetic import (
    CAPTION_VOCAB,
    COLOURS,
    DIRECTIONS,
    SHAPES,
    ensure_dataset,
    generate_dataset,
    make_caption,
    make_clip,
)
from trainer.encoders.text import StandInTextEncoder, tokenize


def _decode(row, prefix):
    return np.frombuffer(row[f"{prefix}_bytes"], dtype=row[f"{prefix}_dtype"]).reshape(row[f"{prefix}_shape"])


def _rows(directory):
    return [row for path in sorted(directory.glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def test_clips_are_deterministic_per_seed_and_index():
    spec_a, clip_a = make_clip(7, 3)
    spec_b, clip_b = make_clip(7, 3)
    assert spec_a == spec_b and np.array_equal(clip_a, clip_b)
    assert not np.array_equal(clip_a, make_clip(8, 3)[1])


def test_clip_is_black_background_with_values_in_range():
    _, clip = make_clip(0, 0, num_frames=8, height=16, width=16)
    assert clip.shape == (3, 8, 16, 16) and clip.dtype == np.float32
    assert clip.min() == -1.0 and clip.max() <= 1.0
    assert (clip == -1.0).all(axis=0).mean() > 0.7  # mostly black


@pytest.mark.parametrize("size", [(8, 16, 16), (16, 16, 16), (8, 24, 32)])
def test_shape_stays_inside_the_frame_on_every_frame(size):
    frames, height, width = size
    for index in range(100):
        spec, clip = make_clip(1, index, num_frames=frames, height=height, width=width)
        lit = (clip > -1.0).any(axis=0)  # [T, H, W]
        assert lit.any(axis=(1, 2)).all(), spec
        dx, dy = synthetic.DIRECTION_STEP[spec.direction]
        travel = spec.speed * (frames - 1)
        half = spec.size / 2 - 1e-9
        for x, y in [(spec.start_x, spec.start_y), (spec.start_x + dx * travel, spec.start_y + dy * travel)]:
            assert half <= x <= width - half and half <= y <= height - half, spec


def test_up_moves_toward_row_zero_and_right_toward_larger_columns():
    for index in range(200):
        spec, clip = make_clip(2, index)
        lit = (clip > -1.0).any(axis=0)
        rows = [np.nonzero(frame)[0].mean() for frame in lit]
        cols = [np.nonzero(frame)[1].mean() for frame in lit]
        moved = {"up": rows[0] - rows[-1], "down": rows[-1] - rows[0],
                 "left": cols[0] - cols[-1], "right": cols[-1] - cols[0]}[spec.direction]
        assert moved >= 5, (spec, moved)


def test_caption_vocabulary_covers_every_caption_word():
    for shape in SHAPES:
        for colour in COLOURS:
            for direction in DIRECTIONS:
                assert set(tokenize(make_caption(shape, colour, direction))) <= set(CAPTION_VOCAB)
    assert make_caption("square", "red", "left") == "a red square moving left"


def test_parquet_rows_round_trip_to_the_generated_clips(tmp_path):
    generate_dataset(tmp_path, 10, seed=4, samples_per_shard=4, text_dim=16, max_text_tokens=8)
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == [
        "shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    schema = pq.read_schema(tmp_path / "shard-00000.parquet")
    assert schema.equals(synthetic.DATASET_SCHEMA)

    encoder = StandInTextEncoder(16, 8, 0)
    rows = _rows(tmp_path)
    assert len(rows) == 10
    for index, row in enumerate(rows):
        spec, clip = make_clip(4, index)
        latent = _decode(row, "vae_latent")
        assert row["vae_latent_shape"] == [3, 8, 16, 16] and np.array_equal(latent, clip)
        assert np.array_equal(_decode(row, "first_frame_latent"), clip[:, :1])
        hidden, mask = encoder.encode([row["caption"]])
        assert np.array_equal(_decode(row, "text_embedding"), hidden[0, mask[0]].numpy())
        assert row["text_embedding_shape"] == [5, 16]
        assert row["caption"] == make_caption(row["shape"], row["colour"], row["direction"])
        assert (row["shape"], row["colour"], row["direction"]) == (spec.shape, spec.colour, spec.direction)
        assert (row["start_x"], row["start_y"]) == (spec.start_x, spec.start_y)
        assert row["media_type"] == "video" and row["num_frames"] == 8
        assert (row["width"], row["height"]) == (16, 16)
        assert row["duration_sec"] == pytest.approx(8 / row["fps"])
    assert len({row["id"] for row in rows}) == 10


def test_generation_is_reproducible_from_the_seed(tmp_path):
    generate_dataset(tmp_path / "a", 6, seed=9)
    generate_dataset(tmp_path / "b", 6, seed=9)
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    assert (tmp_path / "a" / "dataset.json").read_text() == (tmp_path / "b" / "dataset.json").read_text()


def test_generate_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "old.parquet").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        generate_dataset(tmp_path, 2, seed=0)


def test_ensure_dataset_reuses_a_matching_cache(tmp_path):
    out = tmp_path / "data"
    ensure_dataset(out, 6, seed=1)
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["params"]["num_samples"] == 6 and manifest["params"]["seed"] == 1
    stamp = (out / "shard-00000.parquet").stat().st_mtime_ns
    ensure_dataset(out, 6, seed=1)
    assert (out / "shard-00000.parquet").stat().st_mtime_ns == stamp


def test_ensure_dataset_regenerates_when_params_differ(tmp_path):
    out = tmp_path / "data"
    ensure_dataset(out, 6, seed=1)
    ensure_dataset(out, 4, seed=2, samples_per_shard=2)
    rows = _rows(out)
    assert len(rows) == 4 and rows[0]["id"].startswith("shapes-s2-")
    assert json.loads((out / "dataset.json").read_text())["params"]["seed"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no temp or old dirs left


def test_ensure_dataset_replaces_a_half_written_dataset(tmp_path):
    out = tmp_path / "data"
    generate_dataset(out, 4, seed=0, samples_per_shard=2)
    (out / "dataset.json").unlink()  # as if killed before the manifest was written
    (out / "shard-00001.parquet").unlink()
    ensure_dataset(out, 4, seed=0, samples_per_shard=2)
    assert len(_rows(out)) == 4


def test_ensure_dataset_never_replaces_foreign_directories(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        ensure_dataset(out, 2, seed=0)
    assert (out / "notes.txt").read_text() == "keep me"


def test_ensure_dataset_does_not_publish_a_failed_generation(tmp_path, monkeypatch):
    out = tmp_path / "data"

    def broken_row(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(synthetic, "_make_row", broken_row)
    with pytest.raises(RuntimeError, match="killed"):
        ensure_dataset(out, 3, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_worker_processes_write_the_same_dataset_as_one_process(tmp_path):
    # Large sets are written by several processes (one per spare core); the bytes must not
    # depend on it, or a cache written on one machine would not be the one another expects.
    kwargs = dict(seed=3, num_frames=4, height=16, width=16, samples_per_shard=8,
                  generator="bench")
    one = generate_dataset(tmp_path / "one", 24, workers=1, **kwargs)
    two = generate_dataset(tmp_path / "two", 24, workers=2, **kwargs)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    assert len([n for n in names if n.endswith(".parquet")]) == 3
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
