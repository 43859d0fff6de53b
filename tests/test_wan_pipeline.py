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
