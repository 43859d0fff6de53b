"""Memory per GPU of a stage, before anything starts (torch-free).

`relay submit` and `train.py --dry-run` print this and refuse a stage that cannot fit
`gpu_memory_gib`, showing the arithmetic, so a 240-node job does not fail its first step.

What is counted, per rank (P = parameters of one model, S = ranks of a shard group):
- states: fp32 parameters and gradients sharded over S (4 + 4 bytes / S each), AdamW's two
  moments (8 bytes / S) or Muon's one momentum for the hidden matrices, the fp32 EMA shadow
  (4 bytes / S); a frozen role (Stage2's teacher) holds its parameters only. A LoRA run's
  trained role is its frozen base (parameters only) plus the adapters, which alone hold
  gradients, optimizer state and the EMA (Muon's momentum for their matrices).
- the FSDP2 working set: the unsharded compute-dtype copy of the block being run and of the
  one prefetched, plus that block's unsharded fp32 gradient before its reduce-scatter.
- activations of the trained forward at the configured sequence (video + caption tokens,
  Stage1/Stage2 teacher forcing holds clean and noisy video), video and caption tokens each
  divided by cp, rounded up (Ulysses splits both streams): ACT_BYTES bytes
  per token x hidden per block without checkpointing; with it, only each block's input
  (CKPT_BYTES) plus one block's full activations during its recompute; selective
  checkpointing adds each block's attention output (ATTENTION_BYTES, bf16: counted, not
  calibrated).
- with `packing_token_budget` (trainer.data.order.BatchPlan), a micro-batch is one pack of at
  most that many joint tokens (video after patchify + caption) whatever train_batch_size and
  the clip shape say: the budget sets the activations. A pack's video tokens run `copies` times
  (teacher forcing: clean and noisy) and are split by cp, its captions are not, so the split of
  the budget between the two matters under cp: the estimate splits it as the known sample does
  (its video : caption tokens), or takes the worse of all-video and all-caption when no sample
  shape is known here.

The activation constants are calibrated, not derived, on the step peaks `benchmarks/step.py`
measured on one H200 (compiled blocks, bf16, FA4, batch 1, AdamW, no EMA; docs/performance.md):
without checkpointing, relay's model at hidden 1536 x 30 blocks (33,272 tokens) peaked at
67.3 GiB, hidden 3072 x 8 (16,892) at 39.4 and hidden 5120 x 8 (8,702) at 60.0: 29.6, 38.5 and
27.4 bytes per token x hidden per block after the states, so ACT_BYTES takes the largest. Under
full checkpointing a block keeps its fp32 input (CKPT_BYTES = 4); the 1536 x 30 model then
peaked at 26.0 GiB against ~32 estimated (its gradients are not all allocated at the peak,
which the estimate does not model: it errs high). Selective: 26.8 measured, ~35 estimated.
Re-check them when the model's forward or the compile settings change.

A family may set its own measured constant (`ModelFamily.activation_bytes`). The wan family's
is 33: Wan2.1-1.3B's shape (hidden 1536 x 30 blocks, 33,272 tokens, AdamW, no EMA) peaked at
67.7 GiB allocated on one H200, 21.1 GiB of states and 46.6 GiB of activations, 32.6 bytes per
token x hidden per block; the estimate gives 70.3 GiB (+4 %) there. At hidden 5120 x 8 blocks
(8,702 tokens) it gives 58.3 against 46.2 measured (+26 %): that peak is the optimizer step,
and the estimate adds every gradient to the activations' peak.
"""

from __future__ import annotations

import dataclasses
import math

GIB = 2**30
ACT_BYTES = 39.0      # saved bytes per token x hidden_size per block, no checkpointing (bf16)
CKPT_BYTES = 4.0      # kept per token x hidden_size per block under full checkpointing
ATTENTION_BYTES = 2.0  # selective checkpointing also keeps each block's bf16 attention output
OVERHEAD_GIB = 2.0    # CUDA context, allocator fragmentation, communication buffers


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    trained: bool
    ema: bool = False


def stage_roles(stage: str, use_ema: bool) -> list[Role]:
    if stage == "dmd_sgf":
        return [Role("student", True, use_ema), Role("critic", True), Role("teacher", False)]
    return [Role("transformer", True, use_ema)]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """GiB per GPU, by part; `lines` says how each was computed."""

    states_gib: float
    working_gib: float
    activations_gib: float
    overhead_gib: float
    lines: tuple[str, ...]

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.working_gib + self.activations_gib + self.overhead_gib

    def describe(self) -> str:
        return "\n".join([*self.lines, f"  total ~{self.total_gib:.1f} GiB per GPU"])


def video_copies(stage: str) -> int:
    """Video streams a stage's trained forward runs per sample (teacher forcing: clean | noisy)."""
    return 2 if stage in ("tf_anyflow", "dmd_sgf") else 1


def pack_tokens_per_rank(budget: int, *, copies: int, cp: int, video_tokens: int,
                         text_tokens: int) -> tuple[int, int, str]:
    """(tokens one cp rank holds for a pack of `budget` joint tokens, caption tokens assumed
    in it, how the split was chosen): the caption share follows the known sample's
    video_tokens : text_tokens; with video_tokens 0 (no shape known) all video, the worse
    extreme (video runs `copies` times; cp splits both streams)."""
    if video_tokens > 0:
        caption = math.ceil(budget * text_tokens / (video_tokens + text_tokens))
        how = f"split as one sample's {video_tokens} video : {text_tokens} caption"
    else:
        caption, how = 0, "all video, the worse split (no sample shape known)"
    return math.ceil(copies * (budget - caption) / cp) + math.ceil(caption / cp), caption, how


def estimate_memory(family, cfg: dict, *, stage: str, use_muon: bool, use_ema: bool,
                    shard_group: int, cp: int, batch_per_rank: int, video_tokens: int,
                    text_tokens: int, checkpointing: bool,
                    selective: bool = False, pack_budget: int | None = None,
                    lora: bool = False, lora_params: int | None = None) -> MemoryEstimate:
    """The memory one GPU needs for a step of `stage` (see the module docstring); with
    `pack_budget` (packing_token_budget) a micro-batch is one pack of that many joint tokens
    and batch_per_rank is not used. `family` (trainer.models.family) counts the parameters of
    the model `cfg` describes and gives its width and depth. `lora`: the trained role is a
    frozen base with `lora_params` adapter parameters (None: not known here, not counted)."""
    counts = family.param_counts(cfg)
    geometry = family.geometry(cfg)
    p, per_block = counts.total, counts.per_block
    h, layers = geometry.hidden_size, geometry.num_layers
    lines = [f"  model: {p / 1e9:.3f}B parameters ({layers} blocks of {per_block / 1e6:.1f}M), "
             f"sharded over {shard_group} rank(s)"]
    states = 0.0
    for role in stage_roles(stage, use_ema):
        if lora and role.trained:
            role_gib, line = _lora_role(role, p, lora_params, use_muon, shard_group)
            states += role_gib
            lines.append(line)
            continue
        bytes_per = 4.0  # fp32 parameters
        what = ["params 4"]
        if role.trained:
            muon = counts.muon if use_muon else 0
            optim = (4 * muon + 8 * (p - muon)) / p
            bytes_per += 4 + optim
            what += ["grads 4", f"{'Muon+AdamW' if use_muon else 'AdamW'} {optim:.1f}"]
        if role.ema:
            bytes_per += 4
            what.append("EMA 4")
        role_gib = bytes_per * p / shard_group / GIB
        states += role_gib
        lines.append(f"  {role.name}: ({' + '.join(what)}) = {bytes_per:.1f} B x {p / 1e9:.3f}B "
                     f"/ {shard_group} = {role_gib:.2f} GiB")
    # Two blocks gathered in bf16 (the one running, the one prefetched), one block's fp32
    # gradient before its reduce-scatter; nothing is gathered in one process.
    working = (2 * 2 + 4) * per_block / GIB if shard_group > 1 else 0.0
    lines.append(f"  FSDP2 working set: (2 blocks x 2 B + 4 B) x {per_block / 1e6:.1f}M = "
                 f"{working:.2f} GiB")
    copies = video_copies(stage)
    if pack_budget is not None:
        tokens, caption, split = pack_tokens_per_rank(pack_budget, copies=copies, cp=cp,
                                                      video_tokens=video_tokens,
                                                      text_tokens=text_tokens)
        shape = (f"one pack of packing_token_budget {pack_budget} joint tokens: "
                 f"({pack_budget - caption} video x {copies} + {caption} caption) / cp {cp}, "
                 f"{split}")
    else:
        video = video_tokens * copies
        # Ulysses splits both streams; each is padded to a multiple of cp first.
        tokens = batch_per_rank * (math.ceil(video / cp) + math.ceil(text_tokens / cp))
        shape = f"batch {batch_per_rank} x ({video} video + {text_tokens} caption) / cp {cp}"
    unit = tokens * h / GIB
    act_bytes = family.activation_bytes or ACT_BYTES
    if checkpointing:
        kept = CKPT_BYTES + (ATTENTION_BYTES if selective else 0.0)
        acts = unit * (kept * layers + act_bytes)
        how = f"({kept:g} B x {layers} blocks + {act_bytes:g} B for the recomputed one)"
    else:
        acts = unit * act_bytes * layers
        how = f"{act_bytes:g} B x {layers} blocks"
    lines.append(f"  activations: {tokens} tokens per rank ({shape}) x hidden {h} x {how} = "
                 f"{acts:.2f} GiB ({_checkpointing_name(checkpointing, selective)})")
    lines.append(f"  overhead: {OVERHEAD_GIB:g} GiB")
    return MemoryEstimate(states, working, acts, OVERHEAD_GIB, tuple(lines))


def _lora_role(role: Role, p: int, adapters: int | None, use_muon: bool,
               shard_group: int) -> tuple[float, str]:
    """(GiB, the line saying so) of a LoRA-trained role: the fp32 base, parameters only, and
    the adapters with their gradients, optimizer state (Muon: one momentum, every adapter
    weight is a matrix) and EMA."""
    base_gib = 4.0 * p / shard_group / GIB
    if adapters is None:
        return base_gib, (f"  {role.name}: frozen base (params 4) = 4.0 B x {p / 1e9:.3f}B / "
                          f"{shard_group} = {base_gib:.2f} GiB; LoRA adapters not counted (the "
                          f"model family does not list its linear layers)")
    per = 4 + 4 + (4 if use_muon else 8) + (4 if role.ema else 0)
    what = ["params 4", "grads 4", f"{'Muon' if use_muon else 'AdamW'} {4 if use_muon else 8}"]
    if role.ema:
        what.append("EMA 4")
    adapter_gib = per * adapters / shard_group / GIB
    return base_gib + adapter_gib, (
        f"  {role.name}: frozen base (params 4) = 4.0 B x {p / 1e9:.3f}B / {shard_group} = "
        f"{base_gib:.2f} GiB; LoRA adapters ({' + '.join(what)}) = {per:.1f} B x "
        f"{adapters / 1e6:.3f}M / {shard_group} = {adapter_gib:.3f} GiB")


def _checkpointing_name(checkpointing: bool, selective: bool) -> str:
    if not checkpointing:
        return "without checkpointing"
    return "selective checkpointing" if selective else "with checkpointing"
