"""Checksums in COMPLETE: taken while saving, checked while loading, bit rot quarantined.

Real saves and loads of toy models on real files. Each corruption keeps the file's size, so
only the checksum can notice it. The loader reads tensors in place; `threaded` runs the same
tests with every write and read hashed on a second thread (the path of hosts with more than
two cores), in 4 KiB pieces.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import xxhash

import trainer.checkpoint.checksums as checksums
import trainer.checkpoint.dcp_files as dcp_files
from trainer.checkpoint.store import (
    COMPLETE_FILE,
    QUARANTINE_REASON_FILE,
    CheckpointError,
    find_resume_checkpoint,
    load_checkpoint,
    ModelMember,
    OptimizerMember,
    save_checkpoint,
)
from trainer.checkpoint.dcp_io import DCPError, load_dcp_in_place, read_dcp_state_dict, save_dcp


@pytest.fixture(params=["inline", "threaded"])
def io_path(request, monkeypatch):
    if request.param == "threaded":
        monkeypatch.setattr(checksums, "PIECE", 4096)
        monkeypatch.setattr(checksums, "OVERLAP_MIN_BYTES", 0)
        monkeypatch.setattr(checksums, "HASH_BESIDE", True)
    return request.param


class Run:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self) -> None:
        loss = self.model(torch.randn(5, 64)).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def members(self) -> dict:
        return {"transformer": ModelMember(self.model),
                "optimizer": OptimizerMember(self.model, self.optimizer)}

    def save(self, out: Path, step: int) -> Path:
        return save_checkpoint(out, step, members=self.members(), training_state={"step": step},
                               dataloader_state={"pos": step})

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _two_checkpoints(out: Path) -> tuple[dict, dict]:
    run = Run(0)
    run.step()
    run.save(out, 1)
    first = run.weights()
    run.step()
    run.save(out, 2)
    return first, run.weights()


def _flip_8_bytes_in_the_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    file.write_bytes(bytes(data))


def _resume(out: Path) -> tuple[Run, Path | None]:
    run = Run(99)

    def load(path: Path) -> None:
        run.state, run.cursor = load_checkpoint(path, run.members())

    return run, find_resume_checkpoint(out, load)


def test_complete_records_every_file_with_the_xxh3_of_its_bytes(tmp_path, io_path):
    path = Run(0).save(tmp_path, 3)
    info = json.loads((path / COMPLETE_FILE).read_text())
    assert info["checksum"] == "xxh3_64"
    assert set(info["checksums"]) == set(info["files"])
    for rel, digest in info["checksums"].items():
        assert digest == xxhash.xxh3_64((path / rel).read_bytes()).hexdigest(), rel
    # The save turns torch.save's own CRC32 off only while it writes shards.
    assert torch.serialization.get_crc32_options() is True


def test_every_file_holds_all_its_bytes_when_its_writer_fsyncs_it(tmp_path, io_path, monkeypatch):
    # Rank 0 does not sync the other ranks' files again before COMPLETE (on a network
    # filesystem that would flush nothing of theirs): each writer's own fsync must cover every
    # byte its file ends up with. DCP's .metadata, pickled into a buffered stream, once did not.
    import os

    size_at_fsync: dict[str, int] = {}
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        size_at_fsync[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_size
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = Run(0).save(tmp_path, 3).resolve()
    files = json.loads((path / COMPLETE_FILE).read_text())["files"]
    written = {name.replace(f"{path}.tmp", str(path)).removesuffix(".tmp"): size
               for name, size in size_at_fsync.items()}  # the names they were published under
    assert {"transformer/.metadata", "training_state.pt"} <= set(files)
    for rel, size in files.items():
        assert written.get(str(path / rel)) == size, rel


@pytest.mark.parametrize("beside", [False, True], ids=["inline", "on_a_second_thread"])
@pytest.mark.parametrize("writeback", [dcp_files.WRITEBACK_BYTES, 4096 + 17],
                         ids=["writeback_default", "writeback_every_few_kb"])
def test_a_shard_of_tensors_larger_than_the_overlap_threshold_records_its_xxh3(
        tmp_path, monkeypatch, beside, writeback):
    # Where cores are free, writes this large are hashed on a second thread while written;
    # every `writeback` bytes the kernel is told to start writing them out (a flush of the
    # buffered file, then a hint): neither may change a byte of the shard.
    monkeypatch.setattr(checksums, "HASH_BESIDE", beside)
    monkeypatch.setattr(dcp_files, "WRITEBACK_BYTES", writeback)
    big = torch.randn(checksums.OVERLAP_MIN_BYTES // 4 + 12345)
    state = {"big": big, "small": torch.arange(10)}
    digests = save_dcp(state, tmp_path / "m")
    shard = tmp_path / "m" / "__0_0.distcp"
    assert digests["__0_0.distcp"] == xxhash.xxh3_64(shard.read_bytes()).hexdigest()
    loaded = {"big": torch.zeros_like(big), "small": torch.zeros(10, dtype=torch.long)}
    load_dcp_in_place(loaded, tmp_path / "m", checksums=digests)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], state["small"])


@pytest.mark.parametrize("victim", ["transformer/__0_0.distcp", "optimizer/__0_0.distcp",
                                    "transformer/.metadata", "training_state.pt",
                                    "dataloader/0.json"])
def test_resume_quarantines_a_checkpoint_with_8_flipped_bytes_and_takes_the_previous_one(
        tmp_path, victim, io_path):
    first, _ = _two_checkpoints(tmp_path)
    file = tmp_path / "checkpoint-2" / victim
    size = file.stat().st_size
    if victim == "dataloader/0.json":
        file.write_text(file.read_text().replace("2", "7"))  # still valid JSON, another cursor
    else:
        _flip_8_bytes_in_the_middle(file)
    assert file.stat().st_size == size
    run, found = _resume(tmp_path)
    assert found == tmp_path / "checkpoint-1"
    assert run.cursor == {"pos": 1}
    for key, value in run.weights().items():
        assert torch.equal(value, first[key]), key
    reason = (tmp_path / "checkpoint-2.bad" / QUARANTINE_REASON_FILE).read_text()
    assert "checksum mismatch" in reason and victim.split("/")[-1] in reason


def test_an_intact_checkpoint_loads_the_exact_weights(tmp_path, io_path):
    _, second = _two_checkpoints(tmp_path)
    run, found = _resume(tmp_path)
    assert found == tmp_path / "checkpoint-2"
    for key, value in run.weights().items():
        assert torch.equal(value, second[key]), key


def test_a_checkpoint_saved_without_checksums_still_loads_with_a_note(tmp_path, caplog):
    _, second = _two_checkpoints(tmp_path)
    marker = tmp_path / "checkpoint-2" / COMPLETE_FILE
    info = json.loads(marker.read_text())
    del info["checksum"], info["checksums"]
    marker.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        run, found = _resume(tmp_path)
    assert found == tmp_path / "checkpoint-2"
    assert "checkpoint-2 records no checksums" in caplog.text
    assert all(torch.equal(v, second[k]) for k, v in run.weights().items())


def test_a_shard_read_only_in_part_is_hashed_from_disk(tmp_path):
    # A run that loads some tensors of a file cannot hash it on the way; it is checked anyway.
    run = Run(0)
    run.save(tmp_path, 1)
    shard = tmp_path / "checkpoint-1" / "transformer" / "__0_0.distcp"
    _flip_8_bytes_in_the_middle(shard)
    partial = {"0.weight": torch.empty(96, 64)}
    with pytest.raises(CheckpointError, match="__0_0.distcp: checksum mismatch"):
        load_checkpoint(tmp_path / "checkpoint-1", {"transformer": partial})


def test_in_place_reads_fill_every_dtype_and_strided_destination_exactly(tmp_path, monkeypatch):
    torch.manual_seed(0)
    saved = {"f32": torch.randn(300, 70), "bf16": torch.randn(64, 33).to(torch.bfloat16),
             "i64": torch.randint(-2**40, 2**40, (1000,)), "flag": torch.rand(77) > 0.5,
             "scalar": torch.tensor(3.5), "nested": {"h": torch.randn(5, 6).half()}}
    digests = save_dcp(saved, tmp_path / "m")
    fresh = {"f32": torch.zeros(70, 300).t(),  # not contiguous: read via the host buffer
             "bf16": torch.zeros(64, 33, dtype=torch.bfloat16),
             "i64": torch.zeros(1000, dtype=torch.int64), "flag": torch.zeros(77, dtype=torch.bool),
             "scalar": torch.tensor(0.0), "nested": {"h": torch.zeros(5, 6).half()}}
    load_dcp_in_place(fresh, tmp_path / "m", checksums=digests)
    for key in ("f32", "bf16", "i64", "flag", "scalar"):
        assert torch.equal(fresh[key], saved[key]), key
    assert torch.equal(fresh["nested"]["h"], saved["nested"]["h"])
    assert all(torch.equal(read_dcp_state_dict(tmp_path / "m")[k], saved[k])
               for k in ("f32", "bf16", "i64"))
    # The bytes read in place were hashed: a wrong record is noticed.
    wrong = {**digests, "__0_0.distcp": "0" * 16}
    with pytest.raises(DCPError, match="__0_0.distcp: checksum mismatch"):
        load_dcp_in_place(fresh, tmp_path / "m", checksums=wrong)


@pytest.mark.parametrize("beside", [False, True], ids=["hash_inline", "hash_on_a_second_thread"])
def test_strided_destinations_fill_exactly_through_the_two_staging_buffers(
        tmp_path, monkeypatch, beside):
    # Tensors that cannot be read in place go through two host buffers in turn (on a GPU the
    # copy out of one overlaps the read into the other); sizes that grow and shrink make the
    # buffers grow and serve smaller tensors afterwards. A buffer is overwritten only once
    # the hashing thread is done with it.
    monkeypatch.setattr(checksums, "HASH_BESIDE", beside)
    torch.manual_seed(0)
    shapes = [(40, 30), (300, 70), (8, 9), (500, 64), (20, 20)]
    saved = {f"t{i}": torch.randn(shape) for i, shape in enumerate(shapes)}
    digests = save_dcp(saved, tmp_path / "m")
    fresh = {key: torch.zeros(value.shape[::-1]).t() for key, value in saved.items()}
    assert not any(value.is_contiguous() for value in fresh.values())
    load_dcp_in_place(fresh, tmp_path / "m", checksums=digests)
    for key, value in saved.items():
        assert torch.equal(fresh[key], value), key
    _flip_8_bytes_in_the_middle(tmp_path / "m" / "__0_0.distcp")
    with pytest.raises(DCPError, match="__0_0.distcp: checksum mismatch"):
        load_dcp_in_place(fresh, tmp_path / "m", checksums=digests)


def test_a_staging_buffer_waits_for_a_slow_hashing_thread_before_it_is_reused(tmp_path, monkeypatch):
    # The hash of one staged tensor runs while the next is read into the other buffer, so a
    # slow hash must hold back the read after that one: overwriting a buffer still being
    # hashed would corrupt the digest and fail an intact checkpoint. Each read goes to the
    # hashing thread in parts (here 4 KB: three per tensor), in place or staged.
    monkeypatch.setattr(checksums, "HASH_BESIDE", True)
    monkeypatch.setattr(dcp_files, "_HASH_PART", 4096)
    real_hasher = checksums.new_hasher

    class SlowHasher:
        def __init__(self) -> None:
            self._hasher = real_hasher()

        def update(self, piece) -> None:
            time.sleep(0.02)
            self._hasher.update(piece)

        def hexdigest(self) -> str:
            return self._hasher.hexdigest()

    torch.manual_seed(0)
    saved = {f"t{i}": torch.randn(64, 48) for i in range(8)}  # one size: the buffers are reused
    digests = save_dcp(saved, tmp_path / "m")
    monkeypatch.setattr(checksums, "new_hasher", SlowHasher)
    staged = {key: torch.zeros(value.shape[::-1]).t() for key, value in saved.items()}
    in_place = {key: torch.zeros(value.shape) for key, value in saved.items()}
    for fresh in (staged, in_place):
        load_dcp_in_place(fresh, tmp_path / "m", checksums=digests)
        for key, value in saved.items():
            assert torch.equal(fresh[key], value), key


def test_a_warm_start_or_export_from_a_checkpoint_with_flipped_bytes_fails_naming_the_file(
        tmp_path, io_path):
    from trainer.checkpoint.warm_start import load_warm_start, read_weights, resolve_weights_source

    run = Run(0)
    path = run.save(tmp_path, 1)
    source = resolve_weights_source(path, weights="live")
    assert all(torch.equal(v, run.weights()[k]) for k, v in read_weights(source).items())
    _flip_8_bytes_in_the_middle(path / "transformer" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp: checksum mismatch"):
        read_weights(resolve_weights_source(path, weights="live"))
    with pytest.raises(CheckpointError, match="__0_0.distcp: checksum mismatch"):
        load_warm_start(path, Run(5).model, weights="live")
    assert not (tmp_path / "checkpoint-1.bad").exists()  # someone else's: reported, kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_the_gpu_resumes_exactly_and_its_bit_rot_is_caught(tmp_path, io_path):
    # GPU destinations are filled through the reused host buffer, then copied to the device.
    def on_gpu(seed: int) -> Run:
        run = Run(seed)
        run.model.cuda()
        run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-2)
        run.model(torch.randn(5, 64, device="cuda")).square().mean().backward()
        run.optimizer.step()
        return run

    run = on_gpu(0)
    run.save(tmp_path, 1)
    saved = run.weights()
    fresh = on_gpu(7)
    load_checkpoint(tmp_path / "checkpoint-1", fresh.members())
    for key, value in fresh.weights().items():
        assert value.is_cuda and torch.equal(value, saved[key]), key
    _flip_8_bytes_in_the_middle(tmp_path / "checkpoint-1" / "optimizer" / "__0_0.distcp")
    with pytest.raises(DCPError, match="__0_0.distcp: checksum mismatch"):
        load_checkpoint(tmp_path / "checkpoint-1", fresh.members())
