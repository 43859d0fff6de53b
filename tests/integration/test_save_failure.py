"""A save that fails on one rank fails on every rank, with the same error, and leaves no trace.

Two real processes under torchrun (gloo); rank 1 alone cannot write large files
(save_failure_worker.py). If only rank 1 raised, rank 0 would train on (or wait in the next
collective forever) believing it had a checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.ports import free_port

from trainer.checkpoint.layout import list_checkpoints, validate_checkpoint

WORKER = Path(__file__).resolve().parent / "save_failure_worker.py"


def test_a_save_failing_on_rank_1_raises_the_same_error_on_both_ranks_and_publishes_nothing(
        tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                             "2", "--master_port", str(free_port()), str(WORKER), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # A rank left alone in a collective: torchrun stops its workers on SIGTERM (a SIGKILL
        # would orphan them, each in its own session).
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the ranks hung after the failed save:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    errors = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]

    assert errors[0] == errors[1]  # every rank raised, and raised the same error
    seen = errors[0]
    assert seen["1"] is None and seen["5"] is None
    for step in ("2", "3"):  # the model shard, sync and async: DCP's own collective
        assert f"checkpoint-{step} was not saved (could not write member 'transformer')" in \
            seen[step]
        assert "rank 1:" in seen[step]
    # The cursor is written by rank 1 alone, outside any DCP collective: only rank 1 failed.
    assert seen["4"].startswith("checkpoint-4 was not saved (could not write training state "
                                "and data cursors): rank 1: OSError")
    assert "rank 0:" not in seen["4"] and "File too large" in seen["4"]

    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-5"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == \
        ["checkpoint-1", "checkpoint-5"]  # no .tmp left behind
    for path in list_checkpoints(tmp_path):
        validate_checkpoint(path)
