"""Samples read from parquet shards a row group at a time, decoded into tensors.

`ParquetLatentDataset` is map-style over a SampleIndex: `dataset[i]` is global sample i, and
`dataset.__getitems__(indices)` (what torch's DataLoader calls for a batch) reads each row
group the batch touches once. A small LRU of row groups per process bounds memory: the epoch
order keeps a batch within a window of WINDOW_BLOCKS row groups, so the cache holds one window.
"""

from __future__ import annotations

from collections import OrderedDict

import pyarrow.parquet as pq
import torch

from trainer.data.formats import (
    FIRST_FRAME_COLUMNS,
    REQUIRED_COLUMNS,
    TEXT_COLUMNS,
    TEXT_MASK_COLUMNS,
    latent_shape_4d,
    normalise_dtype,
    tensor_nbytes,
)
from trainer.data.index import SampleIndex
from trainer.data.order import WINDOW_BLOCKS

_TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8,
    "int32": torch.int32, "int64": torch.int64,
}


def decode_tensor(data: bytes, shape, dtype: str) -> torch.Tensor:
    """A tensor from the contract's (bytes, shape, dtype) triple; a copy, safe to modify.

    Raises ValueError for an unknown dtype or a byte count that does not match the shape.
    """
    expected = tensor_nbytes(shape, dtype)
    torch_dtype = _TORCH_DTYPES[normalise_dtype(dtype)]
    shape = [int(s) for s in shape]
    if data is None or len(data) != expected:
        got = "no" if data is None else len(data)
        raise ValueError(f"{got} bytes do not hold a {dtype} tensor of shape {shape} ({expected} bytes)")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the copy detaches from arrow.
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


class ParquetLatentDataset:
    """Global samples of a data_path, read on demand (see SampleIndex for the numbering).

    `data` is a data_path, a resolve_data_paths() result, or a SampleIndex. dataset[i] gives
    {"index", "id", "caption", "latent" float32 [C, T, H, W] (an image [C, H, W] gets T = 1),
    "text" float32 [L, D], "text_mask" bool [L], "first_frame" float32 [C, 1, H, W] or None}.
    With pad_text (the default) captions are padded with zeros, or cut, to L = max_text_tokens
    (default: the longest in the data; the chosen L is `text_len`) and masked, so unpacked
    batches stack; pad_text=False keeps every caption at its stored length (packing). Data
    that stores captions without embeddings gives "text" and "text_mask" None: the loader's
    caption encoder fills them (its caption_tokens plan each caption's length; SampleIndex).

    Raises ValueError (from SampleIndex) naming a shard that lacks required columns.
    """

    def __init__(self, data, *, max_text_tokens: int | None = None, pad_text: bool = True,
                 cache_row_groups: int = WINDOW_BLOCKS + 1, caption_tokens: int = 0):
        if isinstance(data, SampleIndex):
            self.index = data
        else:
            # A resolved [(path, repeat)] list is the mapping {path: repeat} of single shards.
            self.index = SampleIndex({str(p): int(r) for p, r in data} if isinstance(data, list) else data,
                                     caption_tokens=caption_tokens)
        self.has_first_frame = self.index.has_first_frame
        self.latent_shape = tuple(int(s) for s in self.index.shape[0])
        longest = int(self.index.text_len.max())
        self.text_len = int(max_text_tokens) if max_text_tokens is not None else longest
        if self.text_len < 1:
            raise ValueError(f"max_text_tokens must be >= 1, got {max_text_tokens}")
        self.pad_text = pad_text
        self.cache_row_groups = int(cache_row_groups)
        self._files: dict[int, pq.ParquetFile] = {}
        self._cache: OrderedDict[tuple[int, int], dict[str, list]] = OrderedDict()

    def __getstate__(self):
        # Worker processes get the index; open files and cached row groups stay behind.
        return {**self.__dict__, "_files": {}, "_cache": OrderedDict()}

    def __len__(self) -> int:
        return len(self.index)

    def _row_group(self, shard: int, group: int) -> dict[str, list]:
        key = (shard, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        file = self._files.get(shard)
        if file is None:
            file = self._files[shard] = pq.ParquetFile(self.index.shards[shard])
        names = file.schema_arrow.names
        optional = (*TEXT_COLUMNS, *FIRST_FRAME_COLUMNS, *TEXT_MASK_COLUMNS)
        columns = [*(c for c in REQUIRED_COLUMNS if c not in TEXT_COLUMNS),
                   *(c for c in optional if c in names)]
        self._cache[key] = file.read_row_group(group, columns=columns).to_pydict()
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return self._cache[key]

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        where = self.index
        try:
            columns = self._row_group(int(where.shard[index]), int(where.row_group[index]))
            return self._decode(columns, int(where.row[index]), index)
        except ValueError as error:
            raise ValueError(f"{where.shards[int(where.shard[index])]} row group "
                             f"{int(where.row_group[index])} row {int(where.row[index])}: {error}") from None

    def __getitems__(self, indices) -> list[dict]:
        # Rows of one row group together, so each group is fetched once per batch.
        ordered = sorted(range(len(indices)), key=lambda k: (int(self.index.shard[indices[k]]),
                                                             int(self.index.row_group[indices[k]])))
        items: list[dict | None] = [None] * len(indices)
        for k in ordered:
            items[k] = self[indices[k]]
        return items  # type: ignore[return-value]

    @staticmethod
    def _tensor(columns: dict[str, list], prefix: str, row: int) -> torch.Tensor:
        return decode_tensor(columns[f"{prefix}_bytes"][row], columns[f"{prefix}_shape"][row],
                             columns[f"{prefix}_dtype"][row])

    def _decode(self, columns: dict[str, list], row: int, index: int) -> dict:
        latent = self._tensor(columns, "vae_latent", row).float()
        latent = latent.reshape(latent_shape_4d(latent.shape))
        first_frame = None
        if "first_frame_latent_bytes" in columns:
            first_frame = self._tensor(columns, "first_frame_latent", row).float()
            first_frame = first_frame.reshape(latent_shape_4d(first_frame.shape))
        sample = {"index": index, "id": columns["id"][row], "caption": columns["caption"][row],
                  "latent": latent, "text": None, "text_mask": None, "first_frame": first_frame}
        if "text_embedding_bytes" not in columns:
            return sample  # captions only: encoded by the loader
        embedding = self._tensor(columns, "text_embedding", row).float()
        if "text_attention_mask_bytes" in columns:
            stored_mask = self._tensor(columns, "text_attention_mask", row).reshape(-1).bool()
        else:
            stored_mask = torch.ones(embedding.shape[0], dtype=torch.bool)
        length = self.text_len if self.pad_text else embedding.shape[0]
        keep = min(embedding.shape[0], length)
        text = torch.zeros(length, embedding.shape[1], dtype=torch.float32)
        text[:keep] = embedding[:keep]
        text_mask = torch.zeros(length, dtype=torch.bool)
        text_mask[:keep] = stored_mask[:keep]
        return {**sample, "text": text, "text_mask": text_mask}
