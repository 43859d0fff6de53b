"""Training data: pre-encoded parquet latents and the per-rank batch cursor.

`resolve_data_paths` turns `data_path` (a directory, or a mapping {directory: repeat_count})
into shard files; `ParquetLatentDataset` reads their rows (data contract, ARCHITECTURE.md);
`DistributedBatchIterator` deals batches to one data-parallel rank, endlessly, and can save
and restore its position exactly.

Everything is held in memory and batches are assembled in the training process: right for the
embedded default and small sets. Future work: stream shards instead of loading them, sequence
packing for mixed latent shapes, and worker processes for decoding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

REQUIRED_COLUMNS = (
    "id",
    "caption",
    "vae_latent_bytes",
    "vae_latent_shape",
    "vae_latent_dtype",
    "text_embedding_bytes",
    "text_embedding_shape",
    "text_embedding_dtype",
)
FIRST_FRAME_COLUMNS = ("first_frame_latent_bytes", "first_frame_latent_shape", "first_frame_latent_dtype")
# Some FastVideo schemas store the text mask; when it is there it decides which tokens are real.
TEXT_MASK_COLUMNS = ("text_attention_mask_bytes", "text_attention_mask_shape", "text_attention_mask_dtype")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def resolve_data_paths(data_path) -> list[tuple[Path, int]]:
    """Shard files and their repeat counts: [(shard_path, repeat), ...].

    data_path is a directory (str or PathLike; repeat 1) or a mapping {directory: repeat}
    with integer repeats >= 1. Each directory is searched recursively for *.parquet, sorted,
    so preprocessed datasets with sub-folders load as they are.

    Raises TypeError for another kind of data_path, ValueError for an empty mapping or a bad
    repeat count, FileNotFoundError for a missing directory or one without parquet files.
    """
    if isinstance(data_path, (str, PathLike)):
        entries = [(data_path, 1)]
    elif isinstance(data_path, Mapping):
        if not data_path:
            raise ValueError("data_path mapping is empty; give at least one {directory: repeat_count}")
        entries = list(data_path.items())
    else:
        raise TypeError(
            f"data_path must be a directory or a mapping {{directory: repeat_count}}, "
            f"got {type(data_path).__name__}"
        )

    shards = []
    for directory, repeat in entries:
        # bool is an int subclass; "true" is never a meaningful repeat count.
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ValueError(
                f"data_path repeat count for {directory} must be an integer >= 1, got {repeat!r}"
            )
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"data directory {root} does not exist (or is not a directory)")
        found = sorted(root.rglob("*.parquet"))
        if not found:
            raise FileNotFoundError(f"data directory {root} holds no *.parquet files")
        shards.extend((path, repeat) for path in found)
    return shards


def first_latent_shape(data_path) -> tuple[int, int, int, int]:
    """[C, T, H, W] of the first sample of the first shard, reading only its shape column.

    A production data_path holds terabytes; the dataset refuses mixed latent shapes, so the first
    row's shape is the run's. Raises FileNotFoundError / ValueError as resolve_data_paths does,
    or when the shard has no rows.
    """
    shard = resolve_data_paths(data_path)[0][0]
    table = pq.ParquetFile(shard).read_row_group(0, columns=["vae_latent_shape"])
    if table.num_rows == 0:
        raise ValueError(f"{shard} holds no rows")
    return tuple(int(s) for s in table.column("vae_latent_shape")[0].as_py())


def decode_tensor(data: bytes, shape, dtype: str) -> torch.Tensor:
    """A tensor from the contract's (bytes, shape, dtype) triple; a copy, safe to modify.

    Raises ValueError for an unknown dtype or a byte count that does not match the shape.
    """
    torch_dtype = _TORCH_DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"unsupported tensor dtype {dtype!r}; known: {', '.join(_TORCH_DTYPES)}")
    shape = [int(s) for s in shape]
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{len(data)} bytes do not hold a {dtype} tensor of shape {shape} ({expected} bytes)"
        )
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the copy detaches from arrow.
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


class ParquetLatentDataset:
    """Rows of parquet shards in the data contract, indexable as training samples.

    `data` is a data_path (see resolve_data_paths) or that function's result. Rows of a shard
    with repeat k appear k times (len counts them). dataset[i] gives {"id", "caption",
    "latent" float32 [C, T, H, W], "text" float32 [L, D], "text_mask" bool [L], "first_frame"
    float32 [C, 1, H, W] or None}. Stored text embeddings hold only real tokens (or carry a
    text_attention_mask); they are padded with zeros, or cut, to L = max_text_tokens
    (default: the longest in the data; the chosen L is `text_len`) and masked. Pass the text
    encoder's max_tokens so batches line up with its null embedding.

    Raises ValueError naming the shard and the missing columns when a shard lacks a required
    column, and ValueError when latent shapes differ (batching them needs packing).
    """

    def __init__(self, data, *, max_text_tokens: int | None = None):
        if isinstance(data, list):
            self.shards = [(Path(path), int(repeat)) for path, repeat in data]
        else:
            self.shards = resolve_data_paths(data)
        # Per shard, its columns as Python lists: row access is then a plain list lookup.
        self._shards: list[dict[str, list]] = []
        self._index: list[tuple[int, int]] = []  # (shard, row), repeats expanded
        for shard_number, (path, repeat) in enumerate(self.shards):
            columns = self._read_shard(path)
            self._shards.append(columns)
            rows = [(shard_number, row) for row in range(len(columns["id"]))]
            self._index.extend(rows * repeat)
        if not self._index:
            raise ValueError(f"the data ({len(self.shards)} shards) holds no rows")

        latent_shapes = {tuple(s) for c in self._shards for s in c["vae_latent_shape"]}
        if len(latent_shapes) > 1:
            raise ValueError(
                f"latent shapes differ across the data ({sorted(latent_shapes)[:4]}...); "
                "batches of mixed shapes need packing, which is not supported yet"
            )
        self.latent_shape = latent_shapes.pop()
        self.has_first_frame = all(FIRST_FRAME_COLUMNS[0] in c for c in self._shards)
        longest = max(s[0] for c in self._shards for s in c["text_embedding_shape"])
        self.text_len = int(max_text_tokens) if max_text_tokens is not None else int(longest)
        if self.text_len < 1:
            raise ValueError(f"max_text_tokens must be >= 1, got {max_text_tokens}")

    @staticmethod
    def _read_shard(path: Path) -> dict[str, list]:
        names = pq.read_schema(path).names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise ValueError(f"{path} lacks required column(s) {', '.join(missing)} (see the data contract)")
        optional = [c for c in (*FIRST_FRAME_COLUMNS, *TEXT_MASK_COLUMNS) if c in names]
        return pq.read_table(path, columns=[*REQUIRED_COLUMNS, *optional]).to_pydict()

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def _tensor(columns: dict[str, list], prefix: str, row: int) -> torch.Tensor:
        return decode_tensor(
            columns[f"{prefix}_bytes"][row], columns[f"{prefix}_shape"][row], columns[f"{prefix}_dtype"][row]
        )

    def __getitem__(self, index: int) -> dict:
        shard_number, row = self._index[index]
        columns = self._shards[shard_number]
        latent = self._tensor(columns, "vae_latent", row).float()
        embedding = self._tensor(columns, "text_embedding", row).float()
        if "text_attention_mask_bytes" in columns:
            stored_mask = self._tensor(columns, "text_attention_mask", row).reshape(-1).bool()
        else:
            stored_mask = torch.ones(embedding.shape[0], dtype=torch.bool)

        keep = min(embedding.shape[0], self.text_len)
        text = torch.zeros(self.text_len, embedding.shape[1], dtype=torch.float32)
        text[:keep] = embedding[:keep]
        text_mask = torch.zeros(self.text_len, dtype=torch.bool)
        text_mask[:keep] = stored_mask[:keep]

        first_frame = None
        if "first_frame_latent_bytes" in columns:
            first_frame = self._tensor(columns, "first_frame_latent", row).float()
        return {
            "id": columns["id"][row],
            "caption": columns["caption"][row],
            "latent": latent,
            "text": text,
            "text_mask": text_mask,
            "first_frame": first_frame,
        }


class DistributedBatchIterator:
    """Endless batches for one data-parallel rank, resumable exactly, on any number of ranks.

    Each epoch shuffles the whole dataset with a permutation seeded by (seed, epoch), the same
    on every rank, and serves it as one global stream: sample k of the stream has the global
    index epoch * epoch_length + k (its "sample key", which keys its random draws). Rank r
    takes every dp_world-th sample, starting at r, so ranks see disjoint samples and any split
    of an optimizer step's global batch (batch_size x grad_accum x dp_world) covers the same
    consecutive keys. With drop_last (the default) the epoch is cut to a whole number of
    optimizer steps; without it, the permutation is extended by its own start so that every
    sample is seen and every batch is still full. All ranks make the same number of steps.

    Raises ValueError at construction if an epoch would hold no step.
    """

    def __init__(self, dataset, *, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 drop_last: bool = True, grad_accum: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_world = int(dp_world)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        step_samples = self.batch_size * self.dp_world * grad_accum
        count = len(dataset)
        steps = count // step_samples if drop_last else math.ceil(count / step_samples)
        if steps == 0:
            raise ValueError(
                f"{count} samples make no full global batch of {step_samples} (batch_size "
                f"{batch_size} x gradient accumulation {grad_accum} x dp_world {dp_world}); use "
                f"more data or drop_last=False")
        self.batches_per_epoch = steps * grad_accum
        self.epoch_length = steps * step_samples  # samples of the global stream per epoch
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        self._epoch_indices: tuple[int, np.ndarray] | None = None

    def _indices_for_epoch(self, epoch: int) -> np.ndarray:
        if self._epoch_indices is None or self._epoch_indices[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            order = np.resize(order, self.epoch_length)  # cuts, or wraps to fill the last step
            self._epoch_indices = (epoch, order[self.dp_rank :: self.dp_world])
        return self._epoch_indices[1]

    def next_batch(self) -> dict:
        """The next batch of this rank: {"latents" [B, C, T, H, W], "text" [B, L, D],
        "text_mask" bool [B, L], "first_frame" [B, C, 1, H, W] or None, "captions",
        "ids", "indices" (dataset positions), "sample_keys" (global stream indices)};
        tensors float32 except the mask."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        indices = self._indices_for_epoch(self.epoch)[start : start + self.batch_size]
        stream = (start + np.arange(len(indices))) * self.dp_world + self.dp_rank
        keys = self.epoch * self.epoch_length + stream
        self.position += 1
        items = [self.dataset[int(i)] for i in indices]
        frames = [item["first_frame"] for item in items]
        return {
            "latents": torch.stack([item["latent"] for item in items]),
            "text": torch.stack([item["text"] for item in items]),
            "text_mask": torch.stack([item["text_mask"] for item in items]),
            "first_frame": None if any(f is None for f in frames) else torch.stack(frames),
            "captions": [item["caption"] for item in items],
            "ids": [item["id"] for item in items],
            "indices": [int(i) for i in indices],
            "sample_keys": [int(k) for k in keys],
        }

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.next_batch()

    def state_dict(self) -> dict:
        """The cursor as a JSON-serialisable dict: enough to continue with the same batches.
        Its position is global (samples_in_epoch of the whole stream), so any rank's cursor
        resumes every rank of another split."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples_in_epoch": self.position * self.batch_size * self.dp_world,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_world": self.dp_world,
            "dataset_size": len(self.dataset),
            "batch_size": self.batch_size,
            "epoch_length": self.epoch_length,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor: the next samples of the global stream are those the
        saved run would have served next (its seed is adopted), whatever the saved run's
        dp_world and batch_size were.

        Raises ValueError if the dataset size or drop_last differ, if the epoch was cut at
        another length (another global batch: the epochs hold other samples), or if the saved
        position does not fall on a batch boundary of this split.
        """
        mine = self.state_dict()
        for key in ("dataset_size", "drop_last", "epoch_length"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"data cursor was saved with {key}={state[key]} but this run has "
                    f"{key}={mine[key]}; the saved position cannot be resumed exactly (the "
                    f"global batch, or the data, changed)")
        for key in ("dp_world", "dataset_size", "epoch", "position", "seed", "batch_size"):
            if key not in state:
                raise ValueError(f"data cursor state lacks {key!r}: {sorted(state)}")
        samples = int(state.get("samples_in_epoch",
                                state["position"] * state["batch_size"] * state["dp_world"]))
        per_batch = self.batch_size * self.dp_world
        if samples % per_batch:
            raise ValueError(
                f"the saved data position ({samples} samples into epoch {state['epoch']}) is "
                f"not a whole number of batches of {per_batch} (batch_size {self.batch_size} "
                f"x dp_world {self.dp_world}); resume with a split that divides it")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = samples // per_batch
        self._epoch_indices = None
