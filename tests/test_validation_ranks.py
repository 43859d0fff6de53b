"""Validation under FSDP2 (gloo, 2 processes): every rank runs the sampler's forwards, which
gather the sharded blocks, but only rank 0 decodes through the VAE, scores and writes, and
what it writes is what one process writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs the encode extra")

from fixtures.fastvideo_t2v import write_fastvideo_dataset
from fixtures.ports import free_port
from fixtures.tiny_encoders import save_vae

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "validation_worker.py"


def _validate(ranks: int, data: Path, vae: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
        str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(WORKER), str(data), str(vae), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


def _manifest(out: Path) -> dict:
    """The step's manifest with its paths made relative to the run directory."""
    text = (out / "samples" / "step-1" / "manifest.json").read_text()
    return json.loads(text.replace(str(out), "RUN"))


def test_only_rank_zero_decodes_scores_and_writes_and_writes_what_one_process_does(tmp_path):
    data = write_fastvideo_dataset(tmp_path / "data", 8, dtype=torch.float32)
    save_vae(tmp_path / "vae")
    alone = _validate(1, data, tmp_path / "vae", tmp_path / "one")
    shard = _validate(2, data, tmp_path / "vae", tmp_path / "two")
    assert not alone[0]["sharded"] and all(r["sharded"] for r in shard)
    assert alone[0]["vae_loaded"] == 1 and shard[0]["vae_loaded"] == 1
    assert shard[1]["vae_loaded"] == 0  # rank 1 sampled (the forwards need it) but never decoded
    assert shard[1]["metrics"] == [] and shard[0]["metrics"] == alone[0]["metrics"]
    assert "val/live/colour_accuracy" in shard[0]["metrics"]
    assert _manifest(tmp_path / "two") == _manifest(tmp_path / "one")
    frames = "samples/step-1/live/frames.npy"
    np.testing.assert_array_equal(np.load(tmp_path / "two" / frames),
                                  np.load(tmp_path / "one" / frames))
