"""The model-family interface: a family defined outside relay's package plugs in through the
registry alone and trains through pretrain; stages refuse a family that lacks what they call;
the modules that orchestrate a run name no family's classes, methods or keys."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config.schema import ConfigError
from trainer.models.dit.family import DiTFamily
from trainer.models.registry import family_names, get_family

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "families" / "pixel_mlp.py"
TINY = str(ROOT / "config" / "tiny")


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _plugin_run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLUGIN), *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _pretrain_argv(tmp_path: Path, out: Path, max_steps: int) -> list[str]:
    return ["--config", f"{TINY}/pretrain.yaml", "--model_family", "pixel_mlp",
            "--transformer_config_overrides", "{hidden: 16, layers: 2}",
            "--train_batch_size", "4", "--synthetic_num_samples", "32",
            "--data_path", str(tmp_path / "data"), "--output_dir", str(out),
            "--max_steps", str(max_steps), "--save_interval", "3", "--log_interval", "1",
            "--validation_interval", "-1", "--warmup_steps", "1"]


def test_a_family_registered_outside_relay_trains_through_pretrain_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _plugin_run(*_pretrain_argv(tmp_path, out, 6))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(l == l for l in losses) and len(set(losses)) > 1  # finite, and it trains
    complete = json.loads((out / "checkpoint-6" / "COMPLETE").read_text())
    assert complete["model_config"] == {"in_channels": 3, "hidden": 16, "layers": 2,
                                        "text_dim": 32, "patch": [1, 4, 4]}
    # A longer run in the same output_dir resumes from checkpoint-6.
    proc = _plugin_run(*_pretrain_argv(tmp_path, out, 8))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert "checkpoint-6" in proc.stdout + proc.stderr


def test_no_product_file_names_the_test_family():
    found = subprocess.run(["git", "grep", "-l", "pixel_mlp", "--", "trainer", "launcher",
                            "config", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == ""


def test_a_stage_refuses_a_family_that_lacks_what_it_calls_at_dry_run(tmp_path):
    proc = _plugin_run("--config", f"{TINY}/stage1.yaml", "--model_family", "pixel_mlp",
                       "--transformer_config_overrides", "{}",
                       "--pretrained_transformer_path", "null",
                       "--load_transformer_weights", "false",
                       "--output_dir", str(tmp_path / "s1"), "--dry-run", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    message = proc.stderr
    assert "stage tf_anyflow needs what model family 'pixel_mlp' cannot do" in message
    assert "teacher forcing" in message and "KV cache" in message and "second time input" in message


def test_an_unknown_family_is_refused_with_the_closest_name(tmp_path):
    proc = subprocess.run([sys.executable, "trainer/train.py", "--config", f"{TINY}/pretrain.yaml",
                           "--model_family", "ditt", "--output_dir", str(tmp_path / "o"),
                           "--dry-run"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model_family 'ditt' is not a known model family. Did you mean 'dit'?" in proc.stderr


def test_the_dit_family_is_the_default_and_reports_its_own_geometry():
    assert "dit" in family_names()
    family = get_family("dit")
    config = family.config({"hidden_size": 64, "num_attention_heads": 2, "rope_axes_dim": [8, 12, 12],
                            "causal_chunk_size": 2, "two_time": True, "time_gate": 0.5})
    geometry = family.geometry(config)
    assert (geometry.num_heads, geometry.head_dim, geometry.hidden_size) == (2, 32, 64)
    assert (geometry.causal_chunk_frames, geometry.two_time, geometry.time_gate) == (2, True, 0.5)
    teacher = family.geometry(family.bidirectional_config(config))
    assert (teacher.causal_chunk_frames, teacher.two_time) == (None, False)
    with pytest.raises(ValueError, match="Did you mean `hidden_size`"):
        family.config({"hiden_size": 3})


def test_the_dit_module_follows_the_protocol():
    import torch

    family = DiTFamily()
    config = family.config({"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
                            "rope_axes_dim": [4, 6, 6], "two_time": True})
    model = family.build(config)
    assert model.geometry == family.geometry(config)
    assert len(model.checkpoint_units()) == 2 and len(model.fsdp_units()) == 4
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.init_second_time_from_first()
    x, t, text = torch.randn(1, 3, 2, 8, 8), torch.tensor([300.0]), torch.randn(1, 4, 32)
    assert torch.equal(model(x, t, text, r=t), model(x, t, text))


# Names of the DiT's classes, methods and keys that the orchestration must not use: it reaches a
# model only through trainer.models.family / trainer.models.protocol.
DIT_NAMES = re.compile(r"VideoDiT|DiTConfig|DiTBlock|r_embedder|time_embedder|causal_chunk_size|"
                       r"models\.dit|enable_two_time|TIME_FREQ_DIM|\.blocks\b|block\.modulation|"
                       r"\.cfg\.|mlp_ratio|rope_axes_dim|zero_init_modulation")
FAMILY_FREE = ["trainer/stages", "trainer/build.py", "trainer/preflight.py",
               "trainer/parallel", "trainer/warmup.py", "trainer/evaluation/inference.py",
               "trainer/checkpoint/run_state.py", "trainer/checkpoint/warm_start.py",
               "trainer/config/stage_checks.py", "benchmarks/flops.py"]


def test_the_orchestration_names_no_dit_class_method_or_key():
    offenders = []
    for entry in FAMILY_FREE:
        path = ROOT / entry
        for file in sorted(path.rglob("*.py") if path.is_dir() else [path]):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if DIT_NAMES.search(line):
                    offenders.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_config_error_of_the_family_reaches_the_user_as_one_paragraph(tmp_path):
    from trainer.config.args import resolve_config

    with pytest.raises(ConfigError, match="top-level key only"):
        resolve_config(f"{TINY}/pretrain.yaml",
                       {"transformer_config_overrides": {"zero_init_modulation": False},
                        "output_dir": str(tmp_path)}, check_paths=False)
