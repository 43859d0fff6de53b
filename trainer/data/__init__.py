"""Training data: pre-encoded parquet samples, read as a stream (docs/data.md, "Layouts").

  formats   the columns, dtypes and shard discovery of relay's and FastVideo's layouts (no torch)
  index     where each sample lives and its shape, from the small columns only (no torch)
  order     the epoch order, dp-rank assignment, mixing and packing plan from a cursor (no torch)
  reader    row-group reads and tensor decoding (torch)
  loader    the per-rank iterator over a DataLoader with worker processes (torch)
  packing   a pack's sequences laid out for attention, RoPE, modulation and the loss (torch)
  report    `relay data inspect` / `relay data plan` (no torch)

The torch-free names import eagerly; the others on first use, so `from trainer.data import
resolve_data_paths` works on a login node without torch.
"""

from trainer.data.formats import resolve_data_paths
from trainer.data.index import SampleIndex, first_latent_shape
from trainer.data.order import BatchPlan

_LAZY = {"decode_tensor": "trainer.data.reader", "ParquetLatentDataset": "trainer.data.reader",
         "DistributedBatchIterator": "trainer.data.loader"}

__all__ = ["BatchPlan", "DistributedBatchIterator", "ParquetLatentDataset", "SampleIndex", "decode_tensor",
           "first_latent_shape", "resolve_data_paths"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
