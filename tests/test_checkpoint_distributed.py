"""Two real processes under torchrun (gloo): sharded save, agreed fallback, bit-identical resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from fixtures.ports import free_port

from trainer.checkpoint.store import ModelMember, load_checkpoint

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"


def torchrun(phase: str, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(WORKER), phase, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout}\n{proc.stderr}"
    return [json.loads((out / f"result-{phase}-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    saved = torchrun("save", out)
    # Same-size garbage in rank 1's shard: passes the size check, fails inside DCP on rank 1.
    shard = out / "checkpoint-6" / "transformer" / "__1_0.distcp"
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    resumed = torchrun("resume", out)
    return out, saved, resumed


def test_each_data_parallel_rank_writes_its_own_cursor(two_rank_run):
    out, _, _ = two_rank_run
    for rank in (0, 1):
        assert json.loads((out / "checkpoint-2" / "dataloader" / f"{rank}.json").read_text()) == {
            "rank": rank, "pos": 20 + rank}
    assert {p.name for p in (out / "checkpoint-2" / "transformer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}


def test_failure_on_one_rank_makes_all_ranks_fall_back_together(two_rank_run):
    out, _, resumed = two_rank_run
    assert [r["path"] for r in resumed] == [str(out / "checkpoint-2")] * 2
    assert not (out / "checkpoint-6").exists() and not (out / "checkpoint-4").exists()
    reason_6 = (out / "checkpoint-6.bad" / "QUARANTINE_REASON").read_text()
    reason_4 = (out / "checkpoint-4.bad" / "QUARANTINE_REASON").read_text()
    assert "__1_0.distcp" in reason_6 or "rank 1" in reason_6
    assert "rank 1: ValueError: simulated: rank 1 cannot apply its data cursor" in reason_4


def test_resumed_ranks_repeat_the_uninterrupted_run_bit_for_bit(two_rank_run):
    _, saved, resumed = two_rank_run
    for rank in (0, 1):
        assert resumed[rank]["step"] == 2
        assert resumed[rank]["cursor"] == {"rank": rank, "pos": 20 + rank}
        assert resumed[rank]["losses"] == saved[rank]["reference_losses"]
        assert resumed[rank]["weights"] == saved[rank]["reference_weights"]


def test_preemption_flag_on_one_rank_stops_every_rank(two_rank_run):
    _, saved, _ = two_rank_run
    assert [r["preemption_agreed"] for r in saved] == [True, True]


def test_other_dp_world_resumes_with_data_rank_0s_cursor(two_rank_run):
    out, saved, _ = two_rank_run
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    # Model weights reshard from two FSDP shards into one plain module.
    _, cursor = load_checkpoint(out / "checkpoint-2", {"transformer": ModelMember(model)}, dp_world=1)
    assert cursor == {"rank": 0, "pos": 20}
    for key, value in model.state_dict().items():
        assert torch.equal(value, torch.tensor(saved[0]["weights_at_2"][key]))


def test_sharded_model_warm_starts_from_dcp_member_and_plain_file(two_rank_run):
    _, saved, resumed = two_rank_run
    for rank in (0, 1):
        assert resumed[rank]["warm_start_from_checkpoint-2"] == saved[0]["weights_at_2"]
        assert resumed[rank]["warm_start_from_plain.pt"] == saved[0]["weights_at_2"]
