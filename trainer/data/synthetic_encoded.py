"""The embedded dataset through a real VAE and text encoder: the moving-shapes clips
(trainer.data.synthetic) rendered as uint8 frames and encoded by `relay data encode`'s own
code (trainer.data.encode: MediaEncoder and encode_row) through `vae_path` and
`text_encoder`.

`synthetic_data: true` takes this path when `vae_path` is set (for a Wan pipeline directory,
its vae/ and text_encoder/ + tokenizer/ by default): the model then trains on the latents and
caption embeddings it will see from real data, rather than on pixels and stand-in word vectors.
`ensure_encoded_dataset` builds data_path once and reuses it while its settings (and the
encoder directories' config files) are unchanged, publishing atomically like
trainer.data.synthetic.ensure_dataset.

Importing this module does not import torch (`encoded_latent_shape` is for preflight).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

MANIFEST_NAME = "dataset.json"
MANIFEST_FORMAT = "relay.moving-shapes-encoded"
MANIFEST_VERSION = 1


def vae_factors(vae_dir) -> tuple[int, int, int]:
    """(latent channels, temporal, spatial compression) of an AutoencoderKLWan directory's
    config.json; the tiny Wan's when the directory is not written yet."""
    file = Path(vae_dir) / "config.json"
    if not file.is_file():
        from trainer.encoders.directories import TINY_WAN_LATENT_CHANNELS

        return TINY_WAN_LATENT_CHANNELS, 4, 8
    config = json.loads(file.read_text())
    return (int(config["z_dim"]), int(config.get("scale_factor_temporal") or 4),
            int(config.get("scale_factor_spatial") or 8))


def encoded_latent_shape(vae_dir, *, num_frames: int, height: int, width: int
                         ) -> tuple[int, int, int, int]:
    """[C, T, H, W] of one encoded clip: the frames trainer.data.encode.vae_input keeps
    (1 + k x temporal, sides cropped to multiples of 2 x spatial), compressed."""
    channels, temporal, spatial = vae_factors(vae_dir)
    unit = 2 * spatial
    return (channels, 1 + (num_frames - 1) // temporal,
            height // unit * unit // spatial, width // unit * unit // spatial)


def _fingerprint(directory) -> str:
    """A hash of the config files of an encoder directory (a changed model rebuilds the cache)."""
    digest = hashlib.sha256()
    root = Path(directory)
    for file in sorted(list(root.glob("*.json")) + list((root.parent / "tokenizer").glob("*.json"))):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _params(num_samples, seed, num_frames, height, width, fps, generator, vae_dir,
            text_encoder_dir, skip_layer, max_text_tokens) -> dict:
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "num_samples": int(num_samples), "seed": int(seed), "num_frames": int(num_frames),
            "height": int(height), "width": int(width), "fps": float(fps),
            "generator": generator, "vae": str(vae_dir), "vae_config": _fingerprint(vae_dir),
            "text_encoder": str(text_encoder_dir),
            "text_encoder_config": _fingerprint(text_encoder_dir),
            "skip_layer": int(skip_layer), "max_text_tokens": int(max_text_tokens)}


def ensure_encoded_dataset(out_dir, num_samples: int, *, seed: int, vae_dir, text_encoder_dir,
                           num_frames: int = 9, height: int = 32, width: int = 32,
                           fps: float = 8.0, generator: str = "shapes", skip_layer: int = 0,
                           max_text_tokens: int = 512, rows_per_shard: int = 256,
                           device="cpu") -> Path:
    """Make out_dir hold num_samples synthetic clips encoded through vae_dir and
    text_encoder_dir; returns it as a Path. Reused when its dataset.json matches; otherwise
    built in a hidden sibling and renamed into place. Raises FileExistsError when out_dir
    holds something this module did not write, trainer.data.encode.EncodeError when the
    encoders cannot be loaded."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.encode import MediaEncoder, encode_row
    from trainer.data.synthetic import make_sample

    out = Path(out_dir)
    params = _params(num_samples, seed, num_frames, height, width, fps, generator, vae_dir,
                     text_encoder_dir, skip_layer, max_text_tokens)
    manifest = out / MANIFEST_NAME
    if manifest.is_file():
        try:
            if json.loads(manifest.read_text()) == params:
                return out
        except ValueError:
            pass
    if out.exists() and any(out.iterdir()) and not manifest.is_file():
        raise FileExistsError(f"{out} exists and was not written by relay's synthetic data "
                              f"(no {MANIFEST_NAME}); point data_path at a new directory, or "
                              f"set synthetic_data: false to train on it")
    encoder = MediaEncoder(vae_dir, text_encoder_dir, skip_layer=skip_layer,
                           max_text_tokens=max_text_tokens, device=device)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        rows = []
        for index in range(num_samples):
            spec, clip = make_sample(generator, seed, index, num_frames=num_frames,
                                     height=height, width=width)
            frames = np.rint((np.asarray(clip) + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
            rows.append(encode_row(index, frames.transpose(1, 2, 3, 0), "video", fps,
                                   f"{generator}-s{seed}-{index:07d}", spec.caption, encoder))
            if len(rows) == rows_per_shard or index == num_samples - 1:
                name = tmp / f"part-{index // rows_per_shard:05d}.parquet"
                pq.write_table(pa.Table.from_pylist(rows), name)
                rows = []
        (tmp / MANIFEST_NAME).write_text(json.dumps(params, indent=2))
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
