"""Wan2.2 A14B's two experts in one pipeline (config/pipeline/wan-a14b-tiny.yaml,
config/pipeline/wan-a14b.yaml): a tiny A14B directory written by diffusers' WanPipeline
(transformer/ the high-noise expert, transformer_2/ the low-noise one, boundary_ratio in
model_index.json) trained under `relay run`, one stage per expert, each on its own timesteps
(train_timestep_range from the directory, checked on the draws every step logged); the pair
exported with `relay export --format diffusers --other-expert` loads in WanPipeline, which
samples with both experts, each at its timesteps; one expert exported alone takes the other
from the source; what cannot work is refused before anything starts, in one paragraph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from launcher.cli import main as relay_main
from trainer.checkpoint.dcp_io import read_dcp_state_dict
from trainer.models.wan import tiny

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "config" / "pipeline" / "wan-a14b-tiny.yaml"
BOUNDARY = 0.875
RANGES = {"high": [BOUNDARY, 1.0], "low": [0.0, BOUNDARY]}
FOLDERS = {"high": "transformer", "low": "transformer_2"}
STEPS = 3


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _pipeline(tmp: Path) -> Path:
    """The shipped tiny two-expert pipeline with `source` and `data` in tmp, few steps."""
    data = yaml.safe_load(PIPELINE.read_text())
    data["source"], data["data"] = str(tmp / "tiny-wan-a14b"), str(tmp / "data")
    for stage in data["stages"].values():
        stage["config"] = str(ROOT / stage["config"])
        stage["overrides"].update(max_steps=STEPS, log_interval=1, save_interval=STEPS,
                                  warmup_steps=1, synthetic_num_samples=8, train_batch_size=4)
    path = tmp / "a14b.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("a14b")
    pipeline = _pipeline(tmp)
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run", str(pipeline), "--root",
                           str(tmp / "runs")], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"tmp": tmp, "pipeline": pipeline, "source": tmp / "tiny-wan-a14b",
            "high": tmp / "runs" / "high", "low": tmp / "runs" / "low"}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _folder(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _trained_weights(run: Path) -> dict[str, torch.Tensor]:
    return read_dcp_state_dict(run / f"checkpoint-{STEPS}" / "transformer")


def _relay(capsys, *argv: str) -> tuple[int, str, str]:
    code = relay_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_each_expert_trains_on_its_own_timesteps_from_the_a14b_directory(trained):
    source = trained["source"]
    # the directory is diffusers' A14B layout, its two experts different models
    index = json.loads((source / "model_index.json").read_text())
    assert index["boundary_ratio"] == BOUNDARY
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    high, low = _folder(source / "transformer"), _folder(source / "transformer_2")
    assert any(not torch.equal(high[key], low[key]) for key in high)
    for name, span in RANGES.items():
        run = trained[name]
        args = json.loads((run / "resolved-config.json").read_text())
        assert args["pretrained_transformer_path"] == str(source / FOLDERS[name])
        assert args["train_timestep_range"] == span
        # every step's draws lie in the expert's range, and they are not one value
        records = _records(run)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for record in records:
            assert span[0] <= record["sigma_min"] <= record["sigma_max"] <= span[1], (name, record)
            assert record["sigma_min"] < record["sigma_max"]
        # each expert left its source weights
        trained_state = _trained_weights(run)
        start = _folder(source / FOLDERS[name])
        assert sorted(trained_state) == sorted(start)
        assert any(not torch.equal(trained_state[k].float(), start[k].float()) for k in start)


def test_the_exported_pair_samples_in_wan_pipeline_with_both_experts(trained, tmp_path, capsys):
    from diffusers import WanPipeline

    out = tmp_path / "a14b-ft"
    code, stdout, stderr = _relay(capsys, "export", str(trained["high"]), "--format", "diffusers",
                                  "--other-expert", str(trained["low"]), "--out", str(out))
    assert code == 0, stderr
    assert "(the high-noise expert)" in stdout and "(the low-noise expert)" in stdout
    assert json.loads((out / "model_index.json").read_text())["boundary_ratio"] == BOUNDARY

    pipe = WanPipeline.from_pretrained(str(out))
    assert pipe.config.boundary_ratio == BOUNDARY
    for name, module in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        want = _trained_weights(trained[name])
        for key, value in module.state_dict().items():
            assert torch.equal(value, want[key].to(value.dtype)), (name, key)
    seen: dict[str, list[float]] = {"high": [], "low": []}
    for name, module in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        module.register_forward_pre_hook(
            lambda _, args, kwargs, name=name: seen[name].append(float(kwargs["timestep"][0])),
            with_kwargs=True)
    result = pipe("a red square moving left", negative_prompt="", height=32, width=32,
                  num_frames=9, num_inference_steps=4, guidance_scale=1.0, output_type="np",
                  generator=torch.Generator().manual_seed(0))
    assert result.frames.shape == (1, 9, 32, 32, 3)
    # WanPipeline ran transformer/ at t >= 875 and transformer_2/ below, both at least once
    assert seen["high"] and seen["low"], seen
    assert min(seen["high"]) >= BOUNDARY * 1000 > max(seen["low"]), seen


def test_one_expert_exported_alone_takes_the_other_from_the_source(trained, tmp_path, capsys):
    from diffusers import WanPipeline

    out = tmp_path / "low-only"
    code, stdout, stderr = _relay(capsys, "export", str(trained["low"]), "--format", "diffusers",
                                  "--out", str(out))
    assert code == 0, stderr
    assert f"wrote {out / 'transformer_2'}" in stdout
    assert "transformer/ is the high-noise expert as it was there" in stdout
    source = trained["source"]
    for part in ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"):
        assert (out / part).read_bytes() == (source / part).read_bytes(), part
    pipe = WanPipeline.from_pretrained(str(out))
    want = _trained_weights(trained["low"])
    for key, value in pipe.transformer_2.state_dict().items():
        assert torch.equal(value, want[key].to(value.dtype)), key
    # each expert alone also goes through the pipeline: the low stage validates by itself on a
    # fresh root (it writes the tiny A14B directory when it is missing)
    fresh = tmp_path / "fresh"
    data = yaml.safe_load(trained["pipeline"].read_text())
    data["source"], data["data"] = str(fresh / "tiny-wan-a14b"), str(fresh / "data")
    alone = tmp_path / "alone.yaml"
    alone.write_text(yaml.safe_dump(data, sort_keys=False))
    code, stdout, stderr = _relay(capsys, "submit", str(alone), "--root", str(fresh / "runs"),
                                  "--only", "low", "--dry-run")
    assert code == 0, stderr
    assert "timesteps: sigma in [0, 0.875] after the shift" in stdout
    assert "  high:" not in stdout


def _refused(capsys, *argv: str, needles: tuple[str, ...]) -> str:
    code, stdout, stderr = _relay(capsys, *argv)
    assert code == 2, stdout + stderr
    assert "Traceback" not in stderr and stderr.startswith("relay export: "), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr  # one paragraph
    for needle in needles:
        assert needle in stderr, (needle, stderr)
    return stderr


def test_experts_that_do_not_make_a_pair_are_refused(trained, tmp_path, capsys):
    high, low = str(trained["high"]), str(trained["low"])
    out = tmp_path / "out"
    _refused(capsys, "export", low, "--format", "diffusers", "--other-expert", low, "--out",
             str(out), needles=("are both the low-noise expert", "started from transformer/"))
    plain = tiny.write_tiny_wan_pipeline(tmp_path / "plain")  # one transformer
    capsys.readouterr()  # (diffusers' progress bars)
    _refused(capsys, "export", high, "--format", "diffusers", "--other-expert", low, "--out",
             str(out), "--components", str(plain),
             needles=(f"{plain} has one transformer", "--components none"))
    _refused(capsys, "export", low, "--format", "diffusers", "--out", str(out), "--components",
             str(plain), needles=("low-noise expert", "has one transformer"))
    _refused(capsys, "export", high, "--other-expert", low, "--out", str(tmp_path / "m.safetensors"),
             needles=("--other-expert applies to --format diffusers or peft, not to --format relay",))
    assert not out.exists() and not (tmp_path / "m.safetensors").exists()


def _dry_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "trainer/train.py", "--config",
                           "config/wan/tiny-a14b.yaml", "--data_path", str(tmp_path / "data"),
                           "--output_dir", str(tmp_path / "out"), *extra, "--dry-run"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)


def _resolve(tmp_path: Path, *extra: str):
    from trainer.resolve import resolve_config

    return resolve_config(str(ROOT / "config/wan/tiny-a14b.yaml"),
                          ["--data_path", str(tmp_path / "data"), "--output_dir",
                           str(tmp_path / "out"), *extra])


def test_the_range_is_checked_before_anything_starts(trained, tmp_path):
    from trainer.config.schema import ConfigError

    source = trained["source"]
    high = _dry_run(tmp_path, "--pretrained_transformer_path", str(source / "transformer"))
    assert high.returncode == 0, high.stderr[-2000:]
    assert json.loads(high.stdout)["train_timestep_range"] == RANGES["high"]
    assert "timesteps: sigma in [0.875, 1] after the shift (train_timestep_range: timesteps " \
           "875 to 1000 of 1000)" in high.stderr
    expert = ("--pretrained_transformer_path", str(source / "transformer_2"))
    for bad in ("[0.9, 0.5]", "[0.0, 1.5]", "[0.5]"):
        with pytest.raises(ConfigError, match=r"`train_timestep_range` must be \[lo, hi\] with "
                                              r"0 <= lo < hi <= 1"):
            _resolve(tmp_path, *expert, "--train_timestep_range", bad)
    # Stage1 draws its own times: a range is refused there, and an expert folder gives it none
    stage1 = ("--stage", "tf_anyflow", "--transformer_config_overrides",
              "{causal_chunk_size: 1, two_time: true}")
    with pytest.raises(ConfigError, match=r"restricts flow matching's noise levels \(stage fm\) "
                                          r"only: Stage1 \(tf_anyflow\)"):
        _resolve(tmp_path, *expert, *stage1, "--train_timestep_range", "[0.0, 0.875]")
    assert _resolve(tmp_path, *expert, *stage1).train_timestep_range == [0.0, 1.0]
    # the directory itself is refused, with the way to train both experts
    proc = _dry_run(tmp_path, "--pretrained_transformer_path", str(source))
    assert proc.returncode == 2
    assert "config/pipeline/wan-a14b.yaml" in proc.stderr and "--other-expert" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _release(root: Path) -> Path:
    """Wan2.2-T2V-A14B-Diffusers' config files with stub weights: what a dry run reads."""
    transformer = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128,
                   "num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824,
                   "patch_size": [1, 2, 2], "text_dim": 4096, "freq_dim": 256,
                   "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
                   "rope_max_seq_len": 1024, "in_channels": 16, "out_channels": 16}
    files = {
        "model_index.json": {"_class_name": "WanPipeline", "boundary_ratio": BOUNDARY,
                             "transformer": ["diffusers", "WanTransformer3DModel"],
                             "transformer_2": ["diffusers", "WanTransformer3DModel"],
                             "vae": ["diffusers", "AutoencoderKLWan"]},
        "transformer/config.json": transformer,
        "transformer_2/config.json": transformer,
        "vae/config.json": {"_class_name": "AutoencoderKLWan", "z_dim": 16,
                            "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
                            "scale_factor_spatial": 8},
        "text_encoder/config.json": {"architectures": ["UMT5EncoderModel"], "d_model": 4096,
                                     "num_layers": 24},
        "tokenizer/tokenizer.json": {},
        "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler",
                                            "flow_shift": 3.0},
    }
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    for part in ("transformer", "transformer_2", "vae"):
        save_file({"stub": torch.zeros(1)}, str(root / part / "diffusion_pytorch_model.safetensors"))
    return root


def test_the_shipped_a14b_pipeline_dry_runs_with_its_lines_edited(tmp_path):
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    model = _release(tmp_path / "Wan2.2-T2V-A14B-Diffusers")
    data = tmp_path / "data"
    data.mkdir()
    latent = [16, 21, 90, 160]
    pq.write_table(pa.Table.from_pylist([{
        "id": "p-0", "caption": "a clip", "vae_latent_bytes": bytes(2 * math.prod(latent)),
        "vae_latent_shape": latent, "vae_latent_dtype": "bfloat16",
        "text_embedding_bytes": bytes(2 * 8 * 4096), "text_embedding_shape": [8, 4096],
        "text_embedding_dtype": "bfloat16"}]), data / "part-0.parquet")
    pipeline = yaml.safe_load((ROOT / "config/pipeline/wan-a14b.yaml").read_text())
    pipeline.update(root=str(tmp_path / "runs"), source=str(model), data=str(data))
    for stage in pipeline["stages"].values():
        stage["config"] = str(ROOT / stage["config"])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipeline))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", "p.yaml", "--dry-run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    plan = proc.stdout
    high, low = plan[plan.index("  high:"):plan.index("  low:")], plan[plan.index("  low:"):]
    assert "world 256," in high and "world 256," in low and "after high" in low
    assert "timesteps: sigma in [0.875, 1] after the shift" in high
    assert "timesteps: sigma in [0, 0.875] after the shift" in low
    totals = [float(line.split("~")[1].split()[0]) for line in plan.splitlines()
              if line.strip().startswith("total ~")]
    assert len(totals) == 2 and max(totals) < 141, totals
    for name, folder in FOLDERS.items():
        assert f"--pretrained_transformer_path={model / folder}" in plan


def test_lora_runs_of_both_experts_export_as_two_named_adapters_wan_pipeline_loads(
        tmp_path, capsys):
    """A LoRA of each expert (the tiny two-expert pipeline with lora_rank 4): --format peft
    --other-expert writes high_noise/ and low_noise/; loaded into WanPipeline's transformer and
    transformer_2, each expert computes what the merged export of the same pair computes."""
    from diffusers import WanPipeline

    data = yaml.safe_load(_pipeline(tmp_path).read_text())
    for stage in data["stages"].values():
        stage["overrides"].update(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2)
    pipeline = tmp_path / "lora.yaml"
    pipeline.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run", str(pipeline), "--root",
                           str(tmp_path / "runs")], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs, source = tmp_path / "runs", tmp_path / "tiny-wan-a14b"
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    code, out, err = _relay(capsys, "export", str(runs / "low"), "--format", "peft",
                            "--other-expert", str(runs / "high"), "--out", str(adapters))
    assert code == 0, err
    record = json.loads((adapters / "adapters.json").read_text())
    assert record["high_noise"]["transformer"] == "transformer"
    assert record["low_noise"] == {**record["low_noise"], "transformer": "transformer_2",
                                   "load_into_transformer_2": True}
    code, _, err = _relay(capsys, "export", str(runs / "high"), "--format", "diffusers",
                          "--merge-lora", "--other-expert", str(runs / "low"), "--out", str(merged))
    assert code == 0, err
    pipe = WanPipeline.from_pretrained(str(source))
    pipe.load_lora_weights(str(adapters / "high_noise"), adapter_name="high_noise")
    pipe.load_lora_weights(str(adapters / "low_noise"), adapter_name="low_noise",
                           load_into_transformer_2=True)
    reference = WanPipeline.from_pretrained(str(merged))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tiny.LATENT_CHANNELS, 3, 4, 4, generator=gen)
    text = torch.randn(1, 6, tiny.TEXT_DIM, generator=gen)
    t = torch.tensor([500.0])
    for name in ("transformer", "transformer_2"):
        with torch.no_grad():
            got = getattr(pipe, name)(x, t, text, return_dict=False)[0]
            want = getattr(reference, name)(x, t, text, return_dict=False)[0]
            base = getattr(WanPipeline.from_pretrained(str(source)), name)(
                x, t, text, return_dict=False)[0]
        assert not torch.allclose(got, base, atol=1e-4), name  # the adapter changed it
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # one run of each expert, or nothing
    code, _, err = _relay(capsys, "export", str(runs / "low"), "--format", "peft",
                          "--other-expert", str(runs / "low"), "--out", str(tmp_path / "bad"))
    assert code == 2 and "one run of each expert" in err and not (tmp_path / "bad").exists()
