"""One rank of tests/integration/test_context_parallel.py's model checks: every forward of the
DiT with its video and caption tokens split over a cp group of all ranks, against the same
model unsplit on the same inputs. Captions of 5 tokens (one with 3 real ones) and a pack of
3 + 5 + 3 caption tokens: no count divides by 2 or 4. Writes <out>/<rank>.json: the largest
output and gradient differences of each case (gradients: the group's sum over size, see
trainer.parallel.context_parallel), the caption tokens a block's text stream held in each model, how
much the output moves when one rank's share of the caption changes, the heads a rollout's
caption cache keeps (stacked and packed), and the message of a split that must be refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.parallel.context_parallel import attach
from trainer.parallel.distributed import destroy
from trainer.models.dit.module import VideoDiT

BASE = dict(in_channels=3, hidden_size=32, num_attention_heads=4, num_layers=2,
            rope_axes_dim=(4, 2, 2), text_dim=16, patch_size=(1, 2, 2), qk_norm=True,
            zero_init_modulation=False)


def model(**extra) -> VideoDiT:
    torch.manual_seed(0)
    return VideoDiT(**{**BASE, **extra}).double()


def inputs(batch=2, frames=4, size=4, text=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, frames, size, size, generator=g, dtype=torch.float64)
    caption = torch.randn(batch, text, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1, 3:] = False  # a padded caption: the "padded" attention form
    return x, caption, mask


def text_tokens_seen(m: VideoDiT) -> list[int]:
    """Records the caption tokens the first block's text stream gets, call by call."""
    seen: list[int] = []
    m.blocks[0].register_forward_pre_hook(
        lambda block, args: seen.append(args[0].shape[1]) if args[0] is not None else None)
    return seen


def compare(name: str, build, run, results: dict) -> None:
    """run(model) -> output tensor (the loss is its sum of squares, gradients compared too)."""
    reference, split = build(), build()
    attach(split, dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    whole, share = text_tokens_seen(reference), text_tokens_seen(split)
    want, got = run(reference), run(split)
    entry = {"out": float((want - got).detach().abs().max()),
             "text_tokens": {"whole": sorted(set(whole)), "split": sorted(set(share))}}
    if want.requires_grad:
        want.square().sum().backward()
        got.square().sum().backward()
        diffs = []
        for (key, p), q in zip(reference.named_parameters(), split.parameters()):
            if p.grad is None:
                continue
            grad = q.grad.clone()
            dist.all_reduce(grad)  # FSDP2's mean over the group, times its size
            diffs.append(float((grad / dist.get_world_size() - p.grad).abs().max()))
        entry["grad"] = max(diffs)
        entry["grad_scale"] = max(float(p.grad.abs().max()) for p in reference.parameters()
                                  if p.grad is not None)
    results[name] = entry


CACHED_TEXT = {}  # [caption keys, heads] of a rollout's cached caption K/V, by "whole" / "split"


def rollout(m: VideoDiT, caption, mask, x) -> torch.Tensor:
    """Two chunks of a KV-cached rollout: predict, commit, predict the next."""
    with torch.no_grad():
        cache = m.new_kv_cache(caption, mask)
        keys = cache.text_kv[0][0]
        CACHED_TEXT["whole" if m.ulysses is None else "split"] = list(keys.shape[1:3])
        first = m.forward_chunk(x[:, :, :2], torch.tensor([700.0, 300.0]), cache, 0)
        m.commit_chunk(x[:, :, :2], cache, 0)
        second = m.forward_chunk(x[:, :, 2:], torch.full((2, 2), 500.0).double(), cache, 2)
    return torch.cat([first, second], dim=2)


def packed(m: VideoDiT) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    # 16 + 1 + 4 = 21 video tokens: the pack is padded to split over 2 (and 4) ranks.
    xs = [torch.randn(3, s[0], s[1], s[2], generator=g, dtype=torch.float64)
          for s in ((4, 4, 4), (1, 2, 2), (1, 4, 4))]
    texts = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (3, 5, 3)]
    masks = [torch.ones(n, dtype=torch.bool) for n in (3, 5, 3)]
    masks[1][4:] = False
    ts = [torch.tensor(400.0), torch.tensor(900.0), torch.tensor([0.0])]
    return torch.cat([p.flatten() for p in m.forward_packed(xs, ts, texts, masks)])


CACHED_PACK = {}  # [caption keys, heads] of each caption a packed rollout caches


def packed_rollout(m: VideoDiT) -> torch.Tensor:
    """A KV-cached rollout over a pack of 4, 3 and 1 latent frames at three sizes (4, 1 and 6
    tokens a frame) with captions of 3, 5 (3 real) and 3 tokens: chunks of 14 and 9 tokens
    and 11 caption tokens, padded to split over 2 and 4 ranks. The cache is built with
    gradients, so the captions' keys and values are trained through it."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(3, *s, generator=g, dtype=torch.float64)
          for s in ((4, 4, 4), (3, 2, 2), (1, 4, 6))]
    texts = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (3, 5, 3)]
    masks = [torch.ones(n, dtype=torch.bool) for n in (3, 5, 3)]
    masks[1][3:] = False
    cache = m.new_packed_kv_cache(texts, masks)
    CACHED_PACK["whole" if m.ulysses is None else "split"] = [
        list(sample[0][0].shape[1:3]) for sample in cache.text_kv]
    first = m.forward_chunk_packed([x[:, :2] for x in xs],
                                   [700.0, torch.tensor([200.0, 600.0]).double(), 300.0], cache,
                                   [0, 1, 2], rs=[350.0, None, 100.0])
    m.commit_chunk_packed([x[:, :2].flip(1) for x in xs[:2]], cache, [0, 1])
    second = m.forward_chunk_packed([xs[0][:, 2:], xs[1][:, 2:]],
                                    [torch.tensor([500.0, 100.0]).double(), 800.0], cache, [0, 1])
    return torch.cat([p.flatten() for p in (*first, *second)])


def caption_sensitivity(x, caption, mask) -> list[float]:
    """For each cp rank, the largest change of the unsplit model's output when the caption
    tokens that rank holds (j % size == rank) change: large, or the comparisons above could
    not see a rank's caption share going wrong."""
    m, t = model(), torch.tensor([300.0, 900.0])
    with torch.no_grad():
        base = m(x, t, caption, mask)
        moves = []
        for rank in range(dist.get_world_size()):
            changed = caption.clone()
            changed[:, rank::dist.get_world_size()] += 1.0
            moves.append(float((m(x, t, changed, mask) - base).abs().max()))
    return moves


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    x, caption, mask = inputs()
    per_frame = torch.tensor([[0.0, 250.0, 250.0, 250.0], [0.0, 0.0, 800.0, 800.0]])
    results: dict = {}
    compare("bidirectional", model, lambda m: m(x, torch.tensor([300.0, 900.0]), caption, mask),
            results)
    compare("per_frame_times", model, lambda m: m(x, per_frame, caption, mask), results)
    # no mask at all: the split pads the caption and brings a mask of its own
    compare("unmasked_caption", model, lambda m: m(x, torch.tensor([300.0, 900.0]), caption),
            results)
    causal = dict(causal_chunk_size=2, two_time=True)
    compare("block_causal", lambda: model(causal_chunk_size=2),
            lambda m: m(x, per_frame, caption, mask), results)
    compare("teacher_forcing", lambda: model(**causal),
            lambda m: m.forward_teacher_forcing(x, x.flip(2), per_frame, caption, mask,
                                                r=per_frame / 2), results)
    compare("kv_rollout", lambda: model(causal_chunk_size=2),
            lambda m: rollout(m, caption, mask, x), results)
    compare("packed", model, packed, results)
    compare("packed_rollout", lambda: model(**causal), packed_rollout, results)
    results["cached_text"] = CACHED_TEXT
    results["cached_pack"] = CACHED_PACK
    results["caption_share_moves_output"] = caption_sensitivity(x, caption, mask)
    odd = model()
    attach(odd, dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    try:  # 3 x 3 tokens a frame do not split over 2 or 4 ranks
        odd(torch.zeros(2, 3, 4, 6, 6, dtype=torch.float64), per_frame, caption, mask)
        results["refused"] = None
    except ValueError as exc:
        results["refused"] = str(exc)
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
