"""The trainer with a real VAE and text encoder: validation clips decoded by a tiny
AutoencoderKLWan into mp4, and data that stores captions but no caption embeddings, encoded by
a tiny UMT5 encoder as it is read. The models are randomly initialised and saved with
save_pretrained into a temp directory, so the real loading code runs on small data."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("transformers", reason="needs the encode extra")
pytest.importorskip("diffusers", reason="needs the encode extra")
imageio = pytest.importorskip("imageio.v3")

from fixtures.fastvideo_t2v import write_fastvideo_dataset
from fixtures.tiny_encoders import save_text_encoder, save_vae
from test_data_train import MODEL, _losses, _train

from trainer.resolve import resolve_args
from trainer.data.formats import TEXT_COLUMNS
from trainer.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def drop_caption_embeddings(source: Path, target: Path) -> Path:
    """A copy of a dataset without its text_embedding_* columns, row group for row group (so
    the epoch order, which permutes row groups, is the same)."""
    for shard in sorted(source.rglob("*.parquet")):
        file = pq.ParquetFile(shard)
        out = target / shard.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        keep = [c for c in file.schema_arrow.names if c not in TEXT_COLUMNS]
        tables = [file.read_row_group(g, columns=keep) for g in range(file.num_row_groups)]
        with pq.ParquetWriter(out, tables[0].schema) as writer:
            for table in tables:
                writer.write_table(table)
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    save_text_encoder(root / "text")
    save_vae(root / "vae")
    return root / "vae", root / "text"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    full = write_fastvideo_dataset(root / "full", 24, dtype=torch.float32)
    return full, drop_caption_embeddings(full, root / "captions-only")


def test_validation_decodes_samples_through_the_vae_into_mp4(models, datasets, tmp_path):
    vae, text = models
    out = tmp_path / "run"
    _train(datasets[0], out, 2, "--packed_dataloader_num_workers", "0", "--vae_path", str(vae),
           "--text_encoder", str(text), "--validation_interval", "2",
           "--validation_num_captions", "2", "--validation_steps", "2")
    config = json.loads((vae / "config.json").read_text())
    temporal, spatial = config["scale_factor_temporal"], config["scale_factor_spatial"]
    # The data's first sample (the shape validation samples) is a [4, 3, 4, 6] latent.
    frames, height, width = 1 + 2 * temporal, 4 * spatial, 6 * spatial
    weights = out / "samples" / "step-2" / "live"
    assert json.loads((out / "samples" / "step-2" / "manifest.json").read_text())["captions"]
    assert list(np.load(weights / "frames.npy").shape) == [2, frames, height, width, 3]
    video = imageio.imread(weights / "clip-00" / "sample.mp4", plugin="FFMPEG", index=None)
    scale = 128 // min(height, width)  # media.upscale: tiny clips are shown larger
    assert video.shape == (frames, height * scale, width * scale, 3)


def test_captions_without_embeddings_are_encoded_and_the_run_resumes_exactly(models, datasets,
                                                                              tmp_path):
    _, text = models
    encoder = ("--text_encoder", str(text))  # and 2 loader workers, as _train runs them
    _train(datasets[1], tmp_path / "reference", 6, *encoder)
    _train(datasets[1], tmp_path / "resumed", 4, *encoder)
    _train(datasets[1], tmp_path / "resumed", 6, *encoder)
    reference, resumed = _losses(tmp_path / "reference"), _losses(tmp_path / "resumed")
    assert sorted(reference) == list(range(1, 7)) and all(map(math.isfinite, reference.values()))
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]


def _resolve(tmp_path, *argv):
    return resolve_args(["--config", str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                         "--transformer_config_overrides", MODEL, "--synthetic_data", "false",
                         # 4-channel latents validate only through a VAE (these check the rest)
                         "--validation_interval", "-1",
                         "--output_dir", str(tmp_path / "out"), *argv])[0]


def test_preflight_refuses_captions_only_data_without_a_real_text_encoder(models, datasets, tmp_path):
    with pytest.raises(ConfigError, match="stores captions but no caption embeddings.*'standin'"):
        _resolve(tmp_path, "--data_path", str(datasets[1]))
    assert _resolve(tmp_path, "--data_path", str(datasets[1]), "--text_encoder", str(models[1]))


def test_preflight_checks_the_vae_directory_before_anything_starts(models, datasets, tmp_path):
    vae = models[0]
    base = ("--data_path", str(datasets[0]))
    assert _resolve(tmp_path, *base, "--vae_path", str(vae)).vae_path == str(vae)
    with pytest.raises(ConfigError, match="holds no config.json"):
        _resolve(tmp_path, *base, "--vae_path", str(tmp_path))
    broken = tmp_path / "vae-without-weights"
    broken.mkdir()
    (broken / "config.json").write_text((vae / "config.json").read_text())
    with pytest.raises(ConfigError, match="no weights"):
        _resolve(tmp_path, *base, "--vae_path", str(broken))
    with pytest.raises(ConfigError, match="4-channel latents but the model's in_channels is 3"):
        _resolve(tmp_path, *base, "--vae_path", str(vae), "--transformer_config_overrides",
                 MODEL.replace("in_channels: 4", "in_channels: 3"))


@pytest.mark.parametrize("token_budget", [None, 300])
def test_captions_encoded_as_read_equal_the_embeddings_stored_by_the_same_encoder(tmp_path, token_budget):
    """The embedded data stores the stand-in's embeddings: its captions-only copy, encoded by
    the loader with the same stand-in, gives the same batches, stacked or packed."""
    from trainer.data import DistributedBatchIterator, ParquetLatentDataset
    from trainer.data.synthetic import generate_dataset
    from trainer.encoders.text import StandInTextEncoder

    full = generate_dataset(tmp_path / "full", 12, seed=0, samples_per_shard=4)
    bare = drop_caption_embeddings(full, tmp_path / "bare")
    pad = token_budget is None

    def batches(data, encoder=None):
        dataset = ParquetLatentDataset(str(data), pad_text=pad, max_text_tokens=8 if pad else None,
                                       caption_tokens=8)
        loader = DistributedBatchIterator(dataset, batch_size=3, dp_rank=0, dp_world=1, seed=1,
                                          token_budget=token_budget, patch_size=(1, 4, 4),
                                          caption_encoder=encoder)
        return [loader.next_batch() for _ in range(3)]

    encoder = StandInTextEncoder(text_dim=32, max_tokens=8)
    for stored, encoded in zip(batches(full), batches(bare, encoder)):
        assert stored["ids"] == encoded["ids"] and len(stored["ids"]) > 1
        for key in ("text", "text_mask"):
            a, b = stored[key], encoded[key]
            for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                assert torch.equal(x, y), key
