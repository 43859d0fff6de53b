"""Stage2 on packs: the KV-cached rollout over a pack of samples of different shapes computes
what each sample's own rollout computes, and a packed Stage2 step equals the per-sample steps."""

import pytest
import torch

from test_data_packing import _causal_samples, _model

torch.set_num_threads(1)


@pytest.mark.parametrize("window", [None, 1])
def test_packed_cache_chunks_equal_each_sample_with_its_own_cache(window):
    model = _model(causal_chunk_size=2, attn_window_chunks=window)
    xs, _, texts, masks = _causal_samples()  # 4, 3 and 1 frames: 2, 2 and 1 chunks
    g = torch.Generator().manual_seed(11)
    cache = model.new_packed_kv_cache(texts, masks)
    alone = [model.new_kv_cache(t[None], m[None]) for t, m in zip(texts, masks)]
    for start in (0, 2):
        active = [i for i, x in enumerate(xs) if x.shape[1] > start]
        chunks = [xs[i][:, start:start + 2] for i in active]
        times = [torch.rand((), generator=g, dtype=torch.float64) * 1000 for _ in active]
        packed = model.forward_chunk_packed(chunks, times, cache, active)
        for i, x, t, out in zip(active, chunks, times, packed):
            want = model.forward_chunk(x[None], t[None], alone[i], start)[0]
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        cleans = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in chunks]
        model.commit_chunk_packed(cleans, cache, active)
        for i, clean in zip(active, cleans):
            model.commit_chunk(clean[None], alone[i], start)
    assert cache.next_frame == [c.next_frame for c in alone] == [4, 3, 1]
    assert [len(c) for c in cache.chunks] == [len(c.chunks) for c in alone]


def test_a_sample_of_a_packed_cache_does_not_see_the_others():
    model = _model(causal_chunk_size=2)
    xs, _, texts, masks = _causal_samples()
    outputs = []
    for shift in (0.0, 5.0):
        moved = [texts[0], texts[1] + shift, texts[2]]
        cache = model.new_packed_kv_cache(moved, masks)
        model.commit_chunk_packed([x[:, :2] for x in xs[:2]], cache, [0, 1])
        outputs.append(model.forward_chunk_packed([xs[0][:, 2:], xs[1][:, 2:]],
                                                  [300.0, 300.0], cache, [0, 1]))
    assert torch.equal(outputs[0][0], outputs[1][0])  # sample 0 is blind to sample 1's caption
    assert not torch.equal(outputs[0][1], outputs[1][1])


# ---- a Stage2 step on a pack equals the mean of the per-sample steps --------------------------

def _pack(channels: int, text_dim: int, patch: int) -> dict:
    """Three samples of 4, 3 and 1 latent frames (2, 2 and 1 chunks of 2; the second ends in a
    short chunk) at three resolutions, captions of 5, 8 and 3 tokens, one with padding."""
    g = torch.Generator().manual_seed(21)
    xs = [torch.randn(channels, *shape, generator=g, dtype=torch.float64)
          for shape in ((4, 2 * patch, 3 * patch), (3, 3 * patch, 2 * patch),
                        (1, 2 * patch, 2 * patch))]
    texts = [torch.randn(n, text_dim, generator=g, dtype=torch.float64) for n in (5, 8, 3)]
    masks = [torch.ones(5, dtype=torch.bool), torch.tensor([True] * 6 + [False] * 2),
             torch.ones(3, dtype=torch.bool)]
    return {"packed": True, "latents": xs, "text": texts, "text_mask": masks,
            "first_frame": [None] * 3, "sample_keys": [40, 41, 42]}


def _alone(pack: dict, i: int) -> dict:
    return {"latents": pack["latents"][i][None], "text": pack["text"][i][None],
            "text_mask": pack["text_mask"][i][None], "first_frame": None,
            "sample_keys": [pack["sample_keys"][i]]}


def _double_stage(**keys):
    from test_dmd_sgf import make_stage

    stage = make_stage(**keys)
    for model in (stage.student, stage.teacher, stage.critic):
        model.double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a critic apart from the teacher, so the DMD gradient is not 0
        for p in stage.critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return stage


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("keys", [{}, {"image_cond_prob": 0.5},
                                  {"rollout_mode": "data_latent", "real_guidance_scale": 0.0}])
def test_packed_stage2_losses_and_gradients_equal_the_per_sample_mean(keys):
    from trainer.diffusion.sample_draws import SampleDraws

    stage = _double_stage(**keys)
    cfg = stage.student.cfg
    pack = _pack(cfg.in_channels, cfg.text_dim, cfg.patch_size[1])
    step, seed = 6, stage.args.seed

    def student_loss(batch, sample, loss_of):
        draws = SampleDraws(seed, step, batch["sample_keys"])
        x_hat, frames, _ = sample(batch, with_grad=True, draws=draws,
                                  exit_generator=stage._exit_generator(step, 0))
        return loss_of(x_hat, frames, stage._captions(batch), draws)[0]

    def critic_loss(batch, sample, loss_of):
        draws = SampleDraws(seed, step, batch["sample_keys"])
        with torch.no_grad():
            x_hat, frames, _ = sample(batch, with_grad=False, draws=draws,
                                      exit_generator=stage._exit_generator(step, 1))
        return loss_of(x_hat, frames, stage._captions(batch), draws)

    for loss_fn, model, packed_fns, alone_fns in (
            (student_loss, stage.student,
             (stage.student_sample_packed, stage.generator_loss_packed),
             (stage.student_sample, stage.generator_loss)),
            (critic_loss, stage.critic, (stage.student_sample_packed, stage.critic_loss_packed),
             (stage.student_sample, stage.critic_loss))):
        packed = loss_fn(pack, *packed_fns)
        packed.backward()
        packed_grads = _grads(model)
        alone = [loss_fn(_alone(pack, i), *alone_fns) for i in range(3)]
        (sum(alone) / 3).backward()
        torch.testing.assert_close(packed, sum(alone) / 3, rtol=1e-9, atol=1e-12)
        assert packed_grads and len(packed_grads) == len(alone_grads := _grads(model))
        for got, want in zip(packed_grads, alone_grads):
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)
        assert float(packed.detach()) > 0 and any(bool(g.abs().sum() > 0) for g in packed_grads)


class _Packs:
    """The data iterator's packs, one after another (fresh sample keys each)."""

    def __init__(self, cfg):
        self.cfg, self.served = cfg, 0

    def next_batch(self):
        pack = _pack(self.cfg.in_channels, self.cfg.text_dim, self.cfg.patch_size[1])
        pack["sample_keys"] = [3 * self.served + i for i in range(3)]
        pack["sample_index"] = torch.tensor(pack["sample_keys"])
        self.served += 1
        return pack


def test_stage2_trains_on_packs_both_roles_and_counts_the_packs_samples():
    stage = _double_stage(generator_update_interval=1)
    stage.data = _Packs(stage.student.cfg)
    before = {name: [p.detach().clone() for p in model.parameters()]
              for name, model in (("student", stage.student), ("critic", stage.critic))}
    first = stage.train_step(1)   # k = 0: the critic only
    second = stage.train_step(2)  # k = 1: the student, then the critic
    assert first["samples"] == 3 and second["samples"] == 6
    assert second["student_updates"] == 1 and second["generator_loss"] > 0
    assert stage.tokens_per_sample == (4 * 2 * 3 + 3 * 3 * 2 + 1 * 2 * 2) // 3
    for name, model in (("student", stage.student), ("critic", stage.critic)):
        assert any(not torch.equal(a, b) for a, b in zip(before[name], model.parameters())), name


# ---- under FSDP2 the ranks' packs differ in chunks, their forwards must not ------------------

def _sharded_rollout(rank: int, world: int, port: int, cp: int) -> None:
    import copy
    import os

    from trainer.build import distribute
    from trainer.parallel.distributed import barrier, destroy, init_distributed, max_across_ranks
    from trainer.diffusion.sample_draws import SampleDraws
    from trainer.stages import rollout as R

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    topo = init_distributed(cp, backend="gloo")
    model = _model(causal_chunk_size=2)  # the same seeded weights on every rank
    reference = copy.deepcopy(model)
    distribute(model, topo)  # FSDP2 over every rank; under cp, each group splits its tokens
    xs, _, texts, masks = _causal_samples()
    # dp rank 0: 2 chunks each; dp rank 1: one image, 1 chunk, then idle rounds (under cp,
    # the placeholder chunk of those rounds splits over its cp group like a real one)
    mine = [0, 1] if topo.dp_rank == 0 else [2]
    sigmas = [1.0, 0.6, 0.3]
    rounds = max_across_ranks(max(-(-xs[i].shape[1] // 2) for i in mine))
    got = R.simulate_packed_rollout(model, [xs[i][None] for i in mine], [texts[i] for i in mine],
                                    [masks[i] for i in mine], sigmas, 2, anchors=[None] * len(mine),
                                    anchored=[None] * len(mine),
                                    draws=[SampleDraws(0, 1, [i]) for i in mine], rounds=rounds)
    for i, out in zip(mine, got.output):
        with torch.no_grad():
            student = R.CachedStudent(reference, texts[i][None], masks[i][None])
            want = R.simulate_rollout(student, xs[i][None], sigmas, 2,
                                      generator=SampleDraws(0, 1, [i]))
        torch.testing.assert_close(out, want.output, rtol=1e-9, atol=1e-10)
    assert rounds == 2
    barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


@pytest.mark.parametrize("world, cp", [(2, 1), (4, 2)], ids=["dp2", "dp2xcp2"])
def test_sharded_ranks_whose_packs_hold_fewer_chunks_keep_pace_and_roll_out_exactly(world, cp):
    import time

    import torch.multiprocessing as mp
    from fixtures.ports import free_port

    context = mp.spawn(_sharded_rollout, args=(world, free_port(), cp), nprocs=world, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):  # raises when a rank failed
        if time.monotonic() > deadline:  # a rank waits in a forward the other never runs
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks hung: their rollouts ran different numbers of sharded forwards")


# ---- through train.py: a FastVideo-layout dataset of mixed shapes ------------------------------

def _stage2(data, sft, out, max_steps: int) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_data_train import MODEL

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "trainer" / "train.py"),
               "--config", str(root / "config" / "tiny" / "stage2.yaml"),
               "--transformer_config_overrides", MODEL[:-1] + ", causal_chunk_size: 2}",
               "--synthetic_data", "false", "--data_path", str(data), "--output_dir", str(out),
               *(arg for role in ("student", "teacher", "critic")
                 for arg in (f"--{role}_init_path", str(sft))),
               "--packing_token_budget", "60", "--packed_dataloader_num_workers", "0",
               "--max_steps", str(max_steps), "--generator_update_interval", "1",
               "--save_interval", "2", "--log_interval", "1", "--validation_interval", "-1",
               "--deterministic", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_stage2_trains_in_packs_of_mixed_shapes_and_resumes_on_the_same_trajectory(tmp_path):
    import json
    import math

    from fixtures.fastvideo_t2v import write_fastvideo_dataset
    from test_data_train import _train

    data = write_fastvideo_dataset(tmp_path / "data", 24, dtype=torch.float32)
    _train(data, tmp_path / "sft", 2, "--use_ema", "true")  # FM on packs: the three roles' init
    _stage2(data, tmp_path / "sft", tmp_path / "reference", 4)
    _stage2(data, tmp_path / "sft", tmp_path / "resumed", 2)
    _stage2(data, tmp_path / "sft", tmp_path / "resumed", 4)

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    reference, resumed = records("reference"), records("resumed")
    assert sorted(reference) == [1, 2, 3, 4]
    assert all(math.isfinite(r["critic_loss"]) for r in reference.values())
    assert reference[4]["student_updates"] == 3 and math.isfinite(reference[4]["generator_loss"])
    for step in (3, 4):
        for key in ("critic_loss", "generator_loss", "student_grad_norm"):
            assert resumed[step][key] == reference[step][key], (step, key)
