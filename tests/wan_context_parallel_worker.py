"""One rank of tests/test_wan_capabilities.py's context-parallel check: every forward of the wan
module with its video tokens split over a cp group of all ranks (Ulysses), against the same
module unsplit on the same inputs, in float64. Writes <out>/<rank>.json: per case the largest
output and gradient differences (gradients: the group's sum over its size, as FSDP2's mean
over the dp x cp shard group makes it; trainer.parallel.context_parallel) and the video tokens
the first block held in each model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.models.wan.family import WanFamily
from trainer.parallel.context_parallel import attach
from trainer.parallel.distributed import destroy

# a model built at random, as a trained one looks (zero_init_modulation would zero its output)
RANDOM = {"zero_init_modulation": False}

TINY = {"patch_size": [1, 2, 2], "num_attention_heads": 4, "attention_head_dim": 8,
        "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2}


def model(**extra):
    torch.manual_seed(0)
    family = WanFamily()
    return family.build(family.config({**TINY, **extra}, RANDOM)).double()


def tokens_seen(m) -> list[int]:
    seen: list[int] = []
    m.blocks[0].register_forward_pre_hook(
        lambda block, args: seen.append(args[0].shape[1]) if args[0] is not None else None)
    return seen


def compare(name, build, run, results) -> None:
    """run(model) -> output tensor (the loss is its sum of squares, gradients compared too)."""
    reference, split = build(), build()
    attach(split, dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    whole, share = tokens_seen(reference), tokens_seen(split)
    want, got = run(reference), run(split)
    entry = {"out": float((want - got).detach().abs().max()),
             "tokens": {"whole": max(whole), "split": max(share)}}
    if want.requires_grad:
        want.square().sum().backward()
        got.square().sum().backward()
        diffs = []
        for p, q in zip(reference.parameters(), split.parameters()):
            if p.grad is None:
                continue
            grad = q.grad.clone()
            dist.all_reduce(grad)
            diffs.append(float((grad / dist.get_world_size() - p.grad).abs().max()))
        entry["grad"] = max(diffs)
        entry["grad_scale"] = max(float(p.grad.abs().max()) for p in reference.parameters()
                                  if p.grad is not None)
    results[name] = entry


def inputs(frames=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, frames, 4, 4, generator=g, dtype=torch.float64)
    text = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    return x, text, mask


def rollout(m, x, text, mask):
    with torch.no_grad():
        cache = m.new_kv_cache(text, mask)
        first = m.forward_chunk(x[:, :, :2], torch.tensor([700.0, 300.0]).double(), cache, 0)
        m.commit_chunk(x[:, :, :2], cache, 0)
        second = m.forward_chunk(x[:, :, 2:], torch.full((2, 2), 500.0).double(), cache, 2)
    return torch.cat([first, second], dim=2)


def pack():
    """21 video tokens (16 + 1 + 4: padded to split) with captions of 3, 5 (4 real) and 3."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, *s, generator=g, dtype=torch.float64)
          for s in ((4, 4, 4), (1, 2, 2), (2, 4, 2))]
    texts = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (3, 5, 3)]
    masks = [torch.ones(n, dtype=torch.bool) for n in (3, 5, 3)]
    masks[1][4:] = False
    return xs, texts, masks


def packed(m):
    xs, texts, masks = pack()
    ts = [torch.tensor([0.0, 400.0, 400.0, 800.0]).double(), 900.0, 100.0]
    return torch.cat([p.flatten() for p in m.forward_packed(xs, ts, texts, masks)])


def packed_teacher_forcing(m):
    xs, texts, masks = pack()
    cleans = [x.flip(1) for x in xs]
    outs = m.forward_teacher_forcing_packed(xs, cleans, [600.0, 900.0, 100.0], texts, masks,
                                            rs=[300.0, 900.0, 50.0])
    return torch.cat([p.flatten() for p in outs])


def packed_rollout(m):
    xs, texts, masks = pack()
    cache = m.new_packed_kv_cache(texts, masks)
    first = m.forward_chunk_packed([x[:, :2] for x in xs], [700.0, 200.0, 300.0], cache,
                                   [0, 1, 2], rs=[350.0, 100.0, 100.0])
    m.commit_chunk_packed([xs[0][:, :2].flip(1), xs[2][:, :2]], cache, [0, 2])
    second = m.forward_chunk_packed([xs[0][:, 2:]], [torch.tensor([500.0, 100.0]).double()],
                                    cache, [0])
    return torch.cat([p.flatten() for p in (*first, *second)])


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    x, text, mask = inputs()
    per_frame = torch.tensor([[0.0, 250.0, 250.0, 250.0], [0.0, 0.0, 800.0, 800.0]]).double()
    t = torch.tensor([300.0, 900.0]).double()
    results: dict = {}
    compare("bidirectional", model, lambda m: m(x, t, text, mask), results)
    compare("per_frame_times", model, lambda m: m(x, per_frame, text, mask), results)
    compare("block_causal", lambda: model(causal_chunk_size=2),
            lambda m: m(x, per_frame, text, mask), results)
    compare("teacher_forcing", lambda: model(causal_chunk_size=2, two_time=True),
            lambda m: m.forward_teacher_forcing(x, x.flip(2), per_frame, text, mask,
                                                r=per_frame / 2), results)
    compare("kv_rollout", lambda: model(causal_chunk_size=2),
            lambda m: rollout(m, x, text, mask), results)
    compare("packed", model, packed, results)
    compare("packed_causal", lambda: model(causal_chunk_size=2), packed, results)
    compare("packed_teacher_forcing", lambda: model(causal_chunk_size=2, two_time=True),
            packed_teacher_forcing, results)
    compare("packed_rollout", lambda: model(causal_chunk_size=2, two_time=True), packed_rollout,
            results)
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
