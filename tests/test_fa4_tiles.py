"""benchmarks/fa4_tiles.py away from a Hopper GPU: one sentence, no traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="on a Hopper GPU the benchmark runs")
def test_away_from_a_hopper_gpu_it_says_where_to_run():
    proc = subprocess.run([sys.executable, "benchmarks/fa4_tiles.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "run it on an H100 or H200" in proc.stderr and "Traceback" not in proc.stderr
