"""compile_transformer: training compiles its blocks, and the kernel warm-up fills the very cache
entries that training then loads.

Real torch.compile (Inductor's C++ backend on this CPU), real cache directories, two processes as
on a cluster: `python -m trainer.warmup` first, then `trainer/train.py` with the same cache
environment. AOTAutograd's own log says whether each compiled graph was a cache hit: every one
must be, and none a miss, or the warm-up warmed nothing that training uses. ~1.5 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
# The logger that reports AOTAutograd cache hits and misses at INFO (torch pinned in setup).
CACHE_LOGGER = "torch._functorch._aot_autograd.autograd_cache"


def _cache_files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_training_loads_the_compiled_graphs_the_warm_up_left_in_the_cache(tmp_path):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor's CPU backend needs a C++ compiler, and none is on PATH")
    caches = {"TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor",
              "TRITON_CACHE_DIR": tmp_path / "triton"}
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}, "OMP_NUM_THREADS": "1",
           "TORCH_LOGS": CACHE_LOGGER}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    args = ["--config", "config/tiny/pretrain.yaml", "--transformer_config_overrides", TINY_MODEL,
            "--train_batch_size", "4", "--synthetic_num_samples", "16",
            "--data_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
            "--max_steps", "2", "--warmup_steps", "1", "--save_interval", "2",
            "--log_interval", "1", "--validation_interval", "-1",
            "--compile_transformer", "true"]

    warm = subprocess.run([sys.executable, "-m", "trainer.warmup", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    report = json.loads(warm.stdout)
    assert report["compile_transformer"] is True
    assert report["caches"]["TORCHINDUCTOR_CACHE_DIR"]["added"] > 0
    assert "AOTAutograd cache miss" in warm.stderr  # a cold cache: the warm-up compiled
    after_warm_up = _cache_files(caches["TORCHINDUCTOR_CACHE_DIR"])

    train = subprocess.run([sys.executable, "trainer/train.py", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    # Training compiled (each block's text and video streams, forward and backward) and found
    # every graph in the cache.
    assert train.stderr.count("AOTAutograd cache hit") >= 2, train.stderr[-3000:]
    assert "AOTAutograd cache miss" not in train.stderr, train.stderr[-3000:]
    assert _cache_files(caches["TORCHINDUCTOR_CACHE_DIR"]) == after_warm_up
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
