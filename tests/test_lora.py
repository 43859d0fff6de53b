"""LoRA through peft (docs/lora.md): a tiny random Wan (diffusers layout) LoRA-tuned for a few
steps through trainer/train.py; only the adapters move and only they are saved; the peft
export loads in diffusers and reproduces relay's output; the merged export is base + adapter;
exports follow the umask; resume is bit-exact in one process and at dp=2; a changed base is
refused by a resume and by every export; the DiT family
trains a LoRA too; what relay refuses, it refuses at --dry-run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.ports import free_port

from trainer.checkpoint.dcp_io import read_dcp_tensor_shapes
from trainer.resolve import resolve_config
from trainer.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# Fits the embedded synthetic data: 3-channel 16x16 frames, 32-wide captions.
TINY = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 3, "out_channels": 3, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6, "rope_max_seq_len": 64}
RANK, ALPHA = 4, 8.0
STEPS = 4


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                "SLURM_PROCID", "SLURM_NTASKS", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _argv(root: Path, base: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "config/tiny/pretrain.yaml", "--model_family", "wan",
            "--pretrained_transformer_path", str(base), "--load_transformer_weights", "true",
            "--transformer_config_overrides", "{}", "--lora_rank", str(RANK),
            "--lora_alpha", str(ALPHA),  # the wan family's default targets
            "--use_muon", "true", "--use_ema", "true", "--ema_decay", "0.5",
            "--warmup_steps", "0", "--train_batch_size", "4", "--synthetic_num_samples", "32",
            "--max_steps", str(STEPS), "--save_interval", "2", "--save_total_limit", "0",
            "--log_interval", "1", "--validation_interval", "-1", "--deterministic", "true",
            "--data_path", str(root / "data"), "--output_dir", str(out), *extra]


def _train(argv: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "trainer/train.py", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), "trainer/train.py", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _resume_copy(run: Path, out: Path, step: int) -> None:
    """An output_dir holding only `run`'s checkpoint-<step> (and its metrics up to it)."""
    out.mkdir(parents=True)
    shutil.copytree(run / f"checkpoint-{step}", out / f"checkpoint-{step}")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(
        line + "\n" for line in lines if json.loads(line)["step"] <= step))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def reference():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**TINY).eval()


@pytest.fixture(scope="module")
def base(root, reference):
    """A diffusers transformer/ folder (config.json + safetensors), the LoRA's frozen base."""
    path = root / "base" / "transformer"
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(root, base):
    """One LoRA SFT run of the tiny Wan: STEPS steps, checkpoints at 2 and 4."""
    out = root / "run"
    _ok(_train(_argv(root, base, out)))
    return out


def _inference_model(checkpoint: Path, weights: str):
    from trainer.evaluation.inference import load_model_for_inference

    return load_model_for_inference(checkpoint, weights).model


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 2, 16, 16, generator=g), torch.tensor([900.0, 37.5]),
            torch.randn(2, 5, 32, generator=g))


def test_only_the_adapters_train_and_are_saved(run, base):
    from safetensors.torch import load_file

    losses = _losses(run)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    checkpoint = run / f"checkpoint-{STEPS}"
    for member in ("transformer", "ema"):
        keys = set(read_dcp_tensor_shapes(checkpoint / member))
        assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys), keys
        assert len(keys) == 2 * 8 * TINY["num_layers"]  # A and B of 8 layers a block
    optimizer = set(read_dcp_tensor_shapes(checkpoint / "optimizer"))
    assert optimizer and all(".lora_" in k for k in optimizer)
    recorded = json.loads((checkpoint / "lora-base.json").read_text())
    assert recorded["path"] == str(base) and recorded["algorithm"] == "xxh3_64"
    assert any(f["name"] == "diffusion_pytorch_model.safetensors" for f in recorded["files"])
    # The model rebuilt from the checkpoint: its base is the base file's, bit for bit; the
    # adapters moved away from B = 0.
    model = _inference_model(checkpoint, "live")
    stored = load_file(str(base / "diffusion_pytorch_model.safetensors"))
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
             if ".lora_" not in k}
    assert state.keys() == stored.keys()
    assert all(torch.equal(state[k], stored[k]) for k in stored)
    lora_b = [v for k, v in model.state_dict().items() if ".lora_B." in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)


def test_the_peft_export_loads_in_diffusers_and_reproduces_relays_output(run, base, root):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE  # pytorch_lora_weights.safetensors

    from trainer.evaluation.export import export_checkpoint

    out = root / "adapter"
    lines = export_checkpoint(run, out, format="peft", weights="ema")
    assert "adapter_model.safetensors" in lines[0] and LORA_WEIGHT_NAME_SAFE in lines[0]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    # diffusers' default name holds the same file as peft's (tensors and the LoraConfig metadata).
    assert (out / LORA_WEIGHT_NAME_SAFE).read_bytes() == (out / "adapter_model.safetensors").read_bytes()
    relay = _inference_model(run / f"checkpoint-{STEPS}", "ema")
    x, t, text = _inputs()
    with torch.no_grad():
        want = relay(x, t, text)
        plain = WanTransformer3DModel.from_pretrained(str(base)).eval()(x, t, text).sample
    assert (want - plain).abs().max() > 1e-4  # the adapter changes the output
    # The directory with no weight_name (diffusers then takes the file under its default name),
    # the file by that name, and peft's file by its name: each applies lora_alpha / r.
    for how in ({"use_safetensors": True}, {"weight_name": LORA_WEIGHT_NAME_SAFE},
                {"weight_name": "adapter_model.safetensors"}):
        theirs = WanTransformer3DModel.from_pretrained(str(base)).eval()
        theirs.load_lora_adapter(str(out), **how)
        assert theirs.peft_config["default_0"].lora_alpha == ALPHA, how
        with torch.no_grad():
            got = theirs(x, t, text).sample
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{how}: {m}")


def test_a_wan_pipeline_loads_the_export_with_load_lora_weights(run, base, root, reference):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from trainer.evaluation.export import export_checkpoint

    out = root / "adapter-live"
    export_checkpoint(run, out, format="peft", weights="live")
    transformer = WanTransformer3DModel.from_pretrained(str(base)).eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.load_lora_weights(str(out))
    x, t, text = _inputs()
    with torch.no_grad():
        want = _inference_model(run / f"checkpoint-{STEPS}", "live")(x, t, text)
        got = pipe.transformer(x, t, text).sample
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_merged_weights_are_base_plus_adapter(run, base):
    from safetensors.torch import load_file

    from trainer.evaluation.export import read_export_source
    from trainer.evaluation.lora_export import merged_state_dict
    from trainer.checkpoint.lora_weights import checkpoint_adapters
    from trainer.models.registry import get_family

    source = read_export_source(run, "ema")
    merged = merged_state_dict(source)
    stored = load_file(str(base / "diffusion_pytorch_model.safetensors"))
    adapters = checkpoint_adapters(run / f"checkpoint-{STEPS}", weights="ema")
    assert merged.keys() == stored.keys()
    scale = ALPHA / RANK
    adapted = {k.rsplit(".lora_", 1)[0] + ".weight" for k in adapters}
    assert len(adapted) == 8 * TINY["num_layers"]
    for key, value in stored.items():
        if key in adapted:
            layer = key[: -len(".weight")]
            want = value + scale * adapters[f"{layer}.lora_B.weight"] @ adapters[f"{layer}.lora_A.weight"]
            assert torch.equal(merged[key], want), key
        else:
            assert torch.equal(merged[key], value), key
    # A plain wan module with the merged weights computes what the LoRA model computes.
    family = get_family("wan")
    plain = family.build(source.model_config)
    plain.load_state_dict(merged)
    x, t, text = _inputs()
    with torch.no_grad():
        want = _inference_model(run / f"checkpoint-{STEPS}", "ema")(x, t, text)
        got = plain.eval()(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merged_exports_as_diffusers_and_relay_and_a_lora_needs_the_flag(run, root):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from trainer.evaluation.export import ExportError, export_checkpoint
    from trainer.evaluation.export import read_export_source
    from trainer.evaluation.lora_export import merged_state_dict

    for fmt, out in (("relay", root / "flat" / "model.safetensors"), ("diffusers", root / "merged")):
        with pytest.raises(ExportError, match="holds the adapters only.*--merge-lora"):
            export_checkpoint(run, out, format=fmt)
    export_checkpoint(run, root / "merged", format="diffusers", merge_lora=True)
    export_checkpoint(run, root / "flat" / "model.safetensors", format="relay", merge_lora=True)
    merged = merged_state_dict(read_export_source(run, "ema"))
    flat = load_file(str(root / "flat" / "model.safetensors"))
    assert flat.keys() == merged.keys() and all(torch.equal(flat[k], merged[k]) for k in merged)
    theirs = WanTransformer3DModel.from_pretrained(str(root / "merged" / "transformer")).eval()
    x, t, text = _inputs()
    with torch.no_grad():
        want = _inference_model(run / f"checkpoint-{STEPS}", "ema")(x, t, text)
        got = theirs(x, t, text).sample
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_export_is_as_readable_as_the_umask_says(run, root):
    from trainer.evaluation.export import export_checkpoint

    for mask in (0o022, 0o027):
        previous = os.umask(mask)
        try:
            peft, relay = root / f"umask-{mask:o}" / "peft", root / f"umask-{mask:o}" / "relay"
            export_checkpoint(run, peft, format="peft")
            export_checkpoint(run, relay / "model.safetensors", format="relay", merge_lora=True)
        finally:
            os.umask(previous)
        written = [peft / "adapter_model.safetensors", peft / "pytorch_lora_weights.safetensors",
                   peft / "adapter_config.json",
                   relay / "model.safetensors", relay / "model_config.json"]
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == \
            {p.name: oct(0o666 & ~mask) for p in written}


def test_a_peft_export_of_a_run_whose_base_changed_is_refused_as_a_merge_is(run, root, base,
                                                                           capsys):
    from safetensors.torch import load_file, save_file

    from launcher.cli import main as relay_main

    file = base / "diffusion_pytorch_model.safetensors"
    kept = file.with_name(file.name + ".kept")
    state = load_file(str(file))
    key = sorted(state)[0]
    state[key] = state[key] + 1.0  # same names, shapes and size: other values
    os.replace(file, kept)  # put back as it was (the same file, mtime and all) below
    try:
        save_file(state, str(file), metadata={"format": "pt"})
        refusals = []
        for argv in (["--format", "peft", "--out", str(root / "peft-on-changed")],
                     ["--format", "relay", "--merge-lora",
                      "--out", str(root / "merged-on-changed" / "model.safetensors")]):
            code = relay_main(["export", str(run), *argv])
            captured = capsys.readouterr()
            assert code == 2, captured.out + captured.err
            refusals.append(captured.err)
    finally:
        os.replace(kept, file)
    assert refusals[0] == refusals[1]
    assert refusals[0].startswith(f"relay export: the LoRA base changed since checkpoint-{STEPS} "
                                  f"was trained on it") and len(refusals[0].splitlines()) == 1
    assert "the same files and sizes with other contents" in refusals[0]
    assert not (root / "peft-on-changed").exists()


def _adapters_equal(a: Path, b: Path) -> None:
    from trainer.checkpoint.lora_weights import checkpoint_adapters

    for weights in ("live", "ema"):
        x, y = checkpoint_adapters(a, weights=weights), checkpoint_adapters(b, weights=weights)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), weights


def test_resume_is_bit_exact(run, root, base):
    out = root / "resumed"
    _resume_copy(run, out, 2)
    _ok(_train(_argv(root, base, out)))
    assert _losses(out) == _losses(run)
    _adapters_equal(run / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")


@pytest.fixture(scope="module")
def dp2(root, base):
    """The LoRA run of `run` on two data-parallel ranks (gloo)."""
    two = root / "dp2"
    _ok(_train(_argv(root, base, two), nproc=2))
    return two


def test_resume_at_two_ranks_is_bit_exact(root, base, dp2):
    two = dp2
    out = root / "dp2-resumed"
    _resume_copy(two, out, 2)
    _ok(_train(_argv(root, base, out), nproc=2))
    assert _losses(out) == _losses(two)
    _adapters_equal(two / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")


def test_context_parallel_trains_the_adapters_as_data_parallel_does(root, base, dp2):
    # Ulysses over two ranks, one data-parallel group of 8 samples, sees the global batch of two
    # data-parallel ranks of 4; the sequence split changes only the order of float sums.
    out = root / "cp2"
    _ok(_train(_argv(root, base, out, "--cp_size", "2", "--train_batch_size", "8"), nproc=2))
    from trainer.checkpoint.lora_weights import checkpoint_adapters

    got, want = _losses(out), _losses(dp2)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5)
    a, b = (checkpoint_adapters(run / f"checkpoint-{STEPS}", weights="live") for run in (out, dp2))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


def test_a_base_that_changed_is_refused(run, root, base):
    from safetensors.torch import load_file, save_file

    changed = root / "changed-base"
    shutil.copytree(base, changed)
    file = changed / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    key = sorted(state)[0]
    state[key] = state[key] + 1.0  # same names, shapes and size: other values
    save_file(state, str(file), metadata={"format": "pt"})
    out = root / "on-changed-base"
    _resume_copy(run, out, 2)
    proc = _train(_argv(root, changed, out))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "the LoRA base changed since checkpoint-2 was trained on it" in text
    assert "the same files and sizes with other contents" in text and "Traceback" not in text
    # Another rank than the checkpoint's is named as such, before the job would start
    # (tests/test_preflight_weights.py: at --dry-run and by relay submit too).
    other = root / "other-rank"
    _resume_copy(run, other, 2)
    proc = _train(_argv(root, base, other, "--lora_rank", "8"))
    assert proc.returncode == 2 and "saved with lora_rank: 4; this run has lora_rank: 8" in \
        proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    # A copy of the unchanged base elsewhere is the same base: it resumes.
    copy = root / "base-copy"
    shutil.copytree(base, copy)
    from trainer.checkpoint.lora_base import check_base, read_recorded_base

    check_base(copy, "live", read_recorded_base(run / "checkpoint-2"), "checkpoint-2")


def test_the_dit_family_trains_a_lora_under_selective_checkpointing(root):
    from safetensors.torch import save_file

    from trainer.models.registry import get_family

    model = "{hidden_size: 32, num_attention_heads: 2, num_layers: 2, rope_axes_dim: [4, 6, 6], text_dim: 32, patch_size: [1, 4, 4], in_channels: 3}"
    family = get_family("dit")
    config = family.config({"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
                            "rope_axes_dim": [4, 6, 6], "text_dim": 32, "patch_size": [1, 4, 4],
                            "in_channels": 3}, {"zero_init_modulation": False})
    torch.manual_seed(0)
    base = root / "dit-base.safetensors"
    save_file({k: v.contiguous() for k, v in family.build(config).state_dict().items()}, str(base))
    # The family's linear layers as the login node lists them are the module's.
    built = {n: (m.in_features, m.out_features) for n, m in family.build(config).named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert family.linear_shapes(config) == built
    out = root / "dit"
    proc = _train(["--config", "config/tiny/sft.yaml", "--transformer_config_overrides", model,
                   "--pretrained_transformer_path", str(base), "--lora_rank", "2",
                   "--train_batch_size", "4", "--synthetic_num_samples", "32", "--max_steps", "2",
                   "--warmup_steps", "0", "--log_interval", "1", "--validation_interval", "-1",
                   "--enable_gradient_checkpointing", "true",
                   "--use_dedicated_gradient_checkpointing", "true",
                   "--data_path", str(root / "data"), "--output_dir", str(out)])
    _ok(proc)
    keys = set(read_dcp_tensor_shapes(out / "checkpoint-2" / "transformer"))
    assert keys == {f"blocks.{i}.{m}.lora_{ab}.default.weight" for i in range(2)
                    for m in ("qkv", "proj") for ab in "AB"}
    assert "LoRA rank 2 on 4 linear layers" in proc.stdout + proc.stderr


def _resolve(tmp_path: Path, base: Path, **overrides) -> None:
    values = {"model_family": "wan", "pretrained_transformer_path": str(base),
              "load_transformer_weights": True, "transformer_config_overrides": {},
              "lora_rank": RANK, "lora_target_modules": ["to_q"],
              "data_path": str(tmp_path / "data"), "output_dir": str(tmp_path / "out"),
              "validation_interval": -1, **overrides}
    resolve_config(str(ROOT / "config" / "tiny" / "pretrain.yaml"), values, world_size=1,
                   check_weights=True)


def test_what_relay_refuses_it_refuses_before_the_run(tmp_path, base):
    _resolve(tmp_path, base)  # the accepted form
    cases = [
        ({"stage": "dmd_sgf"}, "stage dmd_sgf does not train a LoRA"),
        ({"load_transformer_weights": False, "pretrained_transformer_path": None,
          "transformer_config_overrides": TINY},
         "a LoRA adapts frozen base weights, and none are named"),
        ({"model_family": "dit", "lora_target_modules": ["qkvv", "norm1"],
          "transformer_config_overrides": {"hidden_size": 32, "num_attention_heads": 2,
                                           "num_layers": 1, "rope_axes_dim": [4, 6, 6],
                                           "text_dim": 32, "patch_size": [1, 4, 4],
                                           "in_channels": 3}},
         "'qkvv' names no module; 'norm1' names no module"),
        ({"lora_dropout": 1.0}, "lora_dropout must lie in [0, 1)"),
        ({"lora_alpha": 0.0}, "lora_alpha must be > 0"),
        ({"lora_rank": 0, "lora_target_modules": [], "lora_init_path": str(tmp_path)},
         "lora_init_path is set but lora_rank is 0"),
        ({"lora_init_path": str(tmp_path / "nowhere")}, "`lora_init_path` " + str(tmp_path / "nowhere")),
    ]
    for overrides, needle in cases:
        with pytest.raises(ConfigError) as caught:
            _resolve(tmp_path, base, **overrides)
        assert needle in str(caught.value), (overrides, str(caught.value))
    # One paragraph at --dry-run, with every problem of the run in it.
    proc = subprocess.run([sys.executable, "trainer/train.py", *_argv(tmp_path, base, tmp_path / "o",
                           "--stage", "tf_anyflow", "--lora_dropout", "2"), "--dry-run"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "Stage1 turns a bidirectional single-time model" in proc.stderr or \
        "stage tf_anyflow needs what model family" in proc.stderr


@pytest.mark.parametrize("two_time", [False, True])
def test_the_wan_familys_linear_layers_are_its_modules(two_time):
    from trainer.models.registry import get_family

    family = get_family("wan")
    config = family.config({**TINY, "two_time": two_time})
    built = {n: (m.in_features, m.out_features) for n, m in family.build(config).named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert family.linear_shapes(config) == built
    assert family.lora_target_modules == ("attn1.to_q", "attn1.to_k", "attn1.to_v",
                                          "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                                          "attn2.to_v", "attn2.to_out.0")


def test_the_memory_estimate_counts_a_frozen_base_and_the_adapters():
    from trainer.models.lora_targets import adapter_param_count, match_targets
    from trainer.models.registry import get_family
    from trainer.models.wan.linears import WAN_LORA_TARGETS, wan_linear_shapes
    from trainer.checks.memory import estimate_memory

    family = get_family("wan")
    config = family.config({})  # Wan2.1-T2V-1.3B
    shapes = wan_linear_shapes(config)
    targets = match_targets(shapes, WAN_LORA_TARGETS)
    adapters = adapter_param_count(shapes, targets, 16)
    assert adapters == 30 * 8 * 16 * (1536 + 1536)
    common = dict(stage="fm", use_muon=False, use_ema=True, shard_group=8, cp=1,
                  batch_per_rank=1, video_tokens=0, text_tokens=0, checkpointing=True)
    full = estimate_memory(family, config, **common)
    lora = estimate_memory(family, config, lora=True, lora_params=adapters, **common)
    p = family.param_counts(config).total
    # the frozen base's parameters, the adapters' parameters, AdamW moments and EMA; their
    # gradients apart, in the max() with the activations as a full role's are
    want = (4 * p + (4 + 8 + 4) * adapters) / 8 / 2**30
    assert lora.states_gib == pytest.approx(want)
    assert lora.gradients_gib == pytest.approx(4 * adapters / 8 / 2**30)
    assert full.gradients_gib == pytest.approx(4 * p / 8 / 2**30)
    assert lora.states_gib < full.states_gib / 3
    assert lora.total_gib == pytest.approx(lora.states_gib + lora.overhead_gib + lora.working_gib
                                           + max(lora.activations_gib, lora.gradients_gib))
    assert "LoRA adapters" in lora.describe() and "their gradients" in lora.describe()
