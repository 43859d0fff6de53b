"""Real ranks (gloo, several processes) read disjoint shares that cover the epoch; a cp group reads one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fastvideo_t2v import write_fastvideo_dataset
from fixtures.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world, cp", [(2, 1), (4, 2)])
def test_ranks_read_each_sample_once_per_epoch_and_a_cp_group_reads_the_same(tmp_path, world, cp):
    data = write_fastvideo_dataset(tmp_path / "data", 30)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
         "--master_port", str(free_port()), str(ROOT / "tests" / "data_rank_worker.py"),
         str(data), str(out), str(cp)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    by_dp = {}
    for rank in ranks:
        by_dp.setdefault(rank["dp_rank"], []).append(rank["seen"])
    assert sorted(by_dp) == list(range(world // cp))
    for shares in by_dp.values():
        assert all(share == shares[0] for share in shares)   # every cp rank of a group alike
    # ... because it got them from the group's one reader, cp rank 0
    assert [rank["reads"] for rank in ranks] == [r % cp == 0 for r in range(world)]
    firsts = [shares[0] for shares in by_dp.values()]
    everything = [i for share in firsts for i in share]
    # 30 samples over 2 dp ranks: nothing is cut, so each sample exactly once.
    assert sorted(everything) == list(range(30))
