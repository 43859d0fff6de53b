"""Public weights streamed into FSDP2 shards (docs/checkpoints.md, "Warm starts"): a tiny Wan
diffusers directory, sharded with an index, warm-starts a 2-rank run (real torch.distributed,
gloo, CPU). The model is built on the meta device and sharded before it has storage; the files
are read tensor by tensor into each rank's shards. Gathered, the weights equal the files bit
for bit; no rank ever holds the whole model; the run's losses are those of one process that
loads the directory the old way (built whole), with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# Fits the embedded synthetic data: 3-channel 16x16 frames, 32-wide captions.
TINY = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 3, "out_channels": 3, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6, "rope_max_seq_len": 64}
GLOBAL_BATCH = 4


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID",
                "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _ranks(nproc: int, script: str, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, script, *argv] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """A diffusers pipeline directory whose transformer/ is split into shards with an index."""
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("wan")
    torch.manual_seed(0)
    WanTransformer3DModel(**TINY).save_pretrained(root / "transformer", max_shard_size="20KB")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    assert len(list((root / "transformer").glob("*.safetensors"))) > 1
    assert list((root / "transformer").glob("*.safetensors.index.json"))
    return root


def test_two_ranks_stream_the_files_into_their_shards_and_never_hold_the_model(directory,
                                                                              tmp_path):
    _ranks(2, "tests/streamed_load_worker.py", str(directory), str(tmp_path),
           str(tmp_path / "data"))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        whole = got["whole_model_bytes"]
        assert got["sharded"]
        # Gathered (full_tensor), every tensor of the files is in the model bit for bit.
        assert got["differ"] == [] and got["files_keys"] == got["tensors_read"] == len(
            got["report"]["loaded"])
        assert got["report"]["missing"] == [] and got["report"]["unexpected"] == []
        assert got["report"]["layout"] == "diffusers" and len(got["report"]["files"]) > 1
        # The build allocated this rank's shards (and the 4-byte time gate), nothing more...
        assert got["streamed_build_bytes"] <= got["shard_bytes"] + 64
        assert got["shard_bytes"] < 0.6 * whole
        # ...while the old build allocates the whole model on every rank first.
        assert got["whole_build_bytes"] >= whole
        # The most a rank held while loading: its shards and one whole tensor.
        assert got["shard_bytes"] + got["largest_tensor_held"] < whole


def _train(directory: Path, out: Path, data: Path, nproc: int) -> subprocess.CompletedProcess:
    return _ranks(nproc, "trainer/train.py", "--config", "config/tiny/pretrain.yaml",
                  "--model_family", "wan",
                  "--pretrained_transformer_path", str(directory / "transformer"),
                  "--load_transformer_weights", "true", "--transformer_config_overrides", "{}",
                  "--text_encoder", "standin", "--text_max_tokens", "8",
                  "--train_batch_size", str(GLOBAL_BATCH // nproc),
                  "--synthetic_num_samples", "16", "--max_steps", "2", "--warmup_steps", "0",
                  "--log_interval", "1", "--validation_interval", "-1",
                  "--save_interval", "100", "--deterministic", "true",
                  "--data_path", str(data), "--output_dir", str(out))


def test_a_streamed_run_trains_as_one_process_that_loads_it_whole(directory, tmp_path):
    data = tmp_path / "data"
    one = _train(directory, tmp_path / "one", data, 1)
    two = _train(directory, tmp_path / "two", data, 2)
    assert "building the model sharded" in two.stdout + two.stderr
    assert "building the model sharded" not in one.stdout + one.stderr

    def records(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    want, got = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    reports = [json.loads((tmp_path / name / "warm-start.json").read_text())
               for name in ("one", "two")]
    assert reports[0] == reports[1] and reports[0]["missing"] == []
