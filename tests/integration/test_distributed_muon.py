"""Muon over FSDP2-sharded weights gives the unsharded update, with the Newton-Schulz work
spread over the shard group (real gloo processes under torchrun, tests/muon_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fixtures.ports import free_port
from test_distributed_fsdp import REPO, _pythonpath

@pytest.mark.parametrize("ranks, replicas", [(2, 1), (4, 2)])
def test_sharded_muon_matches_unsharded_and_splits_the_matrices(tmp_path, ranks, replicas):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
         str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(REPO / "tests" / "muon_worker.py"), str(tmp_path), str(replicas)],
        env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(ranks)]
    for r in results:
        assert r["max_abs_diff"] < 1e-6, results
    # 4 matrices x 3 steps = 12 orthogonalisations; a shard group of S ranks shares them.
    shard_group = ranks // replicas
    assert all(r["reference_ns_calls"] == 12 for r in results)
    per_group = [sum(r["sharded_ns_calls"] for r in results[g * shard_group:(g + 1) * shard_group])
                 for g in range(replicas)]
    assert per_group == [12] * replicas
    assert max(r["sharded_ns_calls"] for r in results) == 12 // shard_group
