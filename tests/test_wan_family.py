"""The wan family: config from a diffusers directory, forward equal to diffusers'
WanTransformer3DModel on the same weights, per-frame times, exact parameter counts, the
original-layout key adapter, refusals, and a pretrain run through train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.models.registry import get_family
from trainer.models.wan.family import WanFamily

ROOT = Path(__file__).resolve().parents[1]
TINY = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6, "rope_max_seq_len": 64}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(diffusers model, relay model with its weights, the pipeline directory)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    torch.manual_seed(0)
    reference = WanTransformer3DModel(**TINY).eval()
    root = tmp_path_factory.mktemp("wan")
    reference.save_pretrained(root / "transformer")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    config = WanFamily().config_from_dir(str(root))
    model = WanFamily().build(config).eval()
    state = load_file(str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    model.load_state_dict(state, strict=True)
    return reference, model, root


def _inputs(seed=1, batch=2, frames=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, 8, 6, generator=g)
    t = torch.tensor([900.0, 37.5])[:batch]
    text = torch.randn(batch, 5, 16, generator=g)
    return x, t, text


def test_the_config_comes_from_the_pipeline_directory_or_its_transformer_folder(pair):
    _, _, root = pair
    family = WanFamily()
    config = family.config_from_dir(str(root))
    assert {k: config[k] for k in TINY} == TINY
    assert config["attention_backend"] == "auto" and config["image_dim"] is None
    assert family.config_from_dir(str(root / "transformer")) == config
    assert get_family("wan").defaults()["num_layers"] == 30


def test_relay_forward_equals_diffusers(pair):
    reference, model, _ = pair
    x, t, text = _inputs()
    with torch.no_grad():
        want = reference(x, t, text).sample
        got = model(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_caption_mask_equals_diffusers_on_the_zero_padded_caption(pair):
    reference, model, _ = pair
    x, t, text = _inputs(seed=2)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    with torch.no_grad():
        want = reference(x, t, text * mask[..., None]).sample
        got = model(x, t, text, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_per_frame_times(pair):
    reference, model, _ = pair
    x, t, text = _inputs(seed=3)
    with torch.no_grad():
        per_sample = model(x, t, text)
        same = model(x, t[:, None].expand(2, 3), text)
        assert torch.equal(per_sample, same)
        frames = torch.tensor([[0.0, 500.0, 999.0], [250.0, 250.0, 10.0]])
        got = model(x, frames, text)
        # diffusers takes a time per token (Wan2.2 TI2V): each frame's time on its 4 x 3 tokens
        want = reference(x, frames.repeat_interleave(12, dim=1), text).sample
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_conditioning_frame_at_t0_equals_diffusers_per_token_times_of_wan22_ti2v(pair):
    # Wan2.2 TI2V keeps the first latent frame clean: its pipeline gives diffusers a time per
    # token, 0 on the first frame's tokens (a mask over the latent grid, read at the patch
    # stride) and t on the rest. relay takes the same as a time per latent frame, frame 0 at 0.
    reference, model, _ = pair
    x, t, text = _inputs(seed=4)
    frames, height, width = x.shape[2:]
    mask = torch.ones(1, 1, frames, height, width)
    mask[:, :, 0] = 0
    per_token = torch.stack([(mask[0, 0][:, ::2, ::2] * value).flatten() for value in t])
    per_frame = t[:, None] * mask[0, 0, :, 0, 0][None]
    assert per_token.shape == (2, frames * 4 * 3) and per_frame.tolist()[0] == [0.0, 900.0, 900.0]
    with torch.no_grad():
        want = reference(x, per_token, text).sample
        got = model(x, per_frame, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_parameter_counts_and_flops_are_exact(pair):
    reference, model, _ = pair
    family = WanFamily()
    config = model.config
    counts = family.param_counts(config)
    assert counts.total == sum(p.numel() for p in reference.parameters())
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.per_block == sum(p.numel() for p in model.blocks[0].parameters())
    from trainer.optim.optimizers import is_muon_parameter

    assert counts.muon == sum(p.numel() for n, p in model.named_parameters() if is_muon_parameter(n, p))
    no_norm = {**config, "cross_attn_norm": False}
    assert family.param_counts(no_norm).total == sum(p.numel() for p in family.build(no_norm).parameters())
    geometry = family.geometry(config)
    assert (geometry.hidden_size, geometry.latent_channels, geometry.causal_chunk_frames,
            geometry.two_time) == (16, 4, None, False)
    assert model.geometry == geometry
    assert len(model.fsdp_units()) == len(model.checkpoint_units()) == 2


def test_the_original_wan_layout_round_trips_every_key(pair):
    _, model, _ = pair
    adapter = WanFamily().state_dict_adapter("original")
    state = model.state_dict()
    original = adapter.convert_from_relay(state)
    assert len(original) == len(state)
    assert adapter.convert_to_relay(original).keys() == state.keys()
    for relay, release in [
        ("blocks.0.attn1.to_q.weight", "blocks.0.self_attn.q.weight"),
        ("blocks.1.attn2.to_out.0.bias", "blocks.1.cross_attn.o.bias"),
        ("blocks.0.attn2.norm_k.weight", "blocks.0.cross_attn.norm_k.weight"),
        ("blocks.0.norm2.weight", "blocks.0.norm3.weight"),
        ("blocks.1.ffn.net.0.proj.weight", "blocks.1.ffn.0.weight"),
        ("blocks.1.ffn.net.2.bias", "blocks.1.ffn.2.bias"),
        ("blocks.0.scale_shift_table", "blocks.0.modulation"),
        ("scale_shift_table", "head.modulation"),
        ("proj_out.weight", "head.head.weight"),
        ("condition_embedder.time_proj.weight", "time_projection.1.weight"),
        ("condition_embedder.time_embedder.linear_2.bias", "time_embedding.2.bias"),
        ("condition_embedder.text_embedder.linear_1.weight", "text_embedding.0.weight"),
        ("patch_embedding.weight", "patch_embedding.weight"),
    ]:
        assert adapter.from_relay(relay) == release
        assert adapter.to_relay(release) == relay
    assert adapter.to_relay("model.diffusion_model.head.head.bias") == "proj_out.bias"
    assert WanFamily().state_dict_adapter("diffusers").convert_to_relay(state).keys() == state.keys()


def _write_config(path: Path, **config) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_refusals_of_another_model_an_i2v_one_and_two_experts(tmp_path):
    family = WanFamily()
    other = _write_config(tmp_path / "flux", _class_name="FluxTransformer2DModel", num_layers=19)
    with pytest.raises(ValueError, match="describes a FluxTransformer2DModel, not a WanTransformer3DModel"):
        family.config_from_dir(str(other))
    i2v = _write_config(tmp_path / "i2v", _class_name="WanTransformer3DModel", image_dim=1280,
                        added_kv_proj_dim=5120)
    with pytest.raises(ValueError, match="image-to-video"):
        family.config_from_dir(str(i2v))
    with pytest.raises(ValueError, match="qk_norm 'rms_norm' is not supported"):
        family.validate(family.config({"qk_norm": "rms_norm"}))
    moe = tmp_path / "a14b"
    _write_config(moe / "transformer", _class_name="WanTransformer3DModel")
    _write_config(moe / "transformer_2", _class_name="WanTransformer3DModel")
    with pytest.raises(ValueError, match="a run trains one expert") as info:
        family.config_from_dir(str(moe))
    assert "config/pipeline/wan-a14b.yaml" in str(info.value)
    assert "--other-expert" in str(info.value)
    assert family.config_from_dir(str(moe / "transformer_2"))["num_layers"] == 30
    with pytest.raises(ValueError, match="does not exist"):
        family.config_from_dir(str(tmp_path))


def test_context_parallel_attaches_to_every_block(pair):
    # tests/test_wan_capabilities.py runs every forward at cp = 2 against the unsplit model
    from trainer.parallel.context_parallel import Ulysses

    _, model, _ = pair
    model = WanFamily().build(model.config)
    ulysses = Ulysses(None, 2, 0, model.geometry.num_heads)
    model.attach_context_parallel(ulysses)
    assert model.ulysses is ulysses and all(b.ulysses is ulysses for b in model.blocks)


def test_a_wan_built_from_scratch_starts_adaln_zero_and_its_gates_open_as_it_trains():
    from trainer.parallel.distributed import materialise

    family = WanFamily()
    config = family.config(TINY, {"zero_init_modulation": True})
    x, t, text = _inputs()
    torch.manual_seed(0)
    model = family.build(config)
    assert torch.count_nonzero(model(x, t, text)) == 0
    with torch.device("meta"):  # the FSDP path: built on meta, initialised in place
        sharded = family.build(config)
    assert torch.count_nonzero(materialise(sharded, torch.device("cpu"))(x, t, text)) == 0
    torch.manual_seed(0)
    plain = family.build(family.config(TINY, {"zero_init_modulation": False}))
    assert torch.count_nonzero(plain(x, t, text)) > 0

    # flow-matching steps on one batch: the output head learns first, then the gates open
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gates = lambda: torch.stack([b.scale_shift_table[0, [2, 5]].abs().sum() for b in model.blocks])
    for _ in range(3):
        loss = (model(x, t, text) - torch.ones_like(x)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.count_nonzero(model(x, t, text)) > 0
    assert bool((gates() > 0).all())
    with pytest.raises(ValueError, match="top-level"):
        family.config({**TINY, "zero_init_modulation": False})


def test_the_family_trains_through_pretrain(tmp_path):
    overrides = ("{num_attention_heads: 2, attention_head_dim: 8, num_layers: 2, ffn_dim: 32, "
                 "in_channels: 3, out_channels: 3, text_dim: 32, freq_dim: 32, "
                 "patch_size: [1, 4, 4]}")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "trainer/train.py", "--config", "config/tiny/pretrain.yaml",
         "--model_family", "wan", "--transformer_config_overrides", overrides,
         "--train_batch_size", "4", "--synthetic_num_samples", "32", "--max_steps", "3",
         "--log_interval", "1", "--validation_interval", "-1", "--data_path",
         str(tmp_path / "data"), "--output_dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in records)


def test_preflight_takes_context_parallel_for_wan(tmp_path):
    from trainer.resolve import resolve_config
    from trainer.config.schema import ConfigError

    overrides = {"model_family": "wan", "cp_size": 2, "output_dir": str(tmp_path),
                 "transformer_config_overrides": {"num_attention_heads": 2, "attention_head_dim": 8,
                                                  "num_layers": 2, "in_channels": 3,
                                                  "out_channels": 3, "text_dim": 32,
                                                  "patch_size": [1, 4, 4]}}
    tiny = str(ROOT / "config/tiny/pretrain.yaml")
    resolve_config(tiny, overrides, check_paths=False)
    odd = {**overrides, "cp_size": 4}  # 2 heads do not split over 4 ranks
    with pytest.raises(ConfigError, match="attention heads"):
        resolve_config(tiny, odd, check_paths=False)


def test_the_family_imports_without_torch():
    code = ("import sys, trainer.models.wan.family, trainer.models.registry\n"
            "print('TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert "TORCH False" in proc.stdout, proc.stdout + proc.stderr
