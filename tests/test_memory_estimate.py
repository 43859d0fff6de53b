"""The topology and memory a stage is checked for before it starts (trainer.parallel.topology,
trainer.checks.memory, trainer.preflight.describe_plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.resolve import resolve_config
from trainer.models.dit.family import DiTFamily
from trainer.models.registry import get_family
from trainer.checks.memory import estimate_memory
from trainer.preflight import describe_plan
from trainer.config.schema import ConfigError
from trainer.parallel.topology import plan_mesh

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "config" / "tiny" / "pretrain.yaml")
PRODUCTION = str(REPO / "config" / "pretrain.yaml")


@pytest.mark.parametrize("overrides", [
    {},
    {"hidden_size": 64, "num_attention_heads": 2, "num_layers": 3, "mlp_ratio": 2.5,
     "qk_norm": False, "rope_axes_dim": [8, 12, 12]},
    {"two_time": True, "causal_chunk_size": 2, "out_channels": 6, "text_dim": 48},
])
def test_parameter_count_is_the_real_models(overrides):
    family = DiTFamily()
    cfg = family.config(overrides)
    model = family.build(cfg)
    counts = family.param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.per_block == sum(p.numel() for p in model.blocks[0].parameters())
    assert counts.second_time == sum(p.numel() for n, p in model.named_parameters()
                                     if n.startswith("r_embedder."))


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's environment already had."""
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])


def test_mesh_splits_hybrid_shard_by_node_or_explicit_group():
    full = plan_mesh(16, cp_size=2, hybrid_shard=False, shard_group_size=None, ranks_per_node=8)
    assert (full.dp_replicate, full.dp_shard, full.cp, full.shard_group) == (1, 8, 2, 16)
    node = plan_mesh(16, cp_size=2, hybrid_shard=True, shard_group_size=None, ranks_per_node=8)
    assert (node.dp_replicate, node.dp_shard, node.cp, node.dp_world) == (2, 4, 2, 8)
    explicit = plan_mesh(4, cp_size=1, hybrid_shard=True, shard_group_size=2, ranks_per_node=4)
    assert (explicit.dp_replicate, explicit.dp_shard) == (2, 2)


@pytest.mark.parametrize("world, kwargs, says", [
    (6, dict(cp_size=4, hybrid_shard=False, shard_group_size=None), "6 is not divisible by cp_size 4"),
    (6, dict(cp_size=1, hybrid_shard=True, shard_group_size=4), "6 / 4 = 1.5 replicas"),
    (8, dict(cp_size=4, hybrid_shard=True, shard_group_size=2), "not a multiple of cp_size 4"),
    (8, dict(cp_size=1, hybrid_shard=False, shard_group_size=2), "would be ignored"),
])
def test_bad_splits_are_refused_with_the_arithmetic(world, kwargs, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("/", "/")):
        plan_mesh(world, ranks_per_node=8, **kwargs)


def test_sharding_divides_the_states_and_cp_the_activations_of_video_and_caption():
    cfg = resolve_config(PRODUCTION, {}, check_paths=False)
    from trainer.models.registry import model_config

    common = dict(stage="fm", use_muon=False, use_ema=False, batch_per_rank=1,
                  video_tokens=75600, text_tokens=512, checkpointing=True)
    one = estimate_memory(DiTFamily(), model_config(cfg), shard_group=1, cp=1, **common)
    eight = estimate_memory(DiTFamily(), model_config(cfg), shard_group=8, cp=2, **common)
    assert eight.states_gib == pytest.approx(one.states_gib / 8)
    assert eight.activations_gib == pytest.approx(one.activations_gib * (37800 + 256) / 76112)
    # A caption that 4 ranks split only once padded: 513 tokens take 129 a rank.
    four = estimate_memory(DiTFamily(), model_config(cfg), shard_group=8, cp=4,
                           **{**common, "text_tokens": 513})
    assert four.activations_gib == pytest.approx(one.activations_gib * (18900 + 129) / 76112)
    assert "19029 tokens per rank (batch 1 x (75600 video + 513 caption) / cp 4)" in four.describe()
    no_ckpt = estimate_memory(DiTFamily(), model_config(cfg), shard_group=1, cp=1,
                              **{**common, "checkpointing": False})
    assert no_ckpt.activations_gib > 5 * one.activations_gib


def test_the_production_pretrain_fits_an_h200_and_a_longer_clip_is_refused_with_the_arithmetic():
    args = resolve_config(PRODUCTION, {}, world_size=1920, check_paths=False)
    plan = describe_plan(args, 1920, 8)
    assert "world 1920 = dp_replicate 240 x dp_shard 8 x cp 1" in plan
    assert "= 1920 samples a step" in plan
    longer = resolve_config(PRODUCTION, {"expected_latent_shape": [16, 41, 90, 160]},
                            world_size=1920, check_paths=False)
    with pytest.raises(ConfigError) as err:  # 161 frames instead of 41: 3.7x the activations
        describe_plan(longer, 1920, 8)  # (the node size, and so the shard group, is known here)
    message = str(err.value)
    assert "does not fit the GPU" in message and "gpu_memory_gib is 141" in message
    assert "activations: 147608 tokens per rank" in message  # the arithmetic is shown
    assert "(147600 video + 8 caption) / cp 1" in message


def _dry_run(*extra: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": _pythonpath(), **env}
    return subprocess.run([sys.executable, str(REPO / "trainer" / "train.py"), "--config", TINY,
                           "--output_dir", "/tmp/unused", "--dry-run", *extra],
                          capture_output=True, text=True, env=environ, timeout=120)


def test_dry_run_prints_topology_and_memory_beside_the_json():
    proc = _dry_run("--hybrid_shard", "true", "--train_batch_size", "4",
                    RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lstrip().startswith("{")
    assert "world 4 = dp_replicate 2 x dp_shard 2 x cp 1" in proc.stderr
    assert "train_batch_size 4 x gradient accumulation 1 x dp 4 = 16 samples" in proc.stderr
    assert "total ~" in proc.stderr


def test_dry_run_refuses_a_bad_topology_without_a_traceback():
    proc = _dry_run("--hybrid_shard", "true", "--shard_group_size", "4",
                    RANK="0", WORLD_SIZE="6", LOCAL_WORLD_SIZE="6")
    assert proc.returncode == 2
    assert "6 / 4 = 1.5 replicas" in proc.stderr and "Traceback" not in proc.stderr


def test_the_production_pipeline_plans_each_stage_with_its_topology_and_memory():
    from launcher.pipeline import validate_pipeline

    pipeline = validate_pipeline(REPO / "config" / "pipeline" / "production-example.yaml",
                                 root="/tmp/relay-unit-root", cwd=REPO, check_paths=False,
                                 only="pretrain")
    plan = pipeline.stage("pretrain").plan
    assert "world 1920 = dp_replicate 240 x dp_shard 8 x cp 1" in plan
    assert "total ~" in plan and "GiB per GPU" in plan


def _activations(plan: str) -> tuple[str, str]:
    """(tokens per rank, GiB) of the plan's activations line."""
    line = next(line for line in plan.splitlines() if "activations:" in line)
    return line.split("activations: ")[1].split()[0], line.split(" = ")[-1].split()[0]


def test_a_pack_budget_sets_the_activations_whatever_the_batch_and_clip_keys_say():
    budget = {"packing_token_budget": 40000}
    plans = [describe_plan(resolve_config(PRODUCTION, {**budget, **keys}, world_size=1920,
                                          check_paths=False), 1920, 8)
             # (the global batch stays 1920: under packing it counts packs, not samples)
             for keys in ({}, {"train_batch_size": 4},
                          {"expected_latent_shape": [16, 41, 90, 160]})]
    seen = {_activations(plan) for plan in plans}
    # one pack of 40000 tokens, however the clips are cut or batched
    assert len(seen) == 1 and next(iter(seen))[0] == "40000"
    assert "activations: 40000 tokens per rank (one pack of packing_token_budget 40000" in plans[0]
    assert "1 pack of <= 40000 joint tokens" in plans[0] and "= 1920 packs a step" in plans[0]
    unpacked = describe_plan(resolve_config(PRODUCTION, {}, world_size=1920, check_paths=False),
                             1920, 8)
    assert "activations: 39608 tokens per rank" in unpacked  # 11 x 45 x 80 video + 8 caption


def test_teacher_forcing_packs_count_clean_and_noisy_video_and_cp_splits_both_streams():
    from trainer.models.registry import model_config

    cfg = model_config(resolve_config(PRODUCTION, {}, check_paths=False))
    common = dict(use_muon=False, use_ema=False, shard_group=8, batch_per_rank=1,
                  checkpointing=True, pack_budget=10100, video_tokens=10000, text_tokens=100)
    fm = estimate_memory(DiTFamily(), cfg, stage="fm", cp=1, **common)
    tf = estimate_memory(DiTFamily(), cfg, stage="tf_anyflow", cp=1, **common)
    tf_cp = estimate_memory(DiTFamily(), cfg, stage="tf_anyflow", cp=4, **common)
    # 10000 video + 100 caption tokens: fm holds them once, teacher forcing the video twice,
    # and cp 4 splits the 20000 video and the 100 caption tokens: 5000 + 25 a rank.
    assert tf.activations_gib == pytest.approx(fm.activations_gib * 20100 / 10100)
    assert tf_cp.activations_gib == pytest.approx(fm.activations_gib * 5025 / 10100)
    # No sample shape known: all video, which teacher forcing runs twice.
    unknown = estimate_memory(DiTFamily(), cfg, stage="tf_anyflow", cp=4, **{**common, "video_tokens": 0})
    assert unknown.activations_gib == pytest.approx(fm.activations_gib * 5050 / 10100)
    assert "no sample shape known" in unknown.describe()


def test_a_budget_that_cannot_fit_is_refused_with_the_arithmetic_and_the_largest_that_fits():
    args = resolve_config(PRODUCTION, {"packing_token_budget": 200000}, world_size=1920,
                          check_paths=False)
    with pytest.raises(ConfigError) as err:
        describe_plan(args, 1920, 8)
    message = str(err.value)
    assert "does not fit the GPU" in message and "gpu_memory_gib is 141" in message
    assert "activations: 200000 tokens per rank" in message
    largest = int(message.split("lower packing_token_budget to at most ~")[1].split()[0])
    assert 40000 < largest < 200000
    fits = resolve_config(PRODUCTION, {"packing_token_budget": largest}, world_size=1920,
                          check_paths=False)
    assert "total ~" in describe_plan(fits, 1920, 8)  # the advised budget is accepted
    over = resolve_config(PRODUCTION, {"packing_token_budget": int(largest * 1.02)},
                          world_size=1920, check_paths=False)
    with pytest.raises(ConfigError, match="does not fit the GPU"):
        describe_plan(over, 1920, 8)


def test_the_wan_estimate_is_within_ten_percent_of_the_peak_measured_at_wan_1_3b():
    # docs/performance.md: relay's wan family at Wan2.1-1.3B size (32,760 video + 512 caption
    # tokens, batch 1, AdamW, no EMA, compiled, no checkpointing) peaked at 67.74 GiB allocated
    # on one H200 (benchmarks/results/step-wan1.3b-wan-family-h200.json).
    measured = json.loads((REPO / "benchmarks/results/step-wan1.3b-wan-family-h200.json").read_text())
    peak = next(r["peak_allocated_gib"] for r in measured["runs"] if r["model"] == "relay-wan")
    family = get_family("wan")
    estimate = estimate_memory(family, family.config({}), stage="fm", use_muon=False,
                               use_ema=False, shard_group=1, cp=1, batch_per_rank=1,
                               video_tokens=32760, text_tokens=512, checkpointing=False)
    assert abs(estimate.total_gib - peak) / peak < 0.10, estimate.describe()
    assert "36.5 B x 30 blocks" in estimate.describe()
    assert "max(activations 52.12, gradients 5.29) = 52.12 GiB (activations" in estimate.describe()


# Wan2.1-1.3B's transformer (the family's defaults) as Stage1 and Stage2 configure it.
_STAGE1 = {"causal_chunk_size": 3, "two_time": True, "time_gate": 0.25}  # config/wan/t2v-1.3b-stage1.yaml
_STAGE2 = {"causal_chunk_size": 3, "two_time": False}  # config/wan/t2v-1.3b-stage2.yaml
_H5120 = {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
          "num_layers": 8}  # benchmarks/step.py --size h5120-8k


@pytest.mark.parametrize("overrides, settings, measured", [
    # benchmarks/step.py --size wan-1.3b, relay-wan (docs/performance.md;
    # benchmarks/results/step-wan1.3b-wan-family-h200.json): AdamW, no EMA, no checkpointing
    ({}, dict(stage="fm", use_ema=False, checkpointing=False, video_tokens=32760), 67.6),
    # benchmarks/step.py --size h5120-8k, relay-wan (docs/performance.md;
    # benchmarks/results/step-wan-h5120-8k-h200.json): 8,190 video tokens, same settings
    (_H5120, dict(stage="fm", use_ema=False, checkpointing=False, video_tokens=8190), 46.2),
    # train.py SFT, config/wan/t2v-1.3b-sft.yaml: checkpointing, EMA, AdamW, accumulation 1
    # (docs/wan.md; benchmarks/results/wan-chain-1.3b-h200/sft-report.json)
    ({}, dict(stage="fm", use_ema=True, checkpointing=True, video_tokens=32760), 29.4),
    # train.py Stage1, config/wan/t2v-1.3b-stage1.yaml: clean + noisy video (docs/wan.md;
    # benchmarks/results/wan-chain-1.3b-h200/distill-report.json, stage1-metrics.jsonl)
    (_STAGE1, dict(stage="tf_anyflow", use_ema=True, checkpointing=True, video_tokens=32760),
     32.9),
    # train.py Stage2, config/wan/t2v-1.3b-stage2.yaml: student with EMA, critic, frozen
    # teacher (docs/wan.md; the largest peak of the Stage2 runs:
    # benchmarks/results/wan-stage2-warm-1.3b-h200/report.json)
    (_STAGE2, dict(stage="dmd_sgf", use_ema=True, checkpointing=True, video_tokens=32760),
     59.7),
], ids=["step-1.3b", "step-h5120", "sft", "stage1", "stage2"])
def test_the_wan_estimate_is_within_ten_percent_of_each_measured_peak(overrides, settings,
                                                                     measured):
    family = get_family("wan")
    estimate = estimate_memory(family, family.config(overrides), use_muon=False, shard_group=1,
                               cp=1, batch_per_rank=1, text_tokens=512, **settings)
    assert abs(estimate.total_gib - measured) / measured < 0.10, estimate.describe()


def test_gradient_accumulation_adds_the_gradients_to_the_activations():
    family = get_family("wan")
    common = dict(stage="fm", use_muon=False, use_ema=True, shard_group=8, cp=1,
                  batch_per_rank=1, video_tokens=32760, text_tokens=512, checkpointing=True)
    one = estimate_memory(family, family.config({}), **common)
    four = estimate_memory(family, family.config({}), gradient_accumulation_steps=4, **common)
    p = family.param_counts(family.config({})).total
    assert one.gradients_gib == four.gradients_gib == pytest.approx(4 * p / 8 / 2**30)
    assert one.states_gib == pytest.approx(16 * p / 8 / 2**30)  # params, AdamW, EMA: no grads
    rest = one.states_gib + one.working_gib + one.overhead_gib
    assert one.total_gib == pytest.approx(rest + max(one.activations_gib, one.gradients_gib))
    assert four.total_gib == pytest.approx(rest + one.activations_gib + one.gradients_gib)
    assert "gradient_accumulation_steps 4" in four.describe()
    assert "max(activations" in one.describe()
    # the room left to the activations: under accumulation the gradients take theirs first
    assert four.activation_room_gib(80) == pytest.approx(80 - rest - four.gradients_gib)
    assert one.activation_room_gib(80) == pytest.approx(80 - rest)
    assert one.activation_room_gib(rest + one.gradients_gib / 2) == 0.0


def test_describe_plan_passes_gradient_accumulation_to_the_estimate():
    # The wan family measured that its peak holds the larger of activations and gradients;
    # under accumulation the gradients live across forwards and are added.
    wan = str(REPO / "config/wan/t2v-14b-sft.yaml")
    quiet = {"validation_interval": -1}
    plain = describe_plan(resolve_config(wan, quiet, world_size=256, check_paths=False), 256, 8)
    accumulated = describe_plan(resolve_config(
        wan, {**quiet, "gradient_accumulation_steps": 2, "global_batch_size": 256},
        world_size=256, check_paths=False), 256, 8)
    assert "max(activations" in plain
    assert "gradient_accumulation_steps 2: the gradients live" in accumulated


def test_a_family_that_did_not_measure_the_overlap_adds_gradients_to_activations():
    # relay's dit family keeps the additive peak its constants were calibrated with.
    plan = describe_plan(resolve_config(PRODUCTION, {}, world_size=1920, check_paths=False),
                         1920, 8)
    assert "max(activations" not in plan
    assert "activations + gradients" in plan
