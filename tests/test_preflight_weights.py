"""What the weights a run starts from can tell before its job starts, from headers and small JSON
files only: a transformer/config.json that gives more layers than its safetensors hold, a
safetensors file cut short, a LoRA resume at another rank, and a Hugging Face Hub id given as
pretrained_transformer_path are refused by `train.py --dry-run` and `relay submit` (the Hub id
by --dry-run, before any other message), with the exit code of every other refusal (2) and one
paragraph, not at job start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.weights_source import resolve_weights_source
from trainer.resolve import resolve_config
from trainer.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# Fits the embedded synthetic data: 3-channel 16x16 frames, 32-wide captions.
TINY = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 3, "out_channels": 3, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6, "rope_max_seq_len": 64}
WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("preflight-weights")


@pytest.fixture(scope="module")
def wan_dir(root) -> Path:
    """A tiny diffusers Wan pipeline directory (transformer/ as save_pretrained writes it)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    path = root / "tiny-wan"
    WanTransformer3DModel(**TINY).save_pretrained(path / "transformer")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT)}  # this checkout's relay, from any working directory
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _settings(root: Path, path, out: Path, **extra) -> dict:
    """A tiny SFT of the Wan at `path` on the embedded data (its stand-in captions)."""
    return {"model_family": "wan", "pretrained_transformer_path": str(path),
            "load_transformer_weights": True, "transformer_config_overrides": {},
            "text_encoder": "standin", "text_max_tokens": 8, "train_batch_size": 4,
            "synthetic_num_samples": 16, "max_steps": 2, "save_interval": 2, "warmup_steps": 0,
            "log_interval": 1, "validation_interval": -1, "data_path": str(root / "data"),
            "output_dir": str(out), **extra}


def _argv(settings: dict) -> list[str]:
    argv = ["--config", str(ROOT / "config" / "tiny" / "pretrain.yaml")]
    for key, value in settings.items():
        argv += [f"--{key}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


def _train(settings: dict, *, dry_run: bool, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "trainer" / "train.py"), *_argv(settings)]
    if dry_run:
        argv.append("--dry-run")
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _submit(tmp_path: Path, settings: dict) -> subprocess.CompletedProcess:
    """`relay submit --dry-run` of a one-stage pipeline running `settings`."""
    settings = dict(settings)
    out = settings.pop("output_dir")
    pipeline = {"name": "p", "root": str(tmp_path / "runs"),
                "cluster": {"cpus_per_task": 1, "time": 10, "network": "none",
                            "signal_lead_s": 60},
                "stages": {"sft": {"config": str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                                   "output_dir": out, "overrides": settings}}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(path), "--dry-run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, (needle, text[-3000:])
    return text


def _resolve(settings: dict) -> None:
    """What train.py --dry-run checks, in this process."""
    resolve_config(str(ROOT / "config" / "tiny" / "pretrain.yaml"), settings, world_size=1,
                   check_weights=True)


def test_a_config_json_with_more_layers_than_its_weights_is_refused_before_the_job(
        root, wan_dir, tmp_path):
    _resolve(_settings(root, wan_dir, tmp_path / "ok"))  # the directory as written is accepted
    deeper = _copy(wan_dir, tmp_path / "deeper")
    config = deeper / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 4}))
    settings = _settings(root, deeper, tmp_path / "out")
    needles = (f"{config} gives num_layers 4, but the weights in {deeper / 'transformer'} hold 2 "
               f"blocks", "blocks.2.attn1.to_q.weight", "fetch the directory again")
    _refused(_train(settings, dry_run=True), *needles)
    _refused(_submit(tmp_path, settings), "stage sft:", *needles)
    # weights of other widths than config.json gives are named with both shapes
    wider = _copy(wan_dir, tmp_path / "wider")
    config = wider / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "ffn_dim": 64}))
    with pytest.raises(ConfigError) as caught:
        _resolve(_settings(root, wider, tmp_path / "out"))
    assert "blocks.0.ffn.net.0.proj.weight is [32, 16] in the weights, [64, 16] in the model" \
        in str(caught.value), str(caught.value)


def test_a_safetensors_file_cut_short_is_refused_before_the_job(root, wan_dir, tmp_path):
    cut = _copy(wan_dir, tmp_path / "cut")
    file = cut / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 5000])
    settings = _settings(root, cut, tmp_path / "out")
    needles = (str(file), f"is cut short: its header describes {len(data)} bytes but the file "
               f"has {len(data) - 5000}", "Fetch the file again")
    _refused(_train(settings, dry_run=True), *needles)
    _refused(_submit(tmp_path, settings), "stage sft:", *needles)
    # a file with bytes past what its header describes is no safetensors file either
    file.write_bytes(data + b"\0" * 16)
    with pytest.raises(CheckpointError, match="has .* bytes but its header describes"):
        resolve_weights_source(cut, weights="live")


def test_a_lora_resume_at_another_rank_is_refused_before_the_job(root, wan_dir, tmp_path):
    out = tmp_path / "lora"
    settings = _settings(root, wan_dir, out, lora_rank=4)
    proc = _train(settings, dry_run=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (out / "checkpoint-2" / "COMPLETE").is_file()
    _resolve({**settings, "max_steps": 4})  # the same adapters resume
    _resolve({**settings, "max_steps": 4, "lora_alpha": 16.0})  # a scale, not a shape
    other = {**settings, "max_steps": 4, "lora_rank": 8}
    needles = (f"output_dir {out} holds checkpoint-2, saved with lora_rank: 4; this run has "
               f"lora_rank: 8", "Resume with lora_rank: 4")
    _refused(_train(other, dry_run=True), *needles)
    _refused(_submit(tmp_path, other), "stage sft:", *needles)
    with pytest.raises(ConfigError, match=r'saved with lora_target_modules: \[\]; this run has '
                                          r'lora_target_modules: \["to_q"\]'):
        _resolve({**settings, "max_steps": 4, "lora_target_modules": ["to_q"]})
    # so is every other setting the saved state depends on (here: an EMA it did not keep)
    with pytest.raises(ConfigError, match=r"saved with use_ema: false; this run has use_ema: true"):
        _resolve({**settings, "max_steps": 4, "use_ema": True})


def test_a_hub_id_is_refused_first_with_how_to_download_it(root, wan_dir, tmp_path,
                                                              monkeypatch):
    hub_id = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    # validation on, and the 1.3B's defaults against 3-channel latents and 32-wide captions:
    # each would be a refusal of its own were the path read as a (missing) directory
    settings = {**_settings(root, hub_id, tmp_path / "out"), "validation_interval": 0}
    del settings["text_encoder"], settings["text_max_tokens"]
    text = _refused(_train(settings, dry_run=True, cwd=tmp_path),
                    f"`pretrained_transformer_path` {hub_id} reads as a Hugging Face Hub id, but "
                    f"it must be a local directory",
                    f"huggingface-cli download {hub_id} --local-dir <models>/Wan2.1-T2V-1.3B-"
                    f"Diffusers")
    assert "vae_path" not in text and "text_dim" not in text, text[-3000:]
    # relay submit says the same first, and still reads an earlier stage's output_dir as a path
    settings.pop("output_dir")
    pipeline = {"name": "hub", "root": "runs", "cluster": {"gpus_per_node": 0},
                "stages": {"sft": {"config": str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                                   "overrides": settings},
                           "again": {"config": str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                                     "overrides": {**settings, "pretrained_transformer_path":
                                                   "runs/sft"}}}}
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(pipeline))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", "hub.yaml",
                           "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    problems = {line.split(":")[0].split()[-1]: line for line in proc.stderr.splitlines()
                if line.lstrip().startswith("- stage")}
    assert f"{hub_id} reads as a Hugging Face Hub id" in problems["sft"], proc.stderr[-3000:]
    assert "Hub id" not in problems.get("again", "")  # runs/sft: the sft stage's output_dir
    # a relative owner/name path that exists is a directory, and one make_tiny_wan writes is
    # written there: neither is an id
    monkeypatch.chdir(tmp_path)
    local = _copy(wan_dir, tmp_path / "models" / "tiny-wan")
    resolve_config(str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                   _settings(root, "models/tiny-wan", tmp_path / "ok"), world_size=1,
                   cwd=tmp_path, check_weights=True)
    resolve_config(str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                   _settings(root, "scratch/tiny-wan", tmp_path / "ok", make_tiny_wan=True),
                   world_size=1, cwd=tmp_path, check_weights=True)
    assert local.is_dir() and not (tmp_path / "scratch").exists()
