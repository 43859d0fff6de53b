"""The on-disk sample format (docs/data.md, "Layouts"): columns, dtypes, shard discovery.

Torch-free, so `relay data inspect/plan` and the login-node checks can use it. Two layouts are
read as they are: relay's own shards (what trainer.data.synthetic and `relay data encode` write) and
FastVideo's preprocessed T2V datasets. Both store each tensor as a (bytes, shape, dtype) column
triple; they differ in where the files sit and in the extra columns they carry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from os import PathLike
from pathlib import Path

# The caption embedding triple. A dataset may leave it out and keep its captions: the trainer
# then encodes them with its text encoder as it reads (docs/data.md, "Captions without
# embeddings"). It is all three columns or none.
TEXT_COLUMNS = ("text_embedding_bytes", "text_embedding_shape", "text_embedding_dtype")
REQUIRED_COLUMNS = (
    "id",
    "caption",
    "vae_latent_bytes",
    "vae_latent_shape",
    "vae_latent_dtype",
    *TEXT_COLUMNS,
)
FIRST_FRAME_COLUMNS = ("first_frame_latent_bytes", "first_frame_latent_shape", "first_frame_latent_dtype")
# Some FastVideo schemas store the text mask; when it is there it decides which tokens are real.
TEXT_MASK_COLUMNS = ("text_attention_mask_bytes", "text_attention_mask_shape", "text_attention_mask_dtype")
# The small columns an index is built from: no tensor bytes are read to plan an epoch.
INDEX_COLUMNS = ("vae_latent_shape", "text_embedding_shape", "media_type")

# Bytes per element of every dtype string the format may carry.
DTYPE_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "bool": 1, "uint8": 1, "int8": 1,
    "int32": 4, "int64": 8,
}

# FastVideo's preprocessing writes per-worker folders and may also write their concatenation
# here; when it exists it is the dataset, and reading both would count every sample twice.
FASTVIDEO_COMBINED = "combined_parquet_dataset"


def normalise_dtype(dtype: str) -> str:
    """'torch.bfloat16' (written by str(tensor.dtype)) and 'bfloat16' name the same dtype."""
    return dtype.removeprefix("torch.")


def latent_shape_4d(shape) -> tuple[int, int, int, int]:
    """[C, T, H, W] of a stored latent: an image stored as [C, H, W] is one frame (T = 1).

    Raises ValueError for any other rank.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3:
        return (shape[0], 1, shape[1], shape[2])
    if len(shape) != 4:
        raise ValueError(f"a latent is [C, T, H, W] or [C, H, W], got shape {list(shape)}")
    return shape  # type: ignore[return-value]


def tensor_nbytes(shape, dtype: str) -> int:
    """Bytes a (shape, dtype) tensor occupies. Raises ValueError for an unknown dtype."""
    itemsize = DTYPE_ITEMSIZE.get(normalise_dtype(dtype))
    if itemsize is None:
        raise ValueError(f"unsupported tensor dtype {dtype!r}; known: {', '.join(DTYPE_ITEMSIZE)}")
    return math.prod(int(s) for s in shape) * itemsize


def missing_columns(names) -> list[str]:
    """The required columns a shard's schema lacks (empty when it can be read). The caption
    embedding triple counts as missing only when part of it is there."""
    text_optional = not any(c in names for c in TEXT_COLUMNS)
    return [c for c in REQUIRED_COLUMNS
            if c not in names and not (text_optional and c in TEXT_COLUMNS)]


def stores_text_embeddings(names) -> bool:
    """Whether a shard with these columns stores caption embeddings (else only captions)."""
    return all(c in names for c in TEXT_COLUMNS)


def shards_of_directory(root: Path) -> list[Path]:
    """Every *.parquet below root, sorted; only combined_parquet_dataset/ when it is there."""
    combined = root / FASTVIDEO_COMBINED
    if combined.is_dir() and any(combined.rglob("*.parquet")):
        root = combined
    return sorted(root.rglob("*.parquet"))


def layout_of(root: Path) -> str:
    """'fastvideo' for a FastVideo preprocessed dataset, else 'relay' (what inspect reports)."""
    if (root / FASTVIDEO_COMBINED).is_dir() or any(p.name.startswith("worker_") for p in root.iterdir()):
        return "fastvideo"
    return "relay"


def resolve_data_paths(data_path) -> list[tuple[Path, int]]:
    """Shard files and their repeat counts: [(shard_path, repeat), ...].

    data_path is a directory (str or PathLike; repeat 1) or a mapping {directory: repeat}
    with integer repeats >= 1. Each directory is searched recursively for *.parquet, sorted,
    so preprocessed datasets with sub-folders load as they are.

    Raises TypeError for another kind of data_path, ValueError for an empty mapping or a bad
    repeat count, FileNotFoundError for a missing directory or one without parquet files.
    """
    return [(path, repeat) for path, repeat, _ in resolve_datasets(data_path)]


def resolve_datasets(data_path) -> list[tuple[Path, int, int]]:
    """As resolve_data_paths, with each shard's dataset number (its position in the mapping)."""
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
    for number, (directory, repeat) in enumerate(entries):
        # bool is an int subclass; "true" is never a meaningful repeat count.
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ValueError(
                f"data_path repeat count for {directory} must be an integer >= 1, got {repeat!r}"
            )
        root = Path(directory)
        if root.is_file() and root.suffix == ".parquet":  # one shard (a resolved list)
            shards.append((root, repeat, number))
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"data directory {root} does not exist (or is not a directory)")
        found = shards_of_directory(root)
        if not found:
            raise FileNotFoundError(f"data directory {root} holds no *.parquet files")
        shards.extend((path, repeat, number) for path in found)
    return shards
