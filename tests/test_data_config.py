"""The seed's data keys load, and contradictory data settings are refused before anything runs."""

import warnings

import pytest
from fixtures.fastvideo_t2v import write_fastvideo_dataset

from trainer.resolve import resolve_args
from trainer.config.schema import ConfigError

SEED_KEYS = """
data:
  data_path: {data}
  packed_dataloader_num_workers: 4
  packed_dataloader_prefetch_factor: 2
  image_sample_prob: 0.1
  packing_token_budget: 4096
model:
  text_encoder_hidden_state_skip_layer: 2
tasks:
  conditioning_schema: [t2v, i2v]
  image_cond_prob: 0.2
output:
  output_dir: {out}
  resume_video_csv: false
"""


def _config(tmp_path, text):
    if not (tmp_path / "data").exists():  # videos and images for the default model (preflight reads them)
        write_fastvideo_dataset(tmp_path / "data", 6, channels=3, text_dim=32)
    path = tmp_path / "c.yaml"
    path.write_text(text.format(data=tmp_path / "data", out=tmp_path / "out"))
    return str(path)


def _resolve(tmp_path, text, *cli):
    args, _ = resolve_args(["--config", _config(tmp_path, text), *cli])
    return args


def test_a_seed_config_with_every_data_key_loads(tmp_path):
    args = _resolve(tmp_path, SEED_KEYS)
    assert args.packed_dataloader_num_workers == 4 and args.image_sample_prob == 0.1
    assert args.text_encoder_hidden_state_skip_layer == 2 and not args.resume_video_csv
    assert args.conditioning_schema == ["t2v", "i2v"] and args.packing_token_budget == 4096


@pytest.mark.parametrize("cli, message", [
    (["--video_cond_prob", "0.1"], "does not list continuation"),
    (["--image_sample_prob", "1.5"], "image_sample_prob` must lie in"),
    (["--packed_dataloader_num_workers", "-1"], "must be >= 0"),
    (["--packed_dataloader_prefetch_factor", "0"], "prefetch_factor` must be >= 1"),
    (["--packing_token_budget", "0"], "packing_token_budget` must be >= 1"),
    (["--conditioning_schema", "[t2v, t2i]"], "unknown task.*t2i"),
    (["--text_encoder", "/nonexistent/encoder"], "neither 'standin' nor a directory"),
])
def test_contradictory_data_settings_are_refused(tmp_path, cli, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(tmp_path, SEED_KEYS, *cli)


def test_a_block_causal_model_and_stage1_accept_packs(tmp_path):
    causal = _resolve(tmp_path, SEED_KEYS, "--transformer_config_overrides", "{causal_chunk_size: 2}")
    assert causal.packing_token_budget == 4096
    assert _resolve(tmp_path, SEED_KEYS, "--stage", "tf_anyflow", "--transformer_config_overrides",
                    "{causal_chunk_size: 2, two_time: true}", "--use_ema", "true").packing_token_budget == 4096


@pytest.mark.parametrize("cp", [1, 2])
def test_stage2_accepts_packs_with_and_without_context_parallel(cp):
    from test_dmd_sgf import stage_args

    args = stage_args(packing_token_budget=4096, cp_size=cp)
    assert (args.packing_token_budget, args.cp_size) == (4096, cp)


def test_resume_video_csv_without_separate_streams_warns_it_has_no_effect(tmp_path):
    text = SEED_KEYS.replace("  image_sample_prob: 0.1\n", "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _resolve(tmp_path, text)
    assert any("resume_video_csv: false` has no effect" in str(w.message) for w in caught)


def test_a_text_encoder_directory_must_match_the_models_text_dim(tmp_path):
    encoder = tmp_path / "umt5"
    encoder.mkdir()
    (encoder / "config.json").write_text('{"d_model": 64, "num_layers": 2}')
    with pytest.raises(ConfigError, match="64-wide embeddings but the model's text_dim is 32"):
        _resolve(tmp_path, SEED_KEYS, "--text_encoder", str(encoder))
    with pytest.raises(ConfigError, match="below the encoder's 2 layers"):
        _resolve(tmp_path, SEED_KEYS, "--text_encoder", str(encoder), "--text_encoder_hidden_state_skip_layer",
                 "2", "--transformer_config_overrides", "{text_dim: 64, hidden_size: 64, num_attention_heads: 4, rope_axes_dim: [4, 6, 6]}")


def test_under_packing_the_global_batch_counts_packs(tmp_path):
    """A micro-batch is one pack whatever train_batch_size says: 2 accumulated packs on 4 ranks
    are a global batch of 8, and a global batch counted in samples is refused, saying so."""
    from trainer.preflight import validate_args

    args = _resolve(tmp_path, SEED_KEYS, "--train_batch_size", "3",
                    "--gradient_accumulation_steps", "2", "--global_batch_size", "8")
    validate_args(args, world_size=4)
    wrong = _resolve(tmp_path, SEED_KEYS, "--train_batch_size", "3",
                     "--gradient_accumulation_steps", "2", "--global_batch_size", "24")
    with pytest.raises(ConfigError, match=r"1 pack a micro-batch .* = 8\."):
        validate_args(wrong, world_size=4)
