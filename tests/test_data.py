import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.data import (
    DistributedBatchIterator,
    ParquetLatentDataset,
    decode_tensor,
    resolve_data_paths,
)
from trainer.data.synthetic import generate_dataset, make_clip


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    # 24 samples in 3 shards; seed 5.
    return generate_dataset(tmp_path_factory.mktemp("shapes"), 24, seed=5, samples_per_shard=8,
                            text_dim=16, max_text_tokens=8)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return generate_dataset(tmp_path_factory.mktemp("other"), 6, seed=6, samples_per_shard=6,
                            text_dim=16, max_text_tokens=8)


def test_directory_resolves_to_its_sorted_shards_with_repeat_one(shapes_dir):
    shards = resolve_data_paths(str(shapes_dir))
    assert [(p.name, r) for p, r in shards] == [
        ("shard-00000.parquet", 1), ("shard-00001.parquet", 1), ("shard-00002.parquet", 1)]


def test_mapping_gives_each_directory_its_repeat_count(shapes_dir, other_dir):
    shards = resolve_data_paths({str(shapes_dir): 1, str(other_dir): 3})
    assert [r for _, r in shards] == [1, 1, 1, 3]


@pytest.mark.parametrize("repeat", [0, -1, 1.5, "2", True])
def test_bad_repeat_count_is_rejected(shapes_dir, repeat):
    with pytest.raises(ValueError, match="repeat count"):
        resolve_data_paths({str(shapes_dir): repeat})


def test_missing_directory_and_directory_without_parquet_are_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_data_paths(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no \\*.parquet"):
        resolve_data_paths(str(tmp_path))
    with pytest.raises(TypeError):
        resolve_data_paths(3)
    with pytest.raises(ValueError, match="empty"):
        resolve_data_paths({})


def test_dataset_decodes_rows_equal_to_the_generated_clips(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    assert len(dataset) == 24 and dataset.text_len == 5 and dataset.has_first_frame
    for index in (0, 9, 23):
        item = dataset[index]
        spec, clip = make_clip(5, index)
        assert torch.equal(item["latent"], torch.from_numpy(clip))
        assert torch.equal(item["first_frame"], torch.from_numpy(clip[:, :1]))
        assert item["caption"] == spec.caption
        assert item["text"].shape == (5, 16) and item["text_mask"].all()


def test_text_is_padded_and_masked_to_max_text_tokens(shapes_dir):
    item = ParquetLatentDataset(str(shapes_dir), max_text_tokens=8)[0]
    assert item["text"].shape == (8, 16)
    assert item["text_mask"].tolist() == [True] * 5 + [False] * 3
    assert torch.all(item["text"][5:] == 0)


def test_dataset_accepts_already_resolved_paths(shapes_dir, other_dir):
    resolved = resolve_data_paths({str(shapes_dir): 1, str(other_dir): 2})
    assert len(ParquetLatentDataset(resolved)) == 24 + 2 * 6


def test_repeat_two_doubles_that_directorys_samples_per_epoch(shapes_dir, other_dir):
    dataset = ParquetLatentDataset({str(shapes_dir): 1, str(other_dir): 2})
    assert len(dataset) == 24 + 2 * 6
    iterator = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=1, seed=0)
    ids = [i for _ in range(iterator.batches_per_epoch) for i in iterator.next_batch()["ids"]]
    counts = {i: ids.count(i) for i in set(ids)}
    assert sorted(c for i, c in counts.items() if i.startswith("shapes-s6-")) == [2] * 6
    assert sorted(c for i, c in counts.items() if i.startswith("shapes-s5-")) == [1] * 24


def test_missing_columns_are_named_in_the_error(tmp_path):
    # caption embeddings are optional as a whole triple; half of one is an error
    table = pa.table({"id": ["x"], "caption": ["a red square moving left"], "vae_latent_bytes": [b""],
                      "text_embedding_bytes": [b""]})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="vae_latent_shape.*text_embedding_shape"):
        ParquetLatentDataset(str(tmp_path))


def test_decode_tensor_checks_byte_count_and_handles_bfloat16():
    values = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    raw = values.view(torch.int16).numpy().tobytes()
    assert torch.equal(decode_tensor(raw, [2, 3], "bfloat16"), values)
    with pytest.raises(ValueError, match="bytes"):
        decode_tensor(raw, [4, 3], "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        decode_tensor(raw, [2, 3], "complex7")


def test_batch_has_the_documented_shapes(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir), max_text_tokens=8)
    batch = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=1, seed=0).next_batch()
    assert batch["latents"].shape == (4, 3, 8, 16, 16) and batch["latents"].dtype == torch.float32
    assert batch["text"].shape == (4, 8, 16) and batch["text_mask"].shape == (4, 8)
    assert batch["text_mask"].dtype == torch.bool
    assert batch["first_frame"].shape == (4, 3, 1, 16, 16)
    assert len(batch["captions"]) == len(batch["ids"]) == 4


def test_two_ranks_see_disjoint_samples_that_cover_the_epoch(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    seen = []
    for rank in (0, 1):
        iterator = DistributedBatchIterator(dataset, batch_size=3, dp_rank=rank, dp_world=2, seed=1)
        seen.append([i for _ in range(iterator.batches_per_epoch) for i in iterator.next_batch()["indices"]])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(24))


def test_epochs_are_shuffled_differently_and_drop_last_keeps_batches_full(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    iterator = DistributedBatchIterator(dataset, batch_size=5, dp_rank=0, dp_world=1, seed=1)
    assert iterator.batches_per_epoch == 4  # 24 // 5
    first = [iterator.next_batch()["indices"] for _ in range(4)]
    second = [iterator.next_batch()["indices"] for _ in range(4)]
    assert iterator.epoch == 1 and first != second
    assert all(len(b) == 5 for b in first + second)


def test_without_drop_last_every_sample_is_seen_in_full_batches(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    iterator = DistributedBatchIterator(dataset, batch_size=5, dp_rank=0, dp_world=1, seed=1, drop_last=False)
    batches = [iterator.next_batch()["indices"] for _ in range(iterator.batches_per_epoch)]
    assert all(len(b) == 5 for b in batches)
    assert set(i for b in batches for i in b) == set(range(24))


def test_resume_mid_epoch_yields_the_identical_next_batches(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    original = DistributedBatchIterator(dataset, batch_size=4, dp_rank=1, dp_world=2, seed=3)
    for _ in range(2):  # mid-epoch: 3 batches per epoch
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))  # as saved to dataloader/<rank>.json
    assert state["cursor"]["streams"]["all"] == {"epoch": 0, "position": 8} and state["dp_world"] == 2
    resumed = DistributedBatchIterator(dataset, batch_size=4, dp_rank=1, dp_world=2, seed=99)
    resumed.load_state_dict(state)
    for _ in range(5):  # crosses into the next epochs
        expected, actual = original.next_batch(), resumed.next_batch()
        assert expected["ids"] == actual["ids"]
        assert torch.equal(expected["latents"], actual["latents"])


def test_a_cursor_saved_on_two_ranks_continues_the_same_stream_on_one_and_on_four(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    two = [DistributedBatchIterator(dataset, batch_size=2, dp_rank=r, dp_world=2, seed=0)
           for r in range(2)]
    for it in two:
        it.next_batch()
    state = json.loads(json.dumps(two[0].state_dict()))
    batches = [it.next_batch() for it in two]
    keys = sorted(k for b in batches for k in b["sample_keys"])
    ids = sorted(i for b in batches for i in b["ids"])
    one = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=1, seed=0)
    one.load_state_dict(state)
    batch = one.next_batch()
    assert sorted(batch["sample_keys"]) == keys and sorted(batch["ids"]) == ids
    four = [DistributedBatchIterator(dataset, batch_size=1, dp_rank=r, dp_world=4, seed=0)
            for r in range(4)]
    for it in four:
        it.load_state_dict(state)
    batches = [it.next_batch() for it in four]
    assert sorted(k for b in batches for k in b["sample_keys"]) == keys
    assert sorted(i for b in batches for i in b["ids"]) == ids


def test_too_little_data_for_one_global_batch_raises(other_dir):
    dataset = ParquetLatentDataset(str(other_dir))
    with pytest.raises(ValueError, match="no full global batch"):
        DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=2, seed=0)


def test_a_cursor_saved_before_streaming_resumes_at_its_epoch_and_position(shapes_dir, caplog):
    dataset = ParquetLatentDataset(str(shapes_dir))
    iterator = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=2, seed=3)
    old = {"epoch": 1, "position": 2, "seed": 3, "dp_rank": 0, "dp_world": 2, "dataset_size": 24,
           "batch_size": 4, "drop_last": True}
    iterator.load_state_dict(old)
    assert iterator.cursor["streams"]["all"] == {"epoch": 1, "position": 8}
    assert "order is drawn anew" in caplog.text
