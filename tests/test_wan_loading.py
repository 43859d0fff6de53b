"""Public Wan weights through the warm-start path: a diffusers pipeline directory (one file or
sharded with an index) and the original release layout load into relay's wan module with
diffusers' forward; the architecture comes from transformer/config.json; a 2-step run starts
from the directory; incomplete, foreign or mismatched directories are refused at --dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.warm_start import load_warm_start
from trainer.checkpoint.weights_source import resolve_weights_source
from trainer.models.wan.family import WanFamily

ROOT = Path(__file__).resolve().parents[1]
# Fits the embedded synthetic data: 3-channel 16x16 frames, 32-wide captions.
TINY = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 3, "out_channels": 3, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6, "rope_max_seq_len": 64}


def _pipeline(root: Path, reference, **save) -> Path:
    reference.save_pretrained(root / "transformer", **save)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return root


@pytest.fixture(scope="module")
def reference():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**TINY).eval()


@pytest.fixture(scope="module")
def single(reference, tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("single"), reference)


@pytest.fixture(scope="module")
def sharded(reference, tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("sharded"), reference, max_shard_size="20KB")


def _assert_same_forward(reference, model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 16, 16, generator=g)
    t = torch.tensor([900.0, 37.5])
    text = torch.randn(2, 5, 32, generator=g)
    with torch.no_grad():
        want = reference(x, t, text).sample
        got = model.eval()(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _load(path: Path, config_dir: Path | None = None):
    family = WanFamily()
    config = family.config_from_dir(str(config_dir or path)) if config_dir is not None or \
        (path / "model_index.json").exists() else family.config(TINY)
    torch.manual_seed(123)  # other weights than the reference's
    model = family.build(config)
    report = load_warm_start(path, model, weights="live", family=family)
    return model, report


def test_a_diffusers_directory_loads_with_diffusers_forward(reference, single):
    for path in (single, single / "transformer"):
        model, report = _load(path, config_dir=single)
        assert report["missing"] == report["unexpected"] == [] and report["layout"] == "diffusers"
        assert len(report["loaded"]) == len(model.state_dict())
        _assert_same_forward(reference, model)


def test_a_sharded_directory_loads_shard_by_shard(reference, sharded):
    index = sharded / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    assert index.is_file()
    source = resolve_weights_source(sharded, weights="live")
    assert source.kind == "safetensors_dir" and len(source.files) > 1
    model, report = _load(sharded)
    assert report["files"] == [str(f) for f in source.files]
    _assert_same_forward(reference, model)


def test_the_original_release_layout_loads_through_the_adapter(reference, tmp_path):
    from safetensors.torch import save_file

    adapter = WanFamily().state_dict_adapter("original")
    state = adapter.convert_from_relay(reference.state_dict())
    assert "blocks.0.self_attn.q.weight" in state
    release = tmp_path / "Wan2.1-tiny"
    release.mkdir()
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: state[k].contiguous() for k in part},
                  str(release / f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"))
    model, report = _load(release)
    assert report["layout"] == "original" and report["missing"] == report["unexpected"] == []
    _assert_same_forward(reference, model)
    # the release's own config.json (class WanModel) gives the architecture
    (release / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "_diffusers_version": "0.30.0", "model_type": "t2v",
        "patch_size": [1, 4, 4], "dim": 16, "num_heads": 2, "in_dim": 3, "out_dim": 3,
        "text_dim": 32, "freq_dim": 32, "ffn_dim": 32, "num_layers": 2, "eps": 1e-6,
        "text_len": 512}))
    settings = {"pretrained_transformer_path": str(release), "load_transformer_weights": True}
    config = WanFamily().config({}, settings)
    assert {k: config[k] for k in TINY} == {**TINY, "rope_max_seq_len": 1024}  # the release's
    i2v = json.loads((release / "config.json").read_text()) | {"model_type": "i2v"}
    (release / "config.json").write_text(json.dumps(i2v))
    with pytest.raises(ValueError, match="text-to-video ones"):
        WanFamily().config({}, settings)


def test_the_config_comes_from_the_directory_and_disagreeing_overrides_are_refused(single):
    from trainer.models.family import ConfigDirError

    family = WanFamily()
    settings = {"pretrained_transformer_path": str(single), "load_transformer_weights": True}
    config = family.config({}, settings)
    assert {k: config[k] for k in TINY} == TINY
    assert family.config({"num_layers": 2, "attention_backend": "sdpa"}, settings)[
        "attention_backend"] == "sdpa"
    with pytest.raises(ConfigDirError, match="num_layers: overrides 4, directory 2"):
        family.config({"num_layers": 4, "ffn_dim": 32}, settings)
    # no weights loaded: the overrides are the config
    assert family.config({}, {**settings, "load_transformer_weights": False})["num_layers"] == 30


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _train(tmp_path: Path, path: Path, *extra: str, overrides: str = "{}", dry_run: bool = False):
    data = tmp_path.parent / "data"  # one embedded data set for every run of this module
    argv = [sys.executable, "trainer/train.py", "--config", "config/tiny/pretrain.yaml",
            "--model_family", "wan", "--pretrained_transformer_path", str(path),
            "--load_transformer_weights", "true", "--transformer_config_overrides", overrides,
            # the embedded data's stand-in captions, not the (absent) text_encoder/ a pipeline
            # directory would give by default (docs/wan.md)
            "--text_encoder", "standin", "--text_max_tokens", "8",
            "--train_batch_size", "4", "--synthetic_num_samples", "16", "--max_steps", "2",
            "--log_interval", "1", "--validation_interval", "-1", "--data_path", str(data),
            "--output_dir", str(tmp_path / "run"), *extra]
    if dry_run:
        argv.append("--dry-run")
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)


def test_a_run_starts_from_the_diffusers_directory(single, tmp_path):
    proc = _train(tmp_path, single)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    report = json.loads((out / "warm-start.json").read_text())
    assert report["layout"] == "diffusers" and report["missing"] == [] and report["loaded"]


def _refused(proc, *needles):
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, (needle, text[-3000:])


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_refusals_at_dry_run(single, sharded, tmp_path):
    # no transformer/config.json
    no_config = _copy(single, tmp_path / "no-config")
    (no_config / "transformer" / "config.json").unlink()
    _refused(_train(tmp_path / "a", no_config, dry_run=True), str(no_config), "does not exist",
             "point pretrained_transformer_path at a complete Wan diffusers directory")
    # no safetensors
    no_weights = _copy(single, tmp_path / "no-weights")
    (no_weights / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    _refused(_train(tmp_path / "b", no_weights, dry_run=True), str(no_weights / "transformer"),
             "holds no safetensors weights", "fetch transformer/ again")
    # an index naming a missing shard
    partial = _copy(sharded, tmp_path / "partial")
    shard = sorted((partial / "transformer").glob("*-00002-of-*.safetensors"))[0]
    shard.unlink()
    _refused(_train(tmp_path / "c", partial, dry_run=True), shard.name, "fetch the missing shards")
    # another class: a VAE's folder, and a DiT's config in transformer/
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16}))
    _refused(_train(tmp_path / "d", vae, dry_run=True), str(vae / "config.json"),
             "describes a AutoencoderKLWan, not a WanTransformer3DModel")
    dit = _copy(single, tmp_path / "dit")
    (dit / "transformer" / "config.json").write_text(json.dumps({"_class_name": "DiTTransformer",
                                                                 "num_layers": 2}))
    _refused(_train(tmp_path / "e", dit, dry_run=True), "describes a DiTTransformer")
    # overrides that disagree with the directory
    _refused(_train(tmp_path / "f", single, overrides="{num_layers: 3, text_dim: 32}", dry_run=True),
             "num_layers: overrides 3, directory 2", "remove num_layers from transformer_config_overrides")
    # the directory's in_channels / text_dim disagree with the data's latents and captions
    wide = _copy(single, tmp_path / "wide")
    config = json.loads((wide / "transformer" / "config.json").read_text())
    (wide / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 16,
                                                                  "text_dim": 64}))
    from trainer.data.synthetic import ensure_dataset

    data = ensure_dataset(tmp_path / "shards", 8, seed=0)  # 3-channel latents, 32-wide captions
    proc = _train(tmp_path / "g", wide, "--synthetic_data", "false", "--data_path", str(data),
                  dry_run=True)
    _refused(proc, "in_channels is 16", "text_dim is 64", str(wide / "transformer" / "config.json"),
             "point data_path at latents of that model's VAE")


def test_the_weights_source_is_torch_free_for_a_directory(single):
    code = ("import sys\nfrom trainer.checkpoint.weights_source import resolve_weights_source\n"
            f"s = resolve_weights_source({str(single)!r}, weights='live')\n"
            "print('KIND', s.kind, 'TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert "KIND safetensors_dir TORCH False" in proc.stdout, proc.stdout + proc.stderr
    empty = single.parent / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(CheckpointError, match="holds no weights"):
        resolve_weights_source(empty, weights="live")
