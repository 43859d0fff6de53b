"""A Wan diffusers pipeline directory end to end: the tiny random one (trainer.models.wan.tiny)
loads and samples in diffusers' own WanPipeline; relay encodes through its vae/ and
text_encoder/ + tokenizer/ exactly as diffusers and transformers do; validation decodes
through its VAE to mp4; config/pipeline/wan-tiny.yaml runs; incomplete directories are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.models.wan import tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return tiny.write_tiny_wan_pipeline(tmp_path_factory.mktemp("wan") / "tiny-wan")


def test_the_tiny_pipeline_loads_and_samples_in_diffusers(pipeline_dir):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    names = {p.name for p in pipeline_dir.iterdir()}
    assert {"model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
            "scheduler"} <= names
    pipe = WanPipeline.from_pretrained(str(pipeline_dir))
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
    assert pipe.scheduler.config.flow_shift == tiny.FLOW_SHIFT
    out = pipe("a red square moving left", negative_prompt="", height=32, width=32,
               num_frames=9, num_inference_steps=2, guidance_scale=4.0, output_type="np",
               generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (1, 9, 32, 32, 3)
    ids = pipe.tokenizer("a red square moving left").input_ids
    assert len(ids) == 6 and ids[-1] == pipe.tokenizer.eos_token_id
    assert pipe.tokenizer.unk_token_id not in ids
    # the same seed writes the same weights
    again = tiny.write_tiny_wan_pipeline(pipeline_dir.parent / "again")
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        assert (again / part).read_bytes() == (pipeline_dir / part).read_bytes()


def test_encoding_through_the_directory_equals_diffusers_and_transformers(pipeline_dir):
    """relay's encoders over the pipeline's vae/ and text_encoder/ (tokenizer/ beside it) give
    what WanPipeline's own encode_prompt and AutoencoderKLWan give, in the wan model's shapes."""
    import numpy as np
    from diffusers import WanPipeline

    from trainer.data.encode import MediaEncoder, vae_input

    pipe = WanPipeline.from_pretrained(str(pipeline_dir))
    encoder = MediaEncoder(pipeline_dir / "vae", pipeline_dir / "text_encoder")
    captions = ["a red square moving left", "a blue circle moving up"]
    hidden, mask = encoder.text.encode(captions)
    want, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                 max_sequence_length=512)
    assert hidden.shape == (2, 512, tiny.TEXT_DIM) and mask.sum(1).tolist() == [6, 6]
    torch.testing.assert_close(hidden, want.float())
    frames = np.random.default_rng(0).integers(0, 256, (9, 32, 32, 3), dtype=np.uint8)
    latent = encoder.latent(frames)
    assert tuple(latent.shape) == (tiny.LATENT_CHANNELS, 3, 4, 4)
    with torch.no_grad():
        z = pipe.vae.encode(vae_input(frames, temporal=4, spatial=8)).latent_dist.mean[0]
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(-1, 1, 1, 1)
    torch.testing.assert_close(latent, (z - mean) / std)
    # the wan model of the directory takes them
    from trainer.models.wan.family import WanFamily

    family = WanFamily()
    model = family.build(family.config_from_dir(str(pipeline_dir)))
    with torch.no_grad():
        out = model(latent[None], torch.tensor([500.0]), hidden[:1])
    assert out.shape == latent[None].shape


def _resolve(tmp_path, pipeline_dir, *extra):
    from trainer.resolve import resolve_config

    argv = ["--make_tiny_wan", "false", "--pretrained_transformer_path", str(pipeline_dir),
            "--data_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"), *extra]
    return resolve_config(str(ROOT / "config/wan/tiny-sft.yaml"), argv)


def test_the_directory_gives_the_defaults_and_explicit_values_win(pipeline_dir, tmp_path):
    args = _resolve(tmp_path, pipeline_dir)
    assert args.vae_path == str(pipeline_dir / "vae")
    assert args.text_encoder == str(pipeline_dir / "text_encoder")
    assert args.text_max_tokens == 512 and args.train_timestep_shift == tiny.FLOW_SHIFT
    assert (args.validation_steps, args.validation_guidance) == (50, 5.0)
    args = _resolve(tmp_path, pipeline_dir, "--train_timestep_shift", "5.0",
                    "--validation_steps", "7", "--text_max_tokens", "16")
    assert (args.train_timestep_shift, args.validation_steps, args.text_max_tokens) == (5.0, 7, 16)


def test_incomplete_directories_and_mismatched_data_are_refused(pipeline_dir, tmp_path):
    import shutil

    from trainer.config.schema import ConfigError

    for folder, key in (("vae", "vae/"), ("text_encoder", "text_encoder/"),
                        ("tokenizer", "tokenizer/")):
        broken = tmp_path / f"no-{folder}"
        shutil.copytree(pipeline_dir, broken)
        shutil.rmtree(broken / folder)
        with pytest.raises(ConfigError) as info:
            _resolve(tmp_path, broken)
        text = str(info.value)
        assert "is a diffusers pipeline directory" in text and key in text, text
        assert "\n" not in text
    # an explicit value is used instead of the missing folder
    broken = tmp_path / "no-vae"
    assert _resolve(tmp_path, broken, "--vae_path", str(pipeline_dir / "vae")).vae_path == \
        str(pipeline_dir / "vae")
    # data encoded for another model: the stand-in's 32-wide captions of 3-channel pixels
    from trainer.data.synthetic import ensure_dataset

    pixels = ensure_dataset(tmp_path / "pixels", 4, seed=0, num_frames=9, height=32, width=32)
    with pytest.raises(ConfigError, match="channel"):
        _resolve(tmp_path, pipeline_dir, "--synthetic_data", "false", "--data_path", str(pixels))


def _env():
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def test_relay_run_wan_tiny_writes_the_pipeline_encodes_data_fine_tunes_and_samples(tmp_path):
    """config/pipeline/wan-tiny.yaml from nothing: the tiny Wan written, the clips encoded
    through its VAE and UMT5, SFT, validation decoded through its VAE into mp4; then `relay
    sample` from the checkpoint through the same folders."""
    import json
    import subprocess
    import sys

    import imageio.v3 as iio

    root = tmp_path / "runs"
    dry = subprocess.run([sys.executable, "-m", "launcher.cli", "submit",
                          str(ROOT / "config/pipeline/wan-tiny.yaml"), "--root", str(root),
                          "--dry-run"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert not root.joinpath("tiny-wan").exists()  # a dry run writes nothing
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run",
                           str(ROOT / "config/pipeline/wan-tiny.yaml"), "--root", str(root)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (root / "tiny-wan" / "model_index.json").is_file()
    assert (root / "data" / "dataset.json").is_file()
    config = json.loads((root / "sft" / "resolved-config.json").read_text())
    assert config["vae_path"] == str(root / "tiny-wan" / "vae")
    assert config["text_encoder"] == str(root / "tiny-wan" / "text_encoder")
    assert config["train_timestep_shift"] == tiny.FLOW_SHIFT and config["text_max_tokens"] == 512
    records = [json.loads(line) for line in (root / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == config["max_steps"]
    clip = sorted((root / "sft" / "samples").glob("step-*/live/clip-00/sample.mp4"))[-1]
    frames = iio.imread(clip, plugin="FFMPEG", index=None)  # upscaled for viewing (media.py)
    assert frames.shape[0] == 9 and frames.shape[1] == frames.shape[2] and frames.shape[3] == 3
    out = tmp_path / "sample"
    sample = subprocess.run([sys.executable, "-m", "launcher.cli", "sample", "--checkpoint", str(root / "sft"),
                             "--prompt", "a red square moving left", "--out", str(out),
                             "--steps", "4"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert sample.returncode == 0, sample.stdout[-2000:] + sample.stderr[-2000:]
    assert iio.imread(out / "sample.mp4", plugin="FFMPEG", index=None).shape[0] == 9


# The shipped configs of real releases: each release's config files (weights stubbed), data of
# the config's latent shape; `relay submit --dry-run` with only the path lines changed.
RELEASES = {
    "wan-sft": ({"num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960, "in_channels": 16,
                 "out_channels": 16}, 8, 3.0, [16, 21, 60, 104], "world 8,"),
    "wan-14b": ({"num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824, "in_channels": 16,
                 "out_channels": 16}, 8, 5.0, [16, 21, 90, 160], "world 256,"),
    "wan-ti2v-5b": ({"num_attention_heads": 24, "num_layers": 30, "ffn_dim": 14336,
                     "in_channels": 48, "out_channels": 48}, 16, 5.0, [48, 31, 44, 80], "world 8,"),
}


def _release(root: Path, transformer: dict, spatial: int, shift: float) -> Path:
    import json

    from safetensors.torch import save_file

    z = transformer["in_channels"]
    files = {
        "model_index.json": {"_class_name": "WanPipeline"},
        "transformer/config.json": {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128,
                                    "patch_size": [1, 2, 2], "text_dim": 4096, "freq_dim": 256,
                                    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                                    "eps": 1e-6, "rope_max_seq_len": 1024, **transformer},
        "vae/config.json": {"_class_name": "AutoencoderKLWan", "z_dim": z, "latents_mean": [0.0] * z,
                            "latents_std": [1.0] * z, "scale_factor_spatial": spatial},
        "text_encoder/config.json": {"architectures": ["UMT5EncoderModel"], "d_model": 4096,
                                     "num_layers": 24},
        "tokenizer/tokenizer.json": {},
        "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler",
                                            "flow_shift": shift},
    }
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    for part in ("transformer", "vae"):
        save_file({"stub": torch.zeros(1)}, str(root / part / "diffusion_pytorch_model.safetensors"))
    return root


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_the_shipped_wan_configs_dry_run_against_their_release(name, tmp_path):
    import math
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    transformer, spatial, shift, latent, world = RELEASES[name]
    model = _release(tmp_path / "model", transformer, spatial, shift)
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist([{
        "id": "p-0", "caption": "a clip", "vae_latent_bytes": bytes(2 * math.prod(latent)),
        "vae_latent_shape": latent, "vae_latent_dtype": "bfloat16",
        "text_embedding_bytes": bytes(2 * 8 * 4096), "text_embedding_shape": [8, 4096],
        "text_embedding_dtype": "bfloat16"}]), data / "part-0.parquet")
    pipeline = yaml.safe_load((ROOT / f"config/pipeline/{name}.yaml").read_text())
    pipeline["root"] = str(tmp_path / "runs")
    stage = pipeline["stages"]["sft"]
    stage["config"] = str(ROOT / stage["config"])
    stage["overrides"].update(pretrained_transformer_path=str(model), data_path=str(data))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipeline))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", "p.yaml", "--dry-run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert world in proc.stdout


# ---- what a directory gives a run, and what a run needs of it ----------------------------------

def _encoded(root: Path, caption_tokens: int, rows: int = 8) -> Path:
    """Pre-encoded data for the tiny Wan: one latent shape, captions `caption_tokens` long."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fixtures.fastvideo_t2v import T2V_SCHEMA

    gen = torch.Generator().manual_seed(0)
    table = []
    for n in range(rows):
        latent = torch.randn(tiny.LATENT_CHANNELS, 3, 4, 4, generator=gen)
        text = torch.randn(caption_tokens, tiny.TEXT_DIM, generator=gen)
        table.append({"id": f"r-{n}", "vae_latent_bytes": latent.numpy().tobytes(),
                      "vae_latent_shape": list(latent.shape), "vae_latent_dtype": "float32",
                      "text_embedding_bytes": text.numpy().tobytes(),
                      "text_embedding_shape": list(text.shape), "text_embedding_dtype": "float32",
                      "file_name": f"{n}.mp4", "caption": f"clip {n}", "media_type": "video",
                      "width": 32, "height": 32, "num_frames": 9, "duration_sec": 0.5, "fps": 16.0})
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table, schema=T2V_SCHEMA), root / "part-0.parquet")
    return root


def _a14b(pipeline_dir: Path, root: Path) -> Path:
    """The tiny pipeline as a Wan2.2 A14B directory: two experts and a boundary."""
    import json
    import shutil

    shutil.copytree(pipeline_dir, root)
    shutil.copytree(root / "transformer", root / "transformer_2")
    index = json.loads((root / "model_index.json").read_text())
    index.update(transformer_2=index["transformer"], boundary_ratio=0.875)
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_an_expert_folder_of_an_a14b_directory_gets_the_directory_defaults(pipeline_dir, tmp_path):
    moe = _a14b(pipeline_dir, tmp_path / "a14b")
    data = _encoded(tmp_path / "data", caption_tokens=40)
    common = ("--synthetic_data", "false", "--data_path", str(data))
    high = _resolve(tmp_path, moe / "transformer", *common)
    low = _resolve(tmp_path, moe / "transformer_2", *common)
    for args in (high, low):
        assert args.text_encoder == str(moe / "text_encoder")
        assert args.vae_path == str(moe / "vae")
        assert args.text_max_tokens == 512 and args.train_timestep_shift == tiny.FLOW_SHIFT
    # each expert trains on the timesteps WanPipeline gives it: t >= 0.875 x 1000 is transformer/'s
    assert high.train_timestep_range == [0.875, 1.0]
    assert low.train_timestep_range == [0.0, 0.875]
    # an explicit range wins; a one-transformer directory sets none
    assert _resolve(tmp_path, moe / "transformer_2", *common, "--train_timestep_range",
                    "[0.0, 0.9]").train_timestep_range == [0.0, 0.9]
    assert _resolve(tmp_path, pipeline_dir / "transformer",
                    *common).train_timestep_range == [0.0, 1.0]


def test_captions_longer_than_text_max_tokens_are_refused_unless_cutting_is_chosen(pipeline_dir,
                                                                                   tmp_path):
    from trainer.config.schema import ConfigError

    data = _encoded(tmp_path / "data", caption_tokens=40)
    common = ("--synthetic_data", "false", "--data_path", str(data), "--validation_interval", "-1")
    with pytest.raises(ConfigError) as info:
        _resolve(tmp_path, pipeline_dir, *common, "--text_max_tokens", "8")
    text = str(info.value)
    assert "8 of the 8 captions of the data are longer than text_max_tokens 8" in text
    assert "the longest has 40 tokens" in text and "allow_caption_truncation" in text
    args = _resolve(tmp_path, pipeline_dir, *common, "--text_max_tokens", "8",
                    "--allow_caption_truncation", "true")
    assert args.text_max_tokens == 8
    # packs keep every caption whole: nothing is cut, nothing is refused
    _resolve(tmp_path, pipeline_dir, *common, "--text_max_tokens", "8",
             "--packing_token_budget", "200")


def _without_text_encoder(pipeline_dir: Path, root: Path) -> Path:
    import shutil

    shutil.copytree(pipeline_dir, root)
    shutil.rmtree(root / "text_encoder")
    shutil.rmtree(root / "tokenizer")
    return root


def test_a_directory_without_text_encoder_trains_what_needs_none(pipeline_dir, tmp_path):
    import json
    import subprocess
    import sys

    bare = _without_text_encoder(pipeline_dir, tmp_path / "no-encoder")
    data = _encoded(tmp_path / "data", caption_tokens=12)
    out = tmp_path / "out"
    command = [sys.executable, "trainer/train.py", "--config", "config/wan/tiny-sft.yaml",
               "--make_tiny_wan", "false", "--pretrained_transformer_path", str(bare),
               "--synthetic_data", "false", "--data_path", str(data), "--output_dir", str(out),
               "--validation_interval", "-1", "--cfg_drop_prob", "0", "--max_steps", "2",
               "--save_interval", "2", "--log_interval", "1", "--train_batch_size", "4"]
    proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run-result.json").read_text())["status"] == "completed"
    # caption dropout needs the empty caption's embedding: the refusal names it and its way out
    proc = subprocess.run([*command, "--cfg_drop_prob", "0.1", "--dry-run"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "text_encoder/" in proc.stderr and "cfg_drop_prob 0.1; 0 turns dropout off" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_captions_stored_as_text_longer_than_text_max_tokens_are_counted_through_the_tokenizer(
        pipeline_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.config.schema import ConfigError

    # captions without embeddings: the run encodes them to text_max_tokens through UMT5
    gen = torch.Generator().manual_seed(0)
    rows = [{"id": f"r-{n}", "vae_latent_bytes": torch.randn(4, 3, 4, 4, generator=gen).numpy().tobytes(),
             "vae_latent_shape": [4, 3, 4, 4], "vae_latent_dtype": "float32",
             "caption": "a red square moving left" if n % 2 else
             "a red square and a blue circle moving left and a green triangle moving up"}
            for n in range(6)]
    data = tmp_path / "captions"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), data / "part-0.parquet")
    common = ("--synthetic_data", "false", "--data_path", str(data), "--validation_interval", "-1")
    with pytest.raises(ConfigError) as info:
        _resolve(tmp_path, pipeline_dir, *common, "--text_max_tokens", "8")
    text = str(info.value)  # 15 words + </s>; the short ones are 5 + 1
    assert "3 of the 6 captions of the data are longer than text_max_tokens 8" in text
    assert "the longest has 16 tokens" in text and "packing_token_budget" not in text
    assert _resolve(tmp_path, pipeline_dir, *common, "--text_max_tokens", "16").text_max_tokens == 16
