"""`relay data encode`: videos and images with captions -> shards in the data format.

A manifest (CSV with `path` and `caption` columns, or a JSON list of such objects; relative
paths are relative to the manifest) is split across processes (rank r takes entries r, r + W,
...; one process per GPU). Each process encodes its entries in parts of rows_per_shard: latents
with a diffusers AutoencoderKLWan and caption embeddings with a transformers encoder, both from
local directories. A part is published atomically (parquet renamed into place, then its JSON
record), so a killed run restarted with the same arguments redoes only the part it was in.
Files that cannot be read are listed in the part's record and in the summary, never dropped
silently. Needs the `encode` extra (transformers; imageio with ffmpeg to decode videos).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trainer.data.manifest import PLAN_FILE, EncodeError, read_manifest
from trainer.runtime.files import write_json

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def load_media(path: str) -> tuple[np.ndarray, str, float]:
    """(frames uint8 [T, H, W, 3], 'image' or 'video', fps) of one file.

    Raises OSError / ValueError when the file is missing or does not decode.
    """
    import imageio.v3 as iio

    if not Path(path).is_file():
        raise OSError("file does not exist")
    if Path(path).suffix.lower() in IMAGE_SUFFIXES:
        frame = iio.imread(path)
        return np.asarray(frame)[None, ..., :3], "image", 0.0
    frames = iio.imread(path, plugin="FFMPEG", index=None)
    fps = float(iio.immeta(path, plugin="FFMPEG").get("fps") or 0.0)
    if frames.ndim != 4 or len(frames) == 0:
        raise ValueError(f"decoded to shape {frames.shape}, not frames [T, H, W, 3]")
    return frames[..., :3], "video", fps


def vae_input(frames: np.ndarray, *, temporal: int, spatial: int) -> torch.Tensor:
    """float [1, 3, T', H', W'] in [-1, 1]: the first 1 + k*temporal frames (the Wan VAE's
    causal layout) and a centre crop to multiples of 2*spatial (even latent sides, so a patch
    of 2 tiles them). Raises ValueError when the frame is smaller than one crop unit."""
    t = 1 + (len(frames) - 1) // temporal * temporal
    unit = 2 * spatial
    h, w = frames.shape[1] // unit * unit, frames.shape[2] // unit * unit
    if h == 0 or w == 0:
        raise ValueError(f"frames of {frames.shape[1]}x{frames.shape[2]} are smaller than {unit}x{unit}")
    top, left = (frames.shape[1] - h) // 2, (frames.shape[2] - w) // 2
    clip = torch.from_numpy(np.ascontiguousarray(frames[:t, top:top + h, left:left + w]))
    return (clip.permute(3, 0, 1, 2).float() / 127.5 - 1.0)[None]


class MediaEncoder:
    """The VAE (trainer.encoders.vae.WanVAE) and the text encoder, loaded once per process from local
    directories."""

    def __init__(self, vae_dir, text_encoder_dir, *, skip_layer: int = 0, max_text_tokens: int = 512,
                 device="cpu"):
        from trainer.encoders.text import TransformersTextEncoder
        from trainer.encoders.vae import WanVAE

        try:
            self.vae = WanVAE(vae_dir, device=device)
            self.text = TransformersTextEncoder(text_encoder_dir, max_tokens=max_text_tokens,
                                                skip_layer=skip_layer, device=device)
        except ImportError as error:
            raise EncodeError(f"encoding needs diffusers and transformers: {error}") from None
        except (OSError, ValueError) as error:
            raise EncodeError(f"cannot load the encoders: {error}") from None
        self._captions: dict[str, torch.Tensor] = {}

    def latent(self, frames: np.ndarray) -> torch.Tensor:
        """Normalised latent float32 [C, T, H, W] of frames uint8 [T, H, W, 3] (WanVAE.encode)."""
        return self.vae.encode(vae_input(frames, temporal=self.vae.temporal,
                                         spatial=self.vae.spatial))[0]

    def caption(self, caption: str) -> torch.Tensor:
        """The caption's real tokens' embeddings, float32 [L, D] (each distinct caption encoded
        once per process)."""
        cached = self._captions.get(caption)
        if cached is None:
            hidden, mask = self.text.encode([caption])
            cached = self._captions[caption] = hidden[0, mask[0]]
        return cached


def _row(number: int, entry: dict, encoder: MediaEncoder) -> dict:
    frames, media, fps = load_media(entry["path"])
    return encode_row(number, frames, media, fps, entry["path"], entry["caption"], encoder)


def encode_row(number: int, frames: np.ndarray, media: str, fps: float, file_name: str,
               caption: str, encoder: MediaEncoder) -> dict:
    """One row of the data format of frames uint8 [T, H, W, 3] and their caption."""
    entry = {"path": file_name, "caption": caption}
    latent = encoder.latent(frames).contiguous()
    text = encoder.caption(entry["caption"]).contiguous()
    first = latent[:, :1].contiguous()  # the causal VAE's first latent frame is frame 0 alone
    return {"id": f"sample-{number:08d}", "vae_latent_bytes": latent.numpy().tobytes(),
            "vae_latent_shape": list(latent.shape), "vae_latent_dtype": "float32",
            "text_embedding_bytes": text.numpy().tobytes(), "text_embedding_shape": list(text.shape),
            "text_embedding_dtype": "float32", "first_frame_latent_bytes": first.numpy().tobytes(),
            "first_frame_latent_shape": list(first.shape), "first_frame_latent_dtype": "float32",
            "file_name": entry["path"], "caption": entry["caption"], "media_type": media,
            "width": int(frames.shape[2]), "height": int(frames.shape[1]),
            "num_frames": len(frames), "fps": fps,
            "duration_sec": len(frames) / fps if fps else 0.0}


def _part_name(rank: int, part: int) -> str:
    return f"part-r{rank:03d}-{part:05d}"


def env_rank(rank, world_size) -> tuple[int, int]:
    # One process per GPU under torchrun or srun: the launcher's variables give the share.
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) if world_size is None else world_size
    if not 0 <= rank < world:
        raise EncodeError(f"rank {rank} is outside a world of {world}")
    return rank, world


def encode_manifest(manifest, *, vae_dir, text_encoder_dir, out_dir, rank: int | None = None,
                    world_size: int | None = None, skip_layer: int = 0, rows_per_shard: int = 64,
                    device="cpu", max_text_tokens: int = 512, progress: bool | str = True,
                    stop=None) -> dict:
    """Encode this process's share of the manifest into out_dir; returns {"encoded",
    "skipped" (rows of parts already published), "bad": [{"path", "reason"}], "out",
    "stopped"}.

    progress: a tqdm bar (True), one log line every PROGRESS_EVERY_S seconds ("lines": for
    job logs), or nothing (False). stop: a callable asked between files; when it answers True
    the run returns at once with "stopped" set, leaving the part it was in unpublished (a
    restart redoes that part only). Raises EncodeError before any work when the manifest or
    the encoders cannot be loaded, or when out_dir holds parts written with another world size
    or part size.
    """
    rank, world = env_rank(rank, world_size)
    entries = read_manifest(manifest)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split = {"world_size": world, "rows_per_shard": int(rows_per_shard), "entries": len(entries)}
    mine = [(n, e) for n, e in enumerate(entries) if n % world == rank]
    parts = [mine[i:i + rows_per_shard] for i in range(0, len(mine), rows_per_shard)]
    todo = []
    summary = {"encoded": 0, "skipped": 0, "bad": [], "out": str(out), "stopped": False}
    for part, rows in enumerate(parts):
        record = out / f"{_part_name(rank, part)}.json"
        if record.is_file():
            done = json.loads(record.read_text())
            if done["split"] != split:
                raise EncodeError(f"{out} holds parts written with {done['split']}, this run "
                                  f"asks for {split}: use another --out or the same split")
            summary["skipped"] += done["rows"]
            summary["bad"] += done["bad"]
        else:
            todo.append((part, rows))
    write_json(out / PLAN_FILE, split)  # what `relay status` counts progress against
    if not todo:
        return summary
    encoder = MediaEncoder(vae_dir, text_encoder_dir, skip_layer=skip_layer,
                           max_text_tokens=max_text_tokens, device=device)
    bar = _progress(sum(len(r) for _, r in todo), progress, rank)
    for part, rows in todo:
        encoded, bad = [], []
        for number, entry in rows:
            if stop is not None and stop():
                bar.close()
                summary["stopped"] = True
                return summary
            try:
                encoded.append(_row(number, entry, encoder))
            except (OSError, ValueError, RuntimeError) as error:
                bad.append({"path": entry["path"], "reason": str(error).splitlines()[0][:300]})
            bar.update(1)
        name = _part_name(rank, part)
        if encoded:
            tmp = out / f"{name}.parquet.tmp"
            pq.write_table(pa.Table.from_pylist(encoded), tmp)
            os.replace(tmp, out / f"{name}.parquet")
        write_json(out / f"{name}.json", {"rows": len(encoded), "bad": bad, "split": split})
        summary["encoded"] += len(encoded)
        summary["bad"] += bad
    bar.close()
    return summary


PROGRESS_EVERY_S = 30.0


def _progress(total: int, mode: bool | str, rank: int = 0):
    if mode == "lines":
        return _LineProgress(total, rank)
    from tqdm import tqdm

    return tqdm(total=total, desc="encode", unit="file", file=sys.stderr, disable=not mode)


class _LineProgress:
    """Progress as plain log lines (a job log has no terminal for a bar): files done of this
    rank's share, files a second, every PROGRESS_EVERY_S seconds and at the end."""

    def __init__(self, total: int, rank: int):
        self.total, self.rank, self.done = total, rank, 0
        self.started = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self._line()

    def close(self) -> None:
        self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        rate = self.done / max(self.last - self.started, 1e-9)
        print(f"encode rank {self.rank}: {self.done}/{self.total} files, {rate:.2f} files/s",
              file=sys.stderr, flush=True)


def write_demo_clips(manifest, count: int, *, seed: int = 0, num_frames: int = 9,
                     height: int = 32, width: int = 32) -> Path:
    """`count` moving-shapes clips (trainer.data.synthetic) as mp4 files beside `manifest`,
    and the manifest (CSV: path, caption) written last, atomically; returns its path."""
    import imageio.v3 as iio

    from trainer.data.synthetic import make_clip

    manifest = Path(manifest)
    folder = manifest.parent / "clips"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["path,caption"]
    for index in range(count):
        spec, pixels = make_clip(seed, index, num_frames=num_frames, height=height, width=width)
        frames = ((pixels.transpose(1, 2, 3, 0) + 1.0) * 127.5).round().clip(0, 255)
        name = f"clip-{index:05d}.mp4"
        iio.imwrite(folder / name, frames.astype(np.uint8), fps=8, plugin="FFMPEG",
                    macro_block_size=1)
        lines.append(f"clips/{name},{spec.caption}")
    tmp = manifest.with_name(manifest.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, manifest)
    return manifest
