"""Where every sample lives and how big it is, read from the shards' small columns only.

Torch-free. `SampleIndex` reads the parquet footers and, per row group, the shape and
media-type columns (never the tensor bytes), so an epoch of a terabyte dataset can be planned
in a process that holds a few bytes per sample. A global sample index is a position in the
index: rows of a directory with repeat k appear k times, each copy with its own index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from trainer.data.formats import (
    FIRST_FRAME_COLUMNS,
    INDEX_COLUMNS,
    latent_shape_4d,
    missing_columns,
    resolve_datasets,
    stores_text_embeddings,
)


@dataclass(frozen=True)
class BadRow:
    shard: Path
    row: int
    reason: str


class SampleIndex:
    """The samples of a data_path, in storage order (shard, row group, row), repeats expanded.

    Per global index: `shape` [N, 4] (C, T, H, W; images T = 1), `text_len` [N], `is_image`
    [N] (media_type 'image', or T = 1 where the column is absent), `dataset` [N] (position in
    the data_path mapping), and where to read it (`shard`, `row_group`, `row` [N]). `blocks`
    [num_blocks + 1] are the bounds of runs of indices that share one row group (the unit of a
    read). Rows whose shape columns are null or malformed are left out and listed in `bad_rows`.

    `has_text_embeddings` is False for data that stores captions but no caption embeddings
    (every shard alike); its rows count `caption_tokens` caption tokens each (the text
    encoder's length, which encoding at training time pads or cuts to).

    Raises ValueError naming the shard when a shard lacks a required column or stores caption
    embeddings where another shard does not, and ValueError when no row is usable.
    """

    def __init__(self, data_path, caption_tokens: int = 0):
        self.shards: list[Path] = []
        self.bad_rows: list[BadRow] = []
        self.has_first_frame = True
        self.has_text_embeddings: bool | None = None
        self.caption_tokens = int(caption_tokens)
        per_row: list[tuple] = []      # (shard, group, row, C, T, H, W, text_len, is_image, dataset)
        copies: list[tuple[int, int, int]] = []  # (first row, row count, repeat) per shard
        for shard_number, (path, repeat, dataset) in enumerate(resolve_datasets(data_path)):
            self.shards.append(path)
            first = len(per_row)
            per_row.extend(self._read_shard(path, shard_number, dataset))
            copies.append((first, len(per_row) - first, repeat))
        if not per_row:
            raise ValueError(f"the data ({len(self.shards)} shards) holds no usable rows"
                             + (f"; {len(self.bad_rows)} bad rows, first: {self.bad_rows[0]}"
                                if self.bad_rows else ""))
        table = np.asarray(per_row, dtype=np.int64)
        order, bounds, offset = [], [0], 0
        for first, count, repeat in copies:
            rows = np.arange(first, first + count)
            # Where one row group ends and the next begins, within this shard's rows.
            ends = np.append(np.flatnonzero(np.diff(table[first:first + count, 1])) + 1, count)
            for _ in range(repeat if count else 0):
                order.append(rows)
                bounds.extend((offset + ends).tolist())
                offset += count
        self._global_rows = np.concatenate(order)
        self.blocks = np.asarray(bounds, dtype=np.int64)
        rows = table[self._global_rows]
        self.shard, self.row_group, self.row = rows[:, 0], rows[:, 1], rows[:, 2]
        self.shape = rows[:, 3:7]
        self.text_len = rows[:, 7]
        self.is_image = rows[:, 8].astype(bool)
        self.dataset = rows[:, 9]

    def _read_shard(self, path: Path, shard_number: int, dataset: int) -> list[tuple]:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        missing = missing_columns(names)
        if missing:
            raise ValueError(f"{path} lacks required column(s) {', '.join(missing)} (see the data contract)")
        self.has_first_frame &= FIRST_FRAME_COLUMNS[0] in names
        stored = stores_text_embeddings(names)
        if self.has_text_embeddings is None:
            self.has_text_embeddings = stored
        elif stored != self.has_text_embeddings:
            raise ValueError(
                f"{path} {'stores' if stored else 'lacks'} caption embeddings (text_embedding_*) "
                f"but {self.shards[0]} {'lacks' if stored else 'stores'} them: encode every "
                "dataset of a run the same way (relay data encode), or drop the columns from all")
        columns = [c for c in INDEX_COLUMNS if c in names]
        rows, offset = [], 0
        for group in range(file.num_row_groups):
            part = file.read_row_group(group, columns=columns).to_pydict()
            count = len(part["vae_latent_shape"])
            media = part.get("media_type") or [None] * count
            # Captions without embeddings: planned at the encoder's length.
            text_shapes = part.get("text_embedding_shape") or [[self.caption_tokens, 0]] * count
            for row, (shape, text_shape, kind) in enumerate(
                    zip(part["vae_latent_shape"], text_shapes, media)):
                try:
                    c, t, h, w = latent_shape_4d(shape or ())
                    if not text_shape or len(text_shape) != 2:
                        raise ValueError(f"text embedding is [L, D], got {text_shape}")
                except ValueError as error:
                    self.bad_rows.append(BadRow(path, offset + row, str(error)))
                    continue
                is_image = kind == "image" if kind is not None else t == 1
                rows.append((shard_number, group, row, c, t, h, w, int(text_shape[0]), is_image, dataset))
            offset += count
        return rows

    def __len__(self) -> int:
        return len(self._global_rows)

    def video_tokens(self, patch_size: tuple[int, int, int]) -> np.ndarray:
        """Video tokens per sample [N] at this patch size (frames and sides rounded down)."""
        pt, ph, pw = patch_size
        s = self.shape
        return np.maximum(s[:, 1] // pt, 1) * (s[:, 2] // ph) * (s[:, 3] // pw)

    def distinct_shapes(self, indices: np.ndarray | None = None) -> list[tuple[int, ...]]:
        """The distinct latent shapes, sorted, of all samples or of `indices`."""
        shapes = self.shape if indices is None else self.shape[indices]
        return [tuple(int(v) for v in s) for s in np.unique(shapes, axis=0)] if len(shapes) else []


def first_latent_shape(data_path) -> tuple[int, int, int, int]:
    """[C, T, H, W] of the first sample of the first shard, reading only its shape column.

    Raises FileNotFoundError / ValueError as resolve_data_paths does, or when the shard has no rows.
    """
    shard = resolve_datasets(data_path)[0][0]
    table = pq.ParquetFile(shard).read_row_group(0, columns=["vae_latent_shape"])
    if table.num_rows == 0:
        raise ValueError(f"{shard} holds no rows")
    return latent_shape_4d(table.column("vae_latent_shape")[0].as_py())


def data_stores_text_embeddings(data_path) -> bool:
    """Whether the data stores caption embeddings, from the schema of each dataset's first
    shard (a footer read; SampleIndex checks every shard). Raises as resolve_datasets."""
    firsts: dict[int, Path] = {}
    for path, _, dataset in resolve_datasets(data_path):
        firsts.setdefault(dataset, path)
    return all(stores_text_embeddings(pq.ParquetFile(p).schema_arrow.names) for p in firsts.values())
