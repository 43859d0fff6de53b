"""benchmarks/flops.py's stage_step_flops against what a real training step runs.

Each stage of a tiny `wan` and a tiny `dit` model is built through trainer.stages.registry.build_stage
and stepped once on the CPU while every role's first block counts its calls over video and
the video tokens they carry; the counts must equal the forward calls and tokens the formula
claims (per sample), for SFT, Stage1 (with and without the fused null-caption pass) and Stage2
(the critic-only step and the student step, at each exit step, simulated and data_latent
rollouts, with and without the teacher's CFG pair). The attention pairs the formula counts
for teacher forcing and the KV-cache rollout must equal the real masks' (trainer.models.attention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import flops  # noqa: E402
from trainer import build  # noqa: E402
from trainer.resolve import resolve_config  # noqa: E402
from trainer.models.attention import block_causal_mask, teacher_forcing_mask  # noqa: E402
from trainer.models.registry import family_of, get_family, model_config  # noqa: E402
from trainer.parallel.distributed import Topology  # noqa: E402
from trainer.stages import registry, rollout  # noqa: E402

BATCH, TEXT = 2, 16
CONFIGS = {"wan": "config/wan/tiny-{}.yaml", "dit": "config/tiny/{}.yaml"}
# where a block's video tokens sit among its positional arguments (wan: x; dit: txt, vid)
class Batches:
    """Endless random batches in the data iterator's format, captions padded to TEXT tokens."""

    def __init__(self, shape, text_dim: int):
        self.shape, self.text_dim, self.served = shape, text_dim, 0
        self.generator = torch.Generator().manual_seed(0)

    def next_batch(self) -> dict:
        keys = list(range(self.served * BATCH, (self.served + 1) * BATCH))
        self.served += 1
        mask = torch.zeros(BATCH, TEXT, dtype=torch.bool)
        mask[:, :5] = True
        text = torch.randn(BATCH, TEXT, self.text_dim, generator=self.generator) * mask[..., None]
        return {"latents": torch.randn(BATCH, *self.shape, generator=self.generator),
                "text": text, "text_mask": mask, "first_frame": None, "sample_keys": keys,
                "sample_index": keys}


class BlockCounter:
    """Calls over video and video tokens through the first block of every role."""

    def __init__(self, roles: dict, family: str):
        self.calls = self.tokens = 0
        self.index = get_family(family).block_video_arg
        self.handles = [model.blocks[0].register_forward_pre_hook(self._count)
                        for model in {id(m): m for m in roles.values()}.values()]

    def _count(self, module, args):
        video = args[self.index] if len(args) > self.index else None
        if video is not None:  # None: a caption-only call (a rollout's cache)
            self.calls += 1
            self.tokens += video.shape[0] * video.shape[1]

    def close(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {"forward_calls": self.calls, "forward_tokens": self.tokens / BATCH}


def build_stage(family: str, stage: str, tmp_path: Path, monkeypatch, *extra: str):
    # the stage's model is what its source defines: for wan the tiny pipeline's
    # transformer/config.json (SFT: make_tiny_wan's, as the path is not written yet)
    weights = tmp_path / "tiny-wan"
    if family == "wan" and stage != "sft":
        from trainer.models.wan.tiny import write_tiny_wan_pipeline

        write_tiny_wan_pipeline(weights)
    sources = {"stage2": [f"--{role}_init_path={weights}"
                          for role in ("student", "teacher", "critic")]}.get(
        stage, ["--pretrained_transformer_path", str(weights)])
    args = resolve_config(str(REPO / CONFIGS[family].format(stage)),
                          ["--output_dir", str(tmp_path / "out"), "--data_path",
                           str(tmp_path / "data"), "--train_batch_size", str(BATCH),
                           "--text_encoder", "standin", "--text_max_tokens", str(TEXT),
                           "--synthetic_data", "false", "--validation_interval", "-1",
                           "--enable_gradient_checkpointing", "false", *sources, *extra],
                          check_paths=False)
    if family == "wan":  # the tiny Wan's, not the family's 1.3B defaults
        from trainer.models.wan.tiny import TRANSFORMER

        assert {k: model_config(args)[k] for k in ("num_layers", "ffn_dim", "text_dim")} == \
            {k: TRANSFORMER[k] for k in ("num_layers", "ffn_dim", "text_dim")}
    geometry = family_of(args).geometry(model_config(args))
    pt, ph, pw = geometry.patch_size
    # three patch-frames: with the dit's chunk of 2 patch-frames the last chunk is short
    shape = (geometry.latent_channels, 3 * pt, 2 * ph, 3 * pw)
    monkeypatch.setattr(build, "build_data", lambda *a, **k: Batches(shape, geometry.text_dim))
    topo = Topology(rank=0, world_size=1, local_rank=0, cp_size=1, device=torch.device("cpu"))
    torch.manual_seed(0)
    return registry.build_stage(args, topo), args, shape


def counted_step(stage, family: str, step: int) -> dict:
    counter = BlockCounter(stage.roles, family)
    stage.train_step(step)
    return counter.close()


def claimed(args, shape, step: str, **kwargs) -> dict:
    work = flops.stage_step_flops_of(args, latent_shape=shape, text_tokens=TEXT, **kwargs)
    return {k: pytest.approx(work["steps"][step][k])
            for k in ("forward_calls", "forward_tokens")}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_an_sft_step_runs_the_forwards_the_formula_counts(family, tmp_path, monkeypatch):
    stage, args, shape = build_stage(family, "sft", tmp_path, monkeypatch)
    assert counted_step(stage, family, 1) == claimed(args, shape, "step")


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("drop", [0.0, 1.0])  # every caption kept (fused pass) or none
@pytest.mark.parametrize("reference,context", [("student", "clip"), ("teacher", "clip"),
                                               ("teacher", "causal")])  # whose the last calls are
def test_a_stage1_step_runs_the_forwards_the_formula_counts(family, drop, reference, context,
                                                            tmp_path, monkeypatch):
    stage, args, shape = build_stage(family, "stage1", tmp_path, monkeypatch,
                                     "--cfg_drop_prob", str(drop),
                                     "--anyflow_fuse_guidance_scale", "3.0",
                                     "--anyflow_guidance_reference", reference,
                                     "--anyflow_teacher_context", context)
    assert ("teacher" in stage.roles) == (reference == "teacher")
    counted = counted_step(stage, family, 1)
    assert counted == claimed(args, shape, "step")
    chunks = -(-shape[1] // family_of(args).geometry(model_config(args)).causal_chunk_frames)
    guidance = chunks if context == "causal" else 1
    assert counted["forward_calls"] == (4 + guidance if drop == 0.0 else 4)


@pytest.mark.parametrize("family,extra", [
    ("wan", ()), ("dit", ()), ("wan", ("--real_guidance_scale", "0")),
    ("dit", ("--rollout_mode", "data_latent"))])
def test_stage2_critic_and_student_steps_run_the_forwards_the_formula_counts(
        family, extra, tmp_path, monkeypatch):
    steps = 4
    for exit_index in (0, steps - 1):
        monkeypatch.setattr(rollout, "sample_exit_index", lambda n, g=None, j=exit_index: j)
        stage, args, shape = build_stage(family, "stage2", tmp_path, monkeypatch,
                                         "--generator_update_interval", "1", *extra)
        assert len(args.dmd_denoising_steps) == steps
        # outer step 0 updates the critic only; outer step 1 the student, then the critic
        assert counted_step(stage, family, 1) == claimed(args, shape, "critic",
                                                         exit_index=exit_index)
        assert counted_step(stage, family, 2) == claimed(args, shape, "student",
                                                         exit_index=exit_index)


def test_stage2_mean_is_the_exit_average_and_the_student_step_every_interval(tmp_path):
    args = resolve_config(str(REPO / "config/tiny/stage2.yaml"),
                          ["--output_dir", str(tmp_path), "--data_path", str(tmp_path)],
                          check_paths=False)
    shape = (4, 8, 8)
    each = [flops.stage_step_flops_of(args, latent_shape=shape, exit_index=j)
            for j in range(len(args.dmd_denoising_steps))]
    mean = flops.stage_step_flops_of(args, latent_shape=shape)
    for part in ("critic", "student"):
        assert mean["steps"][part]["flops"] == pytest.approx(
            sum(e["steps"][part]["flops"] for e in each) / len(each))
    critic, student = mean["steps"]["critic"]["flops"], mean["steps"]["student"]["flops"]
    interval = args.generator_update_interval
    assert mean["flops_per_sample"] == pytest.approx(critic + (student - critic) / interval)


@pytest.mark.parametrize("frames,chunk,window", [(6, 2, None), (7, 3, None), (7, 2, 1),
                                                 (5, 1, 2)])
def test_attention_pairs_are_the_masks_pairs(frames, chunk, window):
    per_frame = 3
    chunks = [(min(s + chunk, frames) - s) * per_frame for s in range(0, frames, chunk)]
    # the KV-cache rollout: chunk i's queries over the kept chunks and itself
    assert flops._chunk_pairs(chunks, window) == int(
        block_causal_mask(frames, per_frame, chunk, window).sum())
    # teacher forcing over [clean | noisy]
    assert 2 * flops._chunk_pairs(chunks, window) == int(
        teacher_forcing_mask(frames, per_frame, chunk, window).sum())


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_split_count_gives_back_the_familys_forward(family, tmp_path):
    args = resolve_config(str(REPO / CONFIGS[family].format("stage2")),
                          ["--output_dir", str(tmp_path), "--data_path", str(tmp_path),
                           "--validation_interval", "-1",
                           *[f"--{r}_init_path={tmp_path}" for r in ("student", "teacher",
                                                                       "critic")]],
                          check_paths=False)
    config = model_config(args)
    counts = flops._Counts(family, config, 96, 512)
    for n in (1, 50, 96, 4000):
        assert counts.full(n) == pytest.approx(
            flops.model_forward_flops(family, config, n, 512), rel=1e-9)
