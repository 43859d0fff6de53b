"""The streaming reader on both layouts: coverage across ranks, exact resume, workers, mixing."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fixtures.fastvideo_t2v import (
    T2V_SCHEMA,
    row_number,
    sample_tensors,
    write_fastvideo_dataset,
)

from trainer.data import (
    BatchPlan,
    DistributedBatchIterator,
    ParquetLatentDataset,
    SampleIndex,
)
from trainer.data.synthetic import generate_dataset

PATCH = (1, 2, 2)


@pytest.fixture(scope="module")
def fastvideo_dir(tmp_path_factory):
    return write_fastvideo_dataset(tmp_path_factory.mktemp("fv"), 30)


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    return generate_dataset(tmp_path_factory.mktemp("shapes"), 20, seed=5, samples_per_shard=5,
                            text_dim=16, max_text_tokens=8)


def _epoch(iterator, batches):
    return [i for _ in range(batches) for i in iterator.next_batch()["sample_index"].tolist()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fastvideo_layout_reads_as_written_with_images_as_one_frame(tmp_path, dtype):
    write_fastvideo_dataset(tmp_path, 9, dtype=dtype)
    dataset = ParquetLatentDataset(str(tmp_path), pad_text=False)
    assert len(dataset) == 9
    for index in range(9):
        item = dataset[index]
        latent, text, media = sample_tensors(row_number(item["id"]), dtype)
        expected = latent if latent.dim() == 4 else latent[:, None]   # [C, H, W] -> [C, 1, H, W]
        assert torch.equal(item["latent"], expected.float())
        assert torch.equal(item["text"], text.float()) and item["text_mask"].all()
        assert bool(dataset.index.is_image[index]) == (media == "image")


def test_combined_parquet_dataset_is_read_instead_of_the_worker_folders(tmp_path):
    write_fastvideo_dataset(tmp_path, 8)
    combined = tmp_path / "combined_parquet_dataset"
    combined.mkdir()
    tables = [pq.read_table(p) for p in sorted(tmp_path.glob("worker_*/*.parquet"))]
    pq.write_table(pa.concat_tables(tables), combined / "data.parquet")
    assert len(SampleIndex(str(tmp_path))) == 8


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_epoch_reads_every_sample_once_across_ranks(fastvideo_dir, world):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    seen = []
    for rank in range(world):
        plan = BatchPlan(dataset.index, dp_rank=rank, dp_world=world, seed=3, drop_last=False,
                         token_budget=60, patch_size=PATCH)
        cursor = plan.initial_cursor()
        while cursor["streams"]["all"]["position"] < plan.per_rank["all"]:
            indices, cursor = plan.next(cursor)
            assert plan.tokens[indices].sum() <= 60
            seen.extend(indices.tolist())
    # 30 samples over `world` ranks: without drop_last the order wraps to fill the last ranks.
    assert set(seen) == set(range(30)) and len(seen) == -(-30 // world) * world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_unpacked_epoch_reads_every_sample_once_across_ranks(shapes_dir, world):
    dataset = ParquetLatentDataset(str(shapes_dir))
    seen = []
    for rank in range(world):
        iterator = DistributedBatchIterator(dataset, batch_size=5 // world or 1, dp_rank=rank,
                                            dp_world=world, seed=1)
        seen.extend(_epoch(iterator, iterator.batches_per_epoch))
    assert sorted(seen) == list(range(20))


def test_batches_are_the_same_with_zero_and_two_workers(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    runs = []
    for workers in (0, 2):
        iterator = DistributedBatchIterator(dataset, batch_size=1, dp_rank=0, dp_world=1, seed=4,
                                            token_budget=80, patch_size=PATCH, num_workers=workers)
        runs.append([iterator.next_batch() for _ in range(8)])
    for a, b in zip(*runs):
        assert a["ids"] == b["ids"]
        assert all(torch.equal(x, y) for x, y in zip(a["latents"], b["latents"]))


def test_kill_and_resume_with_workers_gives_the_same_packs(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    kwargs = dict(batch_size=1, dp_rank=1, dp_world=2, seed=7, token_budget=70, patch_size=PATCH,
                  num_workers=2, prefetch_factor=2)
    original = DistributedBatchIterator(dataset, **kwargs)
    for _ in range(5):
        original.next_batch()
    # The workers have read ahead of the trainer; the saved cursor is the trainer's.
    state = json.loads(json.dumps(original.state_dict()))
    expected = [original.next_batch()["sample_index"].tolist() for _ in range(12)]  # crosses epochs
    del original
    resumed = DistributedBatchIterator(dataset, **{**kwargs, "seed": 0})
    resumed.load_state_dict(state)
    assert [resumed.next_batch()["sample_index"].tolist() for _ in range(12)] == expected


def test_cursor_from_another_token_budget_is_refused(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    state = DistributedBatchIterator(dataset, batch_size=1, dp_rank=0, dp_world=1, seed=0,
                                     token_budget=70, patch_size=PATCH).state_dict()
    other = DistributedBatchIterator(dataset, batch_size=1, dp_rank=0, dp_world=1, seed=0,
                                     token_budget=90, patch_size=PATCH)
    with pytest.raises(ValueError, match="token_budget=70"):
        other.load_state_dict(state)


def test_mixed_shapes_without_packing_are_refused_with_the_key_to_set(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir))
    with pytest.raises(ValueError, match="packing_token_budget"):
        DistributedBatchIterator(dataset, batch_size=2, dp_rank=0, dp_world=1, seed=0)


def test_a_sample_longer_than_the_budget_is_refused(fastvideo_dir):
    with pytest.raises(ValueError, match="token budget 20"):
        BatchPlan(SampleIndex(str(fastvideo_dir)), dp_rank=0, dp_world=1, seed=0, token_budget=20,
                  patch_size=PATCH)


def test_repeat_count_multiplies_a_datasets_share(shapes_dir, fastvideo_dir):
    index = SampleIndex({str(shapes_dir): 1, str(fastvideo_dir): 3})
    plan = BatchPlan(index, dp_rank=0, dp_world=1, seed=0, drop_last=False, token_budget=10_000,
                     patch_size=PATCH)
    order = plan.rank_epoch("all", 0)
    assert np.bincount(index.dataset[order]).tolist() == [20, 90]


def test_image_sample_prob_sets_the_share_of_image_batches(fastvideo_dir, shapes_dir):
    plan = BatchPlan(SampleIndex(str(fastvideo_dir)), dp_rank=0, dp_world=1, seed=0, batch_size=2,
                     image_sample_prob=0.3, drop_last=False)
    cursor, images = plan.initial_cursor(), 0
    for _ in range(1000):
        indices, cursor = plan.next(cursor)
        is_image = plan.index.is_image[indices]
        assert is_image.all() or not is_image.any()   # one stream per batch
        images += bool(is_image.all())
    assert 0.26 < images / 1000 < 0.34   # binomial sd 0.0145: 3 sd either side
    with pytest.raises(ValueError, match="no image samples"):
        BatchPlan(SampleIndex(str(shapes_dir)), dp_rank=0, dp_world=1, seed=0,
                  image_sample_prob=0.5)  # the synthetic set holds videos only


def test_resetting_the_video_stream_keeps_the_image_cursor(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    kwargs = dict(batch_size=2, dp_rank=0, dp_world=1, seed=2, image_sample_prob=0.5,
                  token_budget=200, patch_size=PATCH)
    original = DistributedBatchIterator(dataset, **kwargs)
    for _ in range(6):
        original.next_batch()
    state = original.state_dict()
    resumed = DistributedBatchIterator(dataset, **kwargs, reset_streams=("video",))
    resumed.load_state_dict(state)
    assert resumed.cursor["streams"]["video"] == {"epoch": 0, "position": 0}
    assert resumed.cursor["streams"]["image"] == state["cursor"]["streams"]["image"]


def test_reader_holds_at_most_its_row_group_cache(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False, cache_row_groups=2)
    for index in range(len(dataset)):
        dataset[index]
        assert len(dataset._cache) <= 2


def test_bad_rows_are_listed_and_left_out(tmp_path):
    write_fastvideo_dataset(tmp_path, 6, workers=1)
    path = tmp_path / "worker_0" / "data_chunk_0.parquet"
    table = pq.read_table(path).to_pylist()
    table[2]["vae_latent_shape"] = [4, 5]
    pq.write_table(pa.Table.from_pylist(table, schema=T2V_SCHEMA), path)
    index = SampleIndex(str(tmp_path))
    assert len(index) == 5 and [b.row for b in index.bad_rows] == [2]
    assert "[C, T, H, W]" in index.bad_rows[0].reason


def test_starting_or_restarting_the_loader_leaves_the_training_rng_alone(fastvideo_dir):
    dataset = ParquetLatentDataset(str(fastvideo_dir), pad_text=False)
    iterator = DistributedBatchIterator(dataset, batch_size=1, dp_rank=0, dp_world=1, seed=0,
                                        token_budget=80, patch_size=PATCH, num_workers=2)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    iterator.next_batch()
    iterator.load_state_dict(iterator.state_dict())  # a resume starts a new loader iterator
    iterator.next_batch()
    assert torch.equal(torch.rand(3), expected)
