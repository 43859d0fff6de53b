"""FSDP2 and the split of the world: real train.py runs under torchrun (gloo, CPU).

The same global batch of 8 samples a step, split four ways: one process; two ranks fully
sharded; four ranks as 2 replicas x 2-rank shard groups (hybrid shard); one process with two
accumulated micro-batches. Because every random draw is keyed by the sample's global index
and the step (trainer.diffusion.sample_draws) and the data position is global, all of them must log the
same losses and gradient norms, and a checkpoint written by two ranks must resume on one, two
or four ranks on the same trajectory. Nothing is mocked: real process groups, real DCP shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.ports import free_port

from trainer.checkpoint.layout import read_complete

REPO = Path(__file__).resolve().parents[2]
MODEL = ("{hidden_size: 32, num_attention_heads: 2, num_layers: 2, rope_axes_dim: [4, 6, 6], "
         "text_dim: 32, patch_size: [1, 4, 4], in_channels: 3}")
GLOBAL_BATCH = 8
STEPS = 6
RTOL = 1e-4


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's environment already had."""
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": _pythonpath()}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def train(out: Path, data: Path, ranks: int, *extra: str, config: str = "pretrain",
          timeout: float = 300) -> subprocess.CompletedProcess:
    """train.py on `ranks` processes (torchrun for more than one); asserts it succeeded."""
    args = ["--config", str(REPO / "config" / "tiny" / f"{config}.yaml"),
            "--synthetic_num_samples", "64", "--data_path", str(data), "--output_dir", str(out),
            "--max_steps", str(STEPS), "--warmup_steps", "2", "--log_interval", "1",
            "--save_interval", "3", "--save_total_limit", "0", "--validation_interval", "-1",
            "--deterministic", "true", *extra]
    script = str(REPO / "trainer" / "train.py")
    launcher = [sys.executable, script] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
        str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script]
    proc = subprocess.run(launcher + args, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "ERROR" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + proc.stderr[-3000:]
    return proc


def records(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def assert_same_trajectory(got: Path, want: Path, keys=("loss", "grad_norm"), steps=None):
    a, b = records(got), records(want)
    for step in steps or sorted(b):
        for key in (k for k in keys if k in b[step]):  # Stage2 logs its generator loss
            assert a[step][key] == pytest.approx(b[step][key], rel=RTOL), (step, key, a[step], b[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny pretrain at every split of one global batch of 8 (made once)."""
    root = tmp_path_factory.mktemp("fsdp")
    data = root / "data"
    model = ("--transformer_config_overrides", MODEL)
    splits = {
        "one": (1, "--train_batch_size", "8"),
        "accum": (1, "--train_batch_size", "4", "--gradient_accumulation_steps", "2"),
        "dp2": (2, "--train_batch_size", "4"),
        "hybrid": (4, "--train_batch_size", "2", "--hybrid_shard", "true",
                   "--shard_group_size", "2"),
    }
    logs = {}
    for name, (ranks, *extra) in splits.items():
        logs[name] = train(root / name, data, ranks, *model, *extra)
    return root, data, logs


def test_losses_and_gradients_agree_for_one_rank_fsdp2_hybrid_and_accumulation(runs):
    root, _, _ = runs
    for name in ("accum", "dp2", "hybrid"):
        assert_same_trajectory(root / name, root / "one")
    # The split is real: the checkpoints say so, and the loss did move.
    assert read_complete(root / "hybrid" / "checkpoint-6")["world_size"] == 4
    losses = [r["loss"] for r in records(root / "one").values()]
    assert losses[-1] < losses[0]


def test_each_of_two_ranks_writes_its_own_model_and_optimizer_shard(runs):
    root, _, _ = runs
    for member in ("transformer", "optimizer"):
        shards = sorted((root / "dp2" / "checkpoint-6" / member).glob("*.distcp"))
        assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
        assert all(p.stat().st_size > 1000 for p in shards), [p.stat().st_size for p in shards]


def _resume_from_step_3(root: Path, data: Path, name: str, ranks: int, *extra: str) -> Path:
    out = root / f"resume-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    shutil.copytree(root / "dp2" / "checkpoint-3", out / "checkpoint-3")
    proc = train(out, data, ranks, "--transformer_config_overrides", MODEL, *extra)
    assert "resumed from" in proc.stderr
    return out


def test_a_two_rank_checkpoint_resumes_on_two_exactly(runs):
    root, data, _ = runs
    out = _resume_from_step_3(root, data, "two", 2, "--train_batch_size", "4")
    got, want = records(out), records(root / "dp2")
    assert sorted(got) == [4, 5, 6]
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]


@pytest.mark.parametrize("ranks, batch", [(1, "8"), (4, "2")])
def test_a_two_rank_checkpoint_resumes_on_another_world_on_the_same_trajectory(runs, ranks, batch):
    root, data, _ = runs
    out = _resume_from_step_3(root, data, str(ranks), ranks, "--train_batch_size", batch)
    assert sorted(records(out)) == [4, 5, 6]
    assert_same_trajectory(out, root / "dp2", steps=[4, 5, 6])
    assert read_complete(out / "checkpoint-6")["world_size"] == ranks


def test_a_global_batch_change_on_resume_is_said_at_start(runs):
    root, data, _ = runs
    out = root / "resume-other-batch"
    out.mkdir()
    shutil.copytree(root / "dp2" / "checkpoint-3", out / "checkpoint-3")
    proc = train(out, data, 1, "--transformer_config_overrides", MODEL, "--train_batch_size", "4")
    assert "the loss trajectory is not the saved run's" in proc.stderr
    assert "train_batch_size 4 x 2 dp ranks" in proc.stderr


def test_two_rank_weights_warm_start_a_one_process_sft(runs, tmp_path):
    root, _, _ = runs
    out = tmp_path / "sft"
    train(out, tmp_path / "data-sft", 1, "--transformer_config_overrides", MODEL, "--train_batch_size", "4",
          "--pretrained_transformer_path", str(root / "dp2"), "--pretrained_weights", "live",
          "--max_steps", "1", config="sft")
    report = json.loads((out / "warm-start.json").read_text())
    assert report["source"].endswith("dp2/checkpoint-6/transformer")
    assert report["missing"] == [] and len(report["loaded"]) > 20


STAGE1_MODEL = MODEL[:-1] + ", causal_chunk_size: 2, two_time: true, time_gate: 0.25}"
STAGE2_MODEL = MODEL[:-1] + ", causal_chunk_size: 2}"


@pytest.mark.parametrize("config, model, extra", [
    ("stage1", STAGE1_MODEL, ("--pretrained_weights", "live")),
    ("stage2", STAGE2_MODEL, ("--student_init_weights", "live", "--teacher_init_weights", "live",
                              "--critic_init_weights", "live", "--generator_update_interval", "2",
                              "--use_ema", "false")),
])
def test_stage1_and_stage2_log_the_same_losses_on_one_and_two_ranks(runs, tmp_path, config,
                                                                    model, extra):
    root, _, _ = runs
    source = str(root / "one")
    sources = (("--pretrained_transformer_path", source) if config == "stage1" else
               ("--student_init_path", source, "--teacher_init_path", source,
                "--critic_init_path", source))
    common = ("--transformer_config_overrides", model, *sources, *extra, "--max_steps", "4")
    train(tmp_path / "one", tmp_path / "data", 1, *common, "--train_batch_size", "4",
          config=config)
    train(tmp_path / "two", tmp_path / "data", 2, *common, "--train_batch_size", "2",
          config=config)
    keys = ("loss", "grad_norm") if config == "stage1" else ("critic_loss", "critic_grad_norm",
                                                              "generator_loss")
    assert_same_trajectory(tmp_path / "two", tmp_path / "one", keys=keys)


def test_compiled_blocks_with_selective_checkpointing_under_fsdp2_match_eager(runs, tmp_path):
    # The order build.py composes them: checkpoint(block), compile its streams, fully_shard.
    root, data, _ = runs
    out = tmp_path / "compiled"
    train(out, data, 2, "--transformer_config_overrides", MODEL, "--train_batch_size", "4",
          "--compile_transformer", "true", "--enable_gradient_checkpointing", "true",
          "--use_dedicated_gradient_checkpointing", "true", "--deterministic", "false")
    assert_same_trajectory(out, root / "one")
