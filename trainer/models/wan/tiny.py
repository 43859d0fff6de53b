"""A tiny random Wan pipeline: a complete diffusers directory (model_index.json, transformer/,
vae/, text_encoder/, tokenizer/, scheduler/) in the layout of Wan-AI's "-Diffusers" releases,
small enough to write, load and sample on a CPU in seconds.

It is what a newcomer fine-tunes before pointing relay at a real Wan (config/pipeline/
wan-tiny.yaml), and what the tests load through the path a user's directory takes. Every part
is the real class (WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, a fast tokenizer,
UniPCMultistepScheduler), random weights from `seed`, written with save_pretrained, so
diffusers' `WanPipeline.from_pretrained(directory)` loads and samples it.

Sizes: the VAE compresses 4x in time and 8x per side into LATENT_CHANNELS channels; the
transformer patches 1x2x2, so a 9-frame 32x32 clip is a [4, 3, 4, 4] latent and 12 video
tokens. The tokenizer is word-level over WORDS (every word of the embedded synthetic captions,
shapes and benchmark alike) plus <pad> (id 0), </s> (id 1, appended to every caption, as
UMT5's tokenizer does) and <unk> (id 2); captions pad to TEXT_LEN tokens as Wan's pipeline pads
them. Imports torch, diffusers and transformers inside the functions only (the encode extra).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.encoders.directories import TINY_WAN_FLOW_SHIFT, TINY_WAN_LATENT_CHANNELS
from trainer.models.wan.config import WAN_TEXT_LEN

LATENT_CHANNELS = TINY_WAN_LATENT_CHANNELS
TEXT_DIM = 32
TEXT_LEN = WAN_TEXT_LEN  # Wan's text_encoder max length: captions are padded to it
FLOW_SHIFT = TINY_WAN_FLOW_SHIFT  # Wan2.1 T2V at 480p ships flow_shift 3.0 (720p: 5.0)
SPECIALS = ("<pad>", "</s>", "<unk>")

# The tiny transformer (diffusers' WanTransformer3DModel constructor arguments).
TRANSFORMER = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16,
               "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS,
               "text_dim": TEXT_DIM, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
               "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
               "rope_max_seq_len": 64}
# The tiny VAE (AutoencoderKLWan): three downsamplings (8x per side), two of them in time (4x).
VAE = {"base_dim": 8, "z_dim": LATENT_CHANNELS, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
       "attn_scales": [], "temperal_downsample": [False, True, True]}
# The tiny UMT5 encoder: two layers, TEXT_DIM wide.
TEXT_ENCODER = {"d_model": TEXT_DIM, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
                "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0}


def words() -> tuple[str, ...]:
    """The tokenizer's words: every word the embedded synthetic captions use (the shapes set's
    and the benchmark's), sorted, without duplicates."""
    from trainer.data import synthetic, synthetic_bench
    from trainer.encoders.text import tokenize

    pieces = [*synthetic.CAPTION_VOCAB, *synthetic_bench.SHAPES, *synthetic_bench.COLOURS,
              *synthetic_bench.DIRECTIONS, *synthetic_bench.SPEEDS, "a", "an", "and", "moving"]
    return tuple(sorted({w for piece in pieces for w in tokenize(piece)}))


def build_tokenizer():
    """A transformers PreTrainedTokenizerFast: lowercase, split on whitespace and punctuation,
    one id per word of words(), <unk> for any other word, </s> after every caption."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *words()))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", model_max_length=TEXT_LEN)


def write_tiny_wan_pipeline(directory, *, seed: int = 0, flow_shift: float = FLOW_SHIFT,
                            overwrite: bool = False, latent_channels: int = LATENT_CHANNELS,
                            transformer: dict | None = None,
                            boundary_ratio: float | None = None) -> Path:
    """Write a tiny random Wan text-to-video pipeline into `directory` (created) and return it.

    `latent_channels` sizes the VAE's latents and the transformer's in/out channels;
    `transformer` replaces entries of TRANSFORMER (another width, depth or head count).
    `boundary_ratio` (in (0, 1)) writes Wan2.2 A14B's layout instead: two experts of the same
    shape, transformer/ (high noise) and transformer_2/ (low noise, its own random weights,
    from seed + 1), and boundary_ratio in model_index.json, as WanPipeline saves it: its
    sampler runs transformer/ at timesteps t >= boundary_ratio x 1000 and transformer_2/ below.

    The same seed writes the same weights. An existing complete directory (model_index.json
    present) is left as it is unless overwrite=True; the directory is written under a temporary
    name and renamed into place, so a killed call leaves no half-written pipeline behind.
    Raises ImportError naming the extra when diffusers or transformers is missing.
    """
    import os
    import shutil
    import uuid

    target = Path(directory)
    if (target / "model_index.json").is_file() and not overwrite:
        return target
    try:
        import torch
        from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline,
                               WanTransformer3DModel)
        from transformers import UMT5Config, UMT5EncoderModel
    except ImportError as error:
        raise ImportError("a tiny Wan pipeline needs diffusers and transformers: pip install "
                          "'relay[encode]'") from error

    tokenizer = build_tokenizer()
    generator = torch.Generator().manual_seed(seed)
    mean = (torch.randn(latent_channels, generator=generator) * 0.1).tolist()
    std = (0.5 + torch.rand(latent_channels, generator=generator)).tolist()
    shape = {**TRANSFORMER, "in_channels": latent_channels, "out_channels": latent_channels,
             **(transformer or {})}
    with _seeded(torch, seed):
        transformer = WanTransformer3DModel(**shape)
        vae = AutoencoderKLWan(**{**VAE, "z_dim": latent_channels}, latents_mean=mean,
                               latents_std=std)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, **TEXT_ENCODER))
    experts = {}
    if boundary_ratio is not None:
        if not 0.0 < boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must lie in (0, 1), got {boundary_ratio}")
        with _seeded(torch, seed + 1):
            experts = {"transformer_2": WanTransformer3DModel(**shape),
                       "boundary_ratio": float(boundary_ratio)}
    # As Wan2.1's "-Diffusers" releases ship it: UniPC on flow sigmas shifted by flow_shift.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=float(flow_shift))
    pipeline = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                           scheduler=scheduler, transformer=transformer, **experts)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        pipeline.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(
            f"A tiny random Wan{' A14B (two experts)' if experts else ''} pipeline (seed "
            f"{seed}) written by relay's "
            f"trainer.models.wan.tiny.write_tiny_wan_pipeline: random weights, for tests and "
            f"for trying relay's Wan path on a CPU. Not a model of anything.\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def describe(directory) -> dict:
    """The facts of a written tiny pipeline a test or a config needs: latent channels, text_dim,
    the VAE's compression, flow_shift (read back from the directory's config files)."""
    root = Path(directory)
    vae = json.loads((root / "vae" / "config.json").read_text())
    text = json.loads((root / "text_encoder" / "config.json").read_text())
    scheduler = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    return {"latent_channels": vae["z_dim"], "text_dim": text["d_model"],
            "temporal": vae.get("scale_factor_temporal", 4),
            "spatial": vae.get("scale_factor_spatial", 8),
            "flow_shift": scheduler.get("flow_shift")}


class _seeded:
    """torch's global generator seeded for the block (module constructors draw from it) and
    restored afterwards, so writing a pipeline does not change the caller's random stream."""

    def __init__(self, torch, seed: int):
        self.torch, self.seed = torch, seed

    def __enter__(self):
        self.state = self.torch.random.get_rng_state()
        self.torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        self.torch.random.set_rng_state(self.state)
