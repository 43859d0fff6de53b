"""Checkpoint save, resume, fallback, quarantine and pruning, on real files with toy models."""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import torch.distributed.checkpoint as ckpt_dcp

import trainer.checkpoint.store as ckpt
from trainer.checkpoint.store import (
    COMPLETE_FILE,
    CheckpointError,
    CheckpointIncompatibleError,
    CheckpointManager,
    ModelMember,
    OptimizerMember,
    QUARANTINE_REASON_FILE,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    validate_checkpoint,
)
from trainer.checkpoint.rng import capture_rng_state, restore_rng_state


class Run:
    """A toy training run: model, AdamW, and a step that draws from every RNG."""

    def __init__(self, seed: int, hidden: int = 8) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step = 0

    def members(self) -> dict:
        return {"transformer": ModelMember(self.model), "optimizer": OptimizerMember(self.model, self.optimizer)}

    def train_step(self) -> float:
        # Python, NumPy and torch randomness all feed the batch, so all three must be restored.
        scale = random.random() + float(np.random.rand())
        x = torch.randn(6, 4) * scale
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def save(self, output_dir: Path, **kwargs) -> Path:
        return save_checkpoint(
            output_dir,
            self.step,
            members=self.members(),
            training_state={"step": self.step, "rng": capture_rng_state()},
            dataloader_state={"cursor": self.step * 10},
            **kwargs,
        )

    def load(self, path: Path, **kwargs):
        self.training_state, self.cursor = load_checkpoint(path, self.members(), **kwargs)
        self.step = self.training_state["step"]


def save_steps(output_dir: Path, steps: list[int], seed: int = 0, **kwargs) -> Run:
    run = Run(seed)
    for step in steps:
        while run.step < step:
            run.train_step()
        run.save(output_dir, **kwargs)
    return run


def resume(output_dir: Path, seed: int = 99) -> tuple[Run, Path | None]:
    run = Run(seed)
    return run, find_resume_checkpoint(output_dir, run.load)


# ---- round trip ------------------------------------------------------------------------------


def test_resumed_training_is_bit_identical_to_uninterrupted(tmp_path):
    random.seed(1)
    np.random.seed(1)
    run = Run(seed=0)
    for _ in range(3):
        run.train_step()
    run.save(tmp_path)
    expected_losses = [run.train_step() for _ in range(4)]
    expected_params = [p.detach().clone() for p in run.model.parameters()]

    random.seed(7)  # the resumed process starts from unrelated generator states
    np.random.seed(7)
    resumed, found = resume(tmp_path)
    assert found == tmp_path / "checkpoint-3"
    assert resumed.step == 3 and resumed.cursor == {"cursor": 30}
    restore_rng_state(resumed.training_state["rng"])
    losses = [resumed.train_step() for _ in range(4)]

    assert losses == expected_losses
    for got, want in zip(resumed.model.parameters(), expected_params):
        assert torch.equal(got, want)


def test_save_publishes_marker_listing_every_file_with_its_size(tmp_path):
    save_steps(tmp_path, [2], config_digest="abc123", model_config={"hidden": 8})
    path = tmp_path / "checkpoint-2"
    info = json.loads((path / COMPLETE_FILE).read_text())
    assert info["step"] == 2 and info["members"] == ["transformer", "optimizer"]
    assert (info["world_size"], info["dp_world"], info["cp_size"]) == (1, 1, 1)
    assert info["config_digest"] == "abc123" and info["model_config"] == {"hidden": 8}
    on_disk = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    on_disk.pop(COMPLETE_FILE)
    assert info["files"] == on_disk
    assert {"transformer/.metadata", "optimizer/.metadata", "training_state.pt", "dataloader/0.json"} <= set(on_disk)
    assert not list(tmp_path.glob("*.tmp"))


def test_training_state_is_loadable_with_weights_only(tmp_path):
    save_steps(tmp_path, [1])
    payload = torch.load(tmp_path / "checkpoint-1" / "training_state.pt", weights_only=True)
    assert payload["state"]["step"] == 1
    assert set(payload["state"]["rng"]) >= {"python", "numpy", "torch_cpu", "cuda"}


def test_optimizer_param_groups_are_restored_not_only_its_tensors(tmp_path):
    saved = save_steps(tmp_path, [1])
    for group in saved.optimizer.param_groups:
        group["lr"] = 0.123
    saved.save(tmp_path / "b")
    fresh = Run(5)
    fresh.load(tmp_path / "b" / "checkpoint-1")
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [0.123]
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"],
                       saved.optimizer.state_dict()["state"][0]["exp_avg"])


def test_members_may_be_plain_state_dicts_and_dicts_of_optimizers(tmp_path):
    run = Run(0)
    run.train_step()
    ema = {k: v.detach().clone() + 1 for k, v in run.model.state_dict().items()}
    members = {"transformer": ModelMember(run.model), "ema": ema,
               "optimizer": {"transformer": OptimizerMember(run.model, run.optimizer)}}
    save_checkpoint(tmp_path, 1, members=members, training_state={"step": 1}, dataloader_state=None,
                    extra_files={"resolved-config.json": '{"lr": 1}'})
    assert (tmp_path / "checkpoint-1" / "resolved-config.json").read_text() == '{"lr": 1}'
    fresh = Run(7)
    fresh_ema = {k: torch.zeros_like(v) for k, v in ema.items()}
    load_checkpoint(tmp_path / "checkpoint-1", {"transformer": ModelMember(fresh.model), "ema": fresh_ema,
                    "optimizer": {"transformer": OptimizerMember(fresh.model, fresh.optimizer)}})
    assert all(torch.equal(fresh_ema[k], ema[k]) for k in ema)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1


def test_save_rejects_training_state_that_needs_pickle(tmp_path):
    run = Run(0)
    with pytest.raises(CheckpointError, match="weights_only"):
        save_checkpoint(
            tmp_path, 0, members=run.members(), training_state={"args": argparse.Namespace(lr=1)},
            dataloader_state={},
        )
    assert not any(tmp_path.iterdir())


def test_failed_save_leaves_no_partial_checkpoint_and_keeps_earlier_ones(tmp_path, monkeypatch):
    run = save_steps(tmp_path, [1])

    def broken_save(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt_dcp, "save", broken_save)
    run.train_step()
    with pytest.raises(CheckpointError, match="No space left"):
        run.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    validate_checkpoint(tmp_path / "checkpoint-1")


def test_saving_an_existing_complete_step_again_is_skipped(tmp_path):
    run = save_steps(tmp_path, [2])
    marker = tmp_path / "checkpoint-2" / COMPLETE_FILE
    before = marker.read_text()
    assert run.save(tmp_path) == tmp_path / "checkpoint-2"
    assert marker.read_text() == before


def test_save_replaces_stale_tmp_and_unmarked_directory_of_same_step(tmp_path):
    (tmp_path / "checkpoint-2.tmp").mkdir()
    (tmp_path / "checkpoint-2.tmp" / "junk").write_text("x")
    (tmp_path / "checkpoint-2").mkdir()  # e.g. a copy that never finished
    save_steps(tmp_path, [2])
    validate_checkpoint(tmp_path / "checkpoint-2")
    assert not (tmp_path / "checkpoint-2.tmp").exists()
    assert (tmp_path / "checkpoint-2.bad").is_dir()


# ---- resume: fallback and quarantine --------------------------------------------------------


def _truncate_shard(path: Path) -> None:
    shard = next((path / "transformer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])


def _same_size_garbage(file: Path) -> None:
    file.write_bytes(b"\x00garbage" * (file.stat().st_size // 8) + b"\x01" * (file.stat().st_size % 8))


def _garbage_metadata(path: Path) -> None:
    _same_size_garbage(path / "transformer" / ".metadata")


def _garbage_training_state(path: Path) -> None:
    _same_size_garbage(path / "training_state.pt")


def _empty_member_directory(path: Path) -> None:
    for file in (path / "transformer").iterdir():
        file.unlink()


def _garbage_marker(path: Path) -> None:
    (path / COMPLETE_FILE).write_text("{not json")


@pytest.mark.parametrize(
    "corrupt",
    [_truncate_shard, _garbage_metadata, _garbage_training_state, _empty_member_directory, _garbage_marker],
    ids=["truncated-shard", "garbage-metadata", "unreadable-training-state", "empty-member-dir", "garbage-marker"],
)
def test_resume_falls_back_to_previous_and_quarantines_corrupt_latest(tmp_path, corrupt, caplog):
    save_steps(tmp_path, [1, 2])
    corrupt(tmp_path / "checkpoint-2")
    with caplog.at_level(logging.WARNING):
        _, found = resume(tmp_path)
    assert found == tmp_path / "checkpoint-1"
    assert (tmp_path / "checkpoint-2.bad" / QUARANTINE_REASON_FILE).is_file()
    assert not (tmp_path / "checkpoint-2").exists()
    assert "quarantined checkpoint-2" in caplog.text


def test_resume_skips_directory_without_marker_and_leaves_it_alone(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "checkpoint-2" / COMPLETE_FILE).unlink()
    (tmp_path / "checkpoint-3").mkdir()  # empty directory
    with caplog.at_level(logging.WARNING):
        _, found = resume(tmp_path)
    assert found == tmp_path / "checkpoint-1"
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "checkpoint-3").is_dir()
    assert "checkpoint-3 has no COMPLETE marker" in caplog.text
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-1"]


def test_resume_raises_instead_of_starting_fresh_when_only_checkpoint_is_corrupt(tmp_path):
    save_steps(tmp_path, [1])
    _truncate_shard(tmp_path / "checkpoint-1")
    with pytest.raises(CheckpointError, match="Refusing to start fresh"):
        resume(tmp_path)
    # The next attempt (e.g. a requeued job) must not start fresh either.
    with pytest.raises(CheckpointError, match="checkpoint-1.bad"):
        resume(tmp_path)


def test_resume_starts_fresh_when_only_an_interrupted_first_save_exists(tmp_path, caplog):
    # No checkpoint was ever published, so nothing can be lost: a requeued job that died in
    # its first save starts over instead of waiting for a person.
    (tmp_path / "checkpoint-5.tmp").mkdir()
    assert resume(tmp_path)[1] is None
    assert not (tmp_path / "checkpoint-5.tmp").exists()
    assert "no checkpoint was ever published" in caplog.text


def test_resume_raises_when_unfinished_save_sits_beside_a_corrupt_checkpoint(tmp_path):
    (tmp_path / "checkpoint-5.tmp").mkdir()
    (tmp_path / "checkpoint-3.bad").mkdir()
    with pytest.raises(CheckpointError, match="Refusing to start fresh"):
        resume(tmp_path)


def test_resume_returns_none_for_a_new_output_dir(tmp_path):
    assert resume(tmp_path)[1] is None
    assert resume(tmp_path / "not-created-yet")[1] is None


def test_resume_removes_unfinished_saves_once_resumed(tmp_path):
    save_steps(tmp_path, [1])
    (tmp_path / "checkpoint-2.tmp").mkdir()
    assert resume(tmp_path)[1] == tmp_path / "checkpoint-1"
    assert not (tmp_path / "checkpoint-2.tmp").exists()


def test_resume_with_changed_model_shape_raises_without_quarantining(tmp_path):
    save_steps(tmp_path, [1])
    wider = Run(0, hidden=16)
    with pytest.raises(CheckpointIncompatibleError, match=r"0.weight: checkpoint \(8, 4\), run \(16, 4\)"):
        find_resume_checkpoint(tmp_path, wider.load)
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-1"]


def test_load_requires_every_declared_member(tmp_path):
    save_steps(tmp_path, [1])
    run = Run(0)
    members = {**run.members(), "ema": {k: v.clone() for k, v in run.model.state_dict().items()}}
    with pytest.raises(CheckpointIncompatibleError, match=r"no member\(s\) \['ema'\]"):
        load_checkpoint(tmp_path / "checkpoint-1", members)


# ---- topology ------------------------------------------------------------------------------


def test_another_topology_resumes_with_data_rank_0s_cursor(tmp_path):
    saved = save_steps(tmp_path, [1])
    run = Run(5)
    run.load(tmp_path / "checkpoint-1", dp_rank=1, dp_world=2, cp_size=2)
    assert run.step == 1 and run.cursor == {"cursor": 10}  # what data rank 0 saved
    for got, want in zip(run.model.parameters(), saved.model.parameters()):
        assert torch.equal(got, want)


def test_resume_data_state_false_bypasses_topology_check(tmp_path):
    saved = save_steps(tmp_path, [1])
    run = Run(5)
    run.load(tmp_path / "checkpoint-1", dp_rank=1, dp_world=2, resume_data_state=False)
    assert run.cursor is None and run.step == 1
    for got, want in zip(run.model.parameters(), saved.model.parameters()):
        assert torch.equal(got, want)


# ---- pruning -------------------------------------------------------------------------------


def test_save_total_limit_prunes_oldest_complete_only(tmp_path):
    (tmp_path / "checkpoint-1.tmp").mkdir(parents=True)
    (tmp_path / "checkpoint-0.bad").mkdir()
    save_steps(tmp_path, [2, 3, 4, 5], save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
    assert (tmp_path / "checkpoint-1.tmp").is_dir() and (tmp_path / "checkpoint-0.bad").is_dir()


def test_limit_one_keeps_the_newest_and_limit_zero_keeps_all(tmp_path):
    save_steps(tmp_path / "one", [1, 2, 3], save_total_limit=1)
    assert [p.name for p in list_checkpoints(tmp_path / "one")] == ["checkpoint-3"]
    save_steps(tmp_path / "all", [1, 2, 3], save_total_limit=0)
    assert len(list_checkpoints(tmp_path / "all")) == 3


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    save_steps(tmp_path, [5, 6])
    save_steps(tmp_path, [2])  # an older step written last (e.g. after a fallback)
    prune_checkpoints(tmp_path, 1, protect=tmp_path / "checkpoint-2")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-6"]


def test_failed_delete_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    real_rmtree = shutil.rmtree

    def refusing_rmtree(path, *args, **kwargs):
        if ".deleting" in str(path):
            raise PermissionError("read-only snapshot")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", refusing_rmtree)
    with caplog.at_level(logging.WARNING):
        run = save_steps(tmp_path, [1, 2, 3], save_total_limit=1)
    assert "could not delete" in caplog.text and "training goes on" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]
    run.train_step()  # still usable
    assert run.save(tmp_path).name == "checkpoint-4"


# ---- async ---------------------------------------------------------------------------------


def test_async_manager_keeps_at_most_one_save_in_flight(tmp_path, monkeypatch):
    real_save = ckpt_dcp.save
    lock = threading.Lock()
    saves_in_flight = {"now": 0, "max": 0}
    real_commit = ckpt._write_and_commit
    disk = threading.Event()  # a stalled filesystem: no write starts until the test allows it

    def slow_save(*args, **kwargs):
        assert disk.wait(timeout=60)
        time.sleep(0.15)  # then a slow one
        return real_save(*args, **kwargs)

    def counting_commit(job):
        with lock:
            saves_in_flight["now"] += 1
            saves_in_flight["max"] = max(saves_in_flight["max"], saves_in_flight["now"])
        try:
            return real_commit(job)
        finally:
            with lock:
                saves_in_flight["now"] -= 1

    monkeypatch.setattr(ckpt_dcp, "save", slow_save)
    monkeypatch.setattr(ckpt, "_write_and_commit", counting_commit)
    run = Run(0)
    with CheckpointManager(tmp_path, async_save=True, save_total_limit=2) as manager:
        for _ in range(3):
            run.train_step()
            manager.save(run.step, members=run.members(), training_state={"step": run.step},
                         dataloader_state={"cursor": run.step})
            assert manager.in_flight
            if not disk.is_set():
                # save() came back although no byte could be written yet: training waited for
                # the staging copy only (how long that takes: benchmarks/checkpoint.py).
                assert not (tmp_path / "checkpoint-1").exists()
                assert manager.timings[0].total_s is None
                disk.set()
        manager.wait()
        assert not manager.in_flight
    assert saves_in_flight["max"] == 1
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    for timing in manager.timings:
        assert timing.total_s is not None and timing.total_s >= 0.3  # two members, 0.15 s each


def test_async_save_writes_the_state_at_save_time_not_later(tmp_path):
    run = Run(0)
    run.train_step()
    expected = {k: v.clone() for k, v in run.model.state_dict().items()}
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, members=run.members(), training_state={"step": 1}, dataloader_state={})
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(100.0)  # training goes on while the save is written
        path = manager.wait()
    fresh = Run(3)
    fresh.load(path)
    assert fresh.step == 1
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected[key])


def test_async_saves_stay_in_the_background_with_a_stager_that_closes_itself(tmp_path, monkeypatch,
                                                                            caplog):
    # torch 2.11's DefaultStager closes its StateDictStager after every stage (2.13's does not),
    # which broke every later stage with KeyError: <class 'type'> and turned each save of an
    # H200 run synchronous. Recreated here on top of the installed torch.
    from torch.distributed.checkpoint.staging import DefaultStager

    real_stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        try:
            return real_stage(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    run = Run(0)
    expected = {}
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.store"), \
            CheckpointManager(tmp_path, async_save=True) as manager:
        for _ in range(3):
            run.train_step()
            expected[run.step] = {k: v.clone() for k, v in run.model.state_dict().items()}
            manager.save(run.step, members=run.members(), training_state={"step": run.step},
                         dataloader_state={"cursor": run.step})
            assert manager.in_flight
            with torch.no_grad():
                for p in run.model.parameters():
                    p.add_(100.0)  # training goes on while the save is written
    assert "could not stage" not in caplog.text
    for step, weights in expected.items():
        fresh = Run(3)
        fresh.load(tmp_path / f"checkpoint-{step}")
        assert fresh.step == step
        assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in weights.items())


def test_async_save_failure_is_raised_by_wait(tmp_path, monkeypatch):
    def broken_save(*args, **kwargs):
        raise OSError("disk quota exceeded")

    monkeypatch.setattr(ckpt_dcp, "save", broken_save)
    run = Run(0)
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(0, members=run.members(), training_state={}, dataloader_state={})
    with pytest.raises(CheckpointError, match="disk quota exceeded"):
        manager.wait()
    manager.close()
    assert not list(tmp_path.iterdir())
