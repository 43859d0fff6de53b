"""Encoding throughput of one GPU: raw clips through a Wan2.1 VAE of the real architecture.

    python benchmarks/encode.py --json encode.json [--clips 8] [--frames 81] [--height 480]
                                [--width 832] [--umt5-xxl]

What `relay data encode` and a pipeline's encode stage do per file, timed on one GPU:

1. the whole path (trainer.data.encode.encode_manifest, one rank): decode an mp4 with imageio
   (ffmpeg, on the CPU), run diffusers' AutoencoderKLWan (its default config, the Wan2.1 VAE
   at 4x8x8 and 16 channels; random weights: the work does not depend on their values) in the
   dtype it is saved in (float32), encode the caption with the text encoder, write parquet.
   The text encoder here is the tiny UMT5 of trainer.models.wan.tiny, so this row is decode +
   VAE + write;
2. the parts of it, per clip: the decode alone (CPU), the VAE alone (GPU, synchronised) and,
   with --umt5-xxl, one caption through a UMT5-XXL encoder of Wan's size (d_model 4096, 24
   layers, 64 heads, d_ff 10240; random weights, bf16 on the GPU) at 512 tokens.

Clips are a coloured square moving over a dark background, `frames` x `height` x `width`,
written with imageio before anything is timed; one clip is encoded first to warm the kernels.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _clip(index: int, frames: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    video = np.full((frames, height, width, 3), 16, np.uint8)
    side = height // 4
    colour = rng.integers(96, 256, 3).astype(np.uint8)
    for t in range(frames):
        x = (t * (width - side)) // max(frames - 1, 1)
        video[t, height // 3:height // 3 + side, x:x + side] = colour
    return video


def _write_media(folder: Path, clips: int, frames: int, height: int, width: int) -> Path:
    import imageio.v3 as iio

    folder.mkdir(parents=True, exist_ok=True)
    lines = ["path,caption"]
    for index in range(clips + 1):  # one more: the warm-up clip
        iio.imwrite(folder / f"clip{index}.mp4", _clip(index, frames, height, width), fps=16,
                    plugin="FFMPEG", macro_block_size=8)
        lines.append(f"clip{index}.mp4,a coloured square moving right over a dark background")
    (folder / "warmup.csv").write_text("\n".join(lines[:2]) + "\n")
    (folder / "manifest.csv").write_text("\n".join([lines[0], *lines[2:]]) + "\n")
    return folder


def _pipeline(root: Path) -> Path:
    """The tiny Wan pipeline with its vae/ replaced by AutoencoderKLWan() of the default config."""
    from diffusers import AutoencoderKLWan

    from trainer.models.wan.tiny import write_tiny_wan_pipeline

    write_tiny_wan_pipeline(root)
    import shutil

    shutil.rmtree(root / "vae")
    AutoencoderKLWan().save_pretrained(root / "vae")
    return root


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _umt5_xxl_seconds(device, repeats: int = 10) -> float:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                        vocab_size=256384, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    with torch.device(device):
        model = UMT5EncoderModel(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256384, (1, 512), device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask)
        times = [_timed(lambda: model(input_ids=ids, attention_mask=mask), device)
                 for _ in range(repeats)]
    del model
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--umt5-xxl", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script itself")
    ns = parser.parse_args()
    import diffusers

    from trainer.data.encode import MediaEncoder, encode_manifest, load_media, vae_input

    device = torch.device(ns.device)
    work = Path(tempfile.mkdtemp(prefix="relay-encode-bench-"))
    media = _write_media(work / "media", ns.clips, ns.frames, ns.height, ns.width)
    pipeline = _pipeline(work / "pipeline")
    common = dict(vae_dir=pipeline / "vae", text_encoder_dir=pipeline / "text_encoder",
                  device=device, progress=False, rank=0, world_size=1)
    encode_manifest(media / "warmup.csv", out_dir=work / "warm", **common)
    start = time.perf_counter()
    summary = encode_manifest(media / "manifest.csv", out_dir=work / "out", **common)
    whole = time.perf_counter() - start
    assert summary["encoded"] == ns.clips and not summary["bad"], summary
    encoder = MediaEncoder(pipeline / "vae", pipeline / "text_encoder", device=device)
    decode, vae = [], []
    for index in range(1, ns.clips + 1):
        begin = time.perf_counter()
        frames, _, _ = load_media(str(media / f"clip{index}.mp4"))
        decode.append(time.perf_counter() - begin)
        pixels = vae_input(frames, temporal=encoder.vae.temporal, spatial=encoder.vae.spatial)
        vae.append(_timed(lambda: encoder.vae.encode(pixels), device))
    result = {
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "python": platform.python_version()},
        "clip": {"frames": ns.frames, "height": ns.height, "width": ns.width},
        "latent_shape": list(encoder.latent(load_media(str(media / "clip1.mp4"))[0]).shape),
        "clips": ns.clips,
        "whole_path_s": whole,
        "whole_path_clips_per_s": ns.clips / whole,
        "decode_s_median": statistics.median(decode),
        "vae_s_median": statistics.median(vae),
        "vae_peak_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None),
    }
    if ns.umt5_xxl:
        result["umt5_xxl_caption_s_median"] = _umt5_xxl_seconds(device)
    Path(ns.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
