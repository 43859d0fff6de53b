"""Resuming the data: a saved position another split cannot reach is refused with the
arithmetic, and a dataset that changed since the save is told apart from the same one."""

import json
import logging
import shutil

import pytest

from trainer.data import DistributedBatchIterator, ParquetLatentDataset
from trainer.data.resume import data_identity, identity_changes, position_problem
from trainer.data.synthetic import generate_dataset


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    # 24 samples in 3 shards of 8.
    return generate_dataset(tmp_path_factory.mktemp("shapes"), 24, seed=5, samples_per_shard=8,
                            text_dim=16, max_text_tokens=8)


def cursor(position: int, *, dp_world: int = 1, batch_size: int = 16, size: int = 4096,
           length: int = 4096, token_budget=None) -> dict:
    return {"seed": 0, "dp_rank": 0, "dp_world": dp_world, "batch_size": batch_size,
            "drop_last": True, "token_budget": token_budget, "dataset_size": size,
            "stream_sizes": {"all": size}, "epoch_lengths": {"all": length},
            "cursor": {"batch": position // batch_size,
                       "streams": {"all": {"epoch": 0, "position": position}}}}


def test_a_position_that_is_not_a_whole_number_of_the_new_steps_is_refused_with_the_arithmetic():
    # Saved on 1 rank at sample 48 (3 steps of 16); resumed on 2 ranks of 16: global batch 32.
    problem = position_problem(cursor(48), dp_world=2, batch_size=16, grad_accum=1,
                               token_budget=None, checkpoint="checkpoint-3")
    assert problem.startswith("checkpoint-3 was saved at sample 48 of epoch 0; with global batch "
                              "32 (train_batch_size 16 x gradient_accumulation_steps 1 x dp 2)")
    assert "48/32 = 1.5 steps" in problem
    assert ("divides 48 and cuts each epoch of 4096 samples to 4096, e.g. the saved run's 16 "
            "or 8") in problem
    # Global batch 10 (5 x 2): 48/10.
    assert "48/10 = 4.8 steps" in position_problem(cursor(48), dp_world=2, batch_size=5,
                                                   grad_accum=1, token_budget=None,
                                                   checkpoint="checkpoint-3")


def test_a_reachable_position_with_the_same_epoch_resumes_and_another_epoch_cut_is_refused():
    for dp, batch, accum in ((2, 8, 1), (4, 4, 1), (1, 8, 2), (2, 4, 2)):
        assert position_problem(cursor(48), dp_world=dp, batch_size=batch, grad_accum=accum,
                                token_budget=None, checkpoint="c") is None
    # 4096 samples cut to whole steps of 16 is 4096; of 48 it would be 4080.
    problem = position_problem(cursor(48), dp_world=1, batch_size=48, grad_accum=1,
                               token_budget=None, checkpoint="checkpoint-3")
    assert "each epoch of 4096 samples to 4096" in problem and "would hold 4080" in problem
    assert "cuts 4096 samples to 4096 and divides 48 (the saved position), e.g. the saved " \
           "run's 16 or 8" in problem


def _offered(problem: str) -> list[int]:
    """The global batches a refusal suggests ("e.g. the saved run's 32 or 16")."""
    return [int(word) for word in problem.split(", e.g. ")[1].replace("the saved run's ", "")
            .split(" or ")]


def test_every_global_batch_a_refusal_suggests_passes_both_rules():
    # Saved at global batch 32 at sample 96 of an epoch of 1000 samples (cut to 992).
    saved = cursor(96, batch_size=32, size=1000, length=992)
    # Resumed at 48 the position is 2 steps but the epoch would hold 960; 62 divides 992 but
    # not 96, so it is not offered.
    problem = position_problem(saved, dp_world=1, batch_size=48, grad_accum=1,
                               token_budget=None, checkpoint="checkpoint-3")
    assert "an epoch would hold 960" in problem and _offered(problem) == [32, 16]
    # Resumed at 64, 96/64 = 1.5; 48 divides 96 but cuts the epoch to 960, so it is not offered.
    problem = position_problem(saved, dp_world=1, batch_size=64, grad_accum=1,
                               token_budget=None, checkpoint="checkpoint-3")
    assert "96/64 = 1.5 steps" in problem and _offered(problem) == [32, 16]
    # Two streams: the image stream refuses 12, and 16 would keep the image rules but start
    # the video stream mid-step (40/16); 4 would cut its epoch of 1004 to 1004, not 1000.
    two = {**cursor(48, batch_size=8), "stream_sizes": {"image": 4096, "video": 1004},
           "epoch_lengths": {"image": 4096, "video": 1000},
           "cursor": {"batch": 6, "streams": {"image": {"epoch": 0, "position": 48},
                                              "video": {"epoch": 0, "position": 40}}}}
    problem = position_problem(two, dp_world=1, batch_size=12, grad_accum=1, token_budget=None,
                               checkpoint="checkpoint-6")
    assert "would hold 4092" in problem and _offered(problem) == [8]
    for state, batch in ((saved, 48), (saved, 64), (saved, 31), (two, 12), (two, 16),
                         (cursor(48), 32), (cursor(48), 48), (cursor(48), 5)):
        problem = position_problem(state, dp_world=1, batch_size=batch, grad_accum=1,
                                   token_budget=None, checkpoint="c")
        for offered in _offered(problem):
            assert position_problem(state, dp_world=1, batch_size=offered, grad_accum=1,
                                    token_budget=None, checkpoint="c") is None, (batch, offered)


def test_packs_continue_only_on_the_same_number_of_ranks():
    packed = cursor(48, token_budget=500)
    assert position_problem(packed, dp_world=1, batch_size=16, grad_accum=1, token_budget=500,
                            checkpoint="c") is None
    assert "saved on 1 data-parallel rank(s) with packing" in position_problem(
        packed, dp_world=2, batch_size=16, grad_accum=1, token_budget=500, checkpoint="c")
    assert "packing_token_budget 500, this run has 600" in position_problem(
        packed, dp_world=1, batch_size=16, grad_accum=1, token_budget=600, checkpoint="c")


def test_the_loader_refuses_an_unreachable_position_with_the_same_arithmetic(shapes_dir):
    dataset = ParquetLatentDataset(str(shapes_dir))
    one = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=1, seed=0)
    for _ in range(3):
        one.next_batch()  # sample 12
    state = json.loads(json.dumps(one.state_dict()))
    two = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=2, seed=0)
    with pytest.raises(ValueError, match=r"12/8 = 1.5 steps"):
        two.load_state_dict(state)


def test_the_identity_tells_rewritten_added_and_removed_shards_from_moved_ones(shapes_dir,
                                                                               tmp_path):
    saved = data_identity(str(shapes_dir))
    assert len(saved["shards"]) == 3 and saved["shards"][0]["path"] == "shard-00000.parquet"
    moved = tmp_path / "moved"
    shutil.copytree(shapes_dir, moved)
    assert data_identity(str(moved))["digest"] == saved["digest"]
    assert identity_changes(saved, data_identity(str(moved))) == []
    # Other rows of the same count in one shard.
    other = generate_dataset(tmp_path / "other", 24, seed=6, samples_per_shard=8, text_dim=16,
                             max_text_tokens=8)
    shutil.copy(other / "shard-00001.parquet", moved / "shard-00001.parquet")
    changes = identity_changes(saved, data_identity(str(moved)))
    assert changes == ["shard-00001.parquet holds other rows (same size, another parquet footer)"] \
        or changes[0].startswith("shard-00001.parquet changed size")
    (moved / "shard-00002.parquet").unlink()
    shutil.copy(other / "shard-00000.parquet", moved / "extra.parquet")
    changes = identity_changes(saved, data_identity(str(moved)))
    assert "extra.parquet is new" in changes[0] and "shard-00002.parquet is gone" in changes[-1]
    repeated = data_identity({str(shapes_dir): 2})
    assert identity_changes(saved, repeated) == [
        f"shard-0000{i}.parquet is repeated 2 times, was 1" for i in range(3)]


def test_a_cursor_continues_on_changed_data_when_allowed_and_logs_where(shapes_dir, tmp_path,
                                                                        caplog):
    dataset = ParquetLatentDataset(str(shapes_dir))
    saved_on = DistributedBatchIterator(dataset, batch_size=4, dp_rank=0, dp_world=1, seed=3)
    for _ in range(2):
        saved_on.next_batch()
    state = json.loads(json.dumps(saved_on.state_dict()))
    smaller = tmp_path / "smaller"
    shutil.copytree(shapes_dir, smaller)
    (smaller / "shard-00002.parquet").unlink()  # 16 samples now
    resumed = DistributedBatchIterator(ParquetLatentDataset(str(smaller)), batch_size=4,
                                       dp_rank=0, dp_world=1, seed=3)
    with pytest.raises(ValueError, match="dataset_size"):
        resumed.load_state_dict(state)  # not allowed: the sizes differ
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict({**state, "data_changed": True})
    assert resumed.cursor["streams"]["all"] == {"epoch": 0, "position": 8}
    assert "continues in epoch 0 at sample 8 of the new data's order (16 samples an epoch, " \
           "was 24" in caplog.text
    assert len(resumed.next_batch()["ids"]) == 4


# ---- train.py: refused before the model is built, in one paragraph ------------------------------

def _copy_checkpoint(tiny_trainer, tmp_path, step: int = 2):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(tiny_trainer.reference() / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out


def _refusal(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "resumed from" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "cannot resume" in line
             or "data changed" in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_train_refuses_a_resume_whose_position_the_new_global_batch_cannot_reach(tiny_trainer,
                                                                                tmp_path):
    # checkpoint-2 of the reference (batch 4, 1 rank) is at sample 8; batch 16 would start
    # its next step at 8/16 and train a short step at the epoch's end.
    out = _copy_checkpoint(tiny_trainer, tmp_path)
    line = _refusal(tiny_trainer.run(out, "--train_batch_size", "16"))
    assert "checkpoint-2 was saved at sample 8 of epoch 0; with global batch 16" in line
    assert "8/16 = 0.5 steps" in line and "resume_data_state: false" in line
    assert not (out / "checkpoint-2.bad").exists() and not (out / "metrics.jsonl").exists()


def test_train_resumes_at_the_global_batch_its_refusal_suggests(tiny_trainer, tmp_path):
    # checkpoint-6 of the reference (batch 4, 1 rank, 64 samples an epoch) is at sample 24:
    # batch 16 is refused, and of the batches that divide 24, 12 and 24 would cut the epoch
    # to 60 and 48 samples; 8 keeps it at 64 and resumes.
    out = _copy_checkpoint(tiny_trainer, tmp_path, step=6)
    line = _refusal(tiny_trainer.run(out, "--train_batch_size", "16"))
    assert "24/16 = 1.5 steps" in line and "e.g. the saved run's 4 or 8," in line
    proc = tiny_trainer.run(out, "--train_batch_size", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and (out / "checkpoint-12").is_dir()


def test_train_refuses_changed_data_unless_allowed_and_then_says_where_it_continues(
        tiny_trainer, tmp_path):
    reference = tiny_trainer.reference()
    assert (reference / "checkpoint-2" / "data-identity.json").is_file()
    out = _copy_checkpoint(tiny_trainer, tmp_path)
    data = tmp_path / "data"
    shutil.copytree(tiny_trainer.data_path, data)
    shard = sorted(data.rglob("*.parquet"))[0]
    count = len(__import__("pyarrow.parquet").parquet.read_table(shard, columns=["id"]))
    other = generate_dataset(tmp_path / "other", count, seed=123, num_frames=8, height=16,
                             width=16, samples_per_shard=count, text_dim=32, max_text_tokens=8)
    shutil.copy(sorted(other.rglob("*.parquet"))[0], shard)  # other rows, the same count
    common = ("--data_path", str(data), "--synthetic_data", "false", "--max_steps", "3")
    line = _refusal(tiny_trainer.run(out, *common))
    assert f"the data changed since checkpoint-2 was saved: {shard.relative_to(data)}" in line
    assert "allow_data_change: true" in line
    proc = tiny_trainer.run(out, *common, "--allow_data_change", "true")
    assert proc.returncode == 0, proc.stderr
    assert "continuing on it (allow_data_change: true)" in proc.stderr
    assert "continues in epoch 0 at sample 8 of the new data's order" in proc.stderr
    assert "resumed from" in proc.stderr and (out / "checkpoint-3").is_dir()
