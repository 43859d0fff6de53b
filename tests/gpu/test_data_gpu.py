"""The data loader feeding a GPU: packed batches from worker processes, in page-locked memory."""

import pytest
import torch
from fixtures.fastvideo_t2v import write_fastvideo_dataset

from trainer.data import DistributedBatchIterator, ParquetLatentDataset
from trainer.stages.base import batch_to_device

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _tensors(batch: dict) -> list[torch.Tensor]:
    found = []
    for value in batch.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


def test_packed_batches_from_workers_arrive_pinned_and_reach_the_gpu_unchanged(tmp_path):
    # Mixed shapes (videos and images) packed into a token budget, read by two worker
    # processes: with pin_memory (what the trainer sets on a GPU) every tensor of a pack,
    # the lists of latents and caption embeddings too, is page-locked, and the copy to the
    # GPU (non-blocking, as in training) gives the bytes of the unpinned batch.
    dataset = ParquetLatentDataset(str(write_fastvideo_dataset(tmp_path, 30)), pad_text=False)
    runs = {}
    for pinned in (False, True):
        iterator = DistributedBatchIterator(dataset, batch_size=1, dp_rank=0, dp_world=1, seed=4,
                                            token_budget=80, patch_size=(1, 2, 2), num_workers=2,
                                            pin_memory=pinned)
        runs[pinned] = [iterator.next_batch() for _ in range(6)]
    assert any(len(batch["latents"]) > 1 for batch in runs[True])  # packs of several samples
    for plain, pinned in zip(runs[False], runs[True]):
        assert plain["ids"] == pinned["ids"]
        assert all(t.is_pinned() for t in _tensors(pinned))
        on_gpu = batch_to_device(pinned, DEVICE)
        torch.cuda.synchronize()
        expected, moved = _tensors(plain), _tensors(on_gpu)
        assert len(expected) == len(moved) > 2
        for want, got in zip(expected, moved):
            assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
