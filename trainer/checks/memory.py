"""Memory per GPU of a stage, before anything starts (torch-free).

`relay submit` and `train.py --dry-run` print this and refuse a stage that cannot fit
`gpu_memory_gib`, showing the arithmetic, so a 240-node job does not fail its first step.

peak = states without gradients + max(activations, gradients of the largest trained role)
       + FSDP2 working set + overhead (2 GiB)

with the gradients added to the activations instead (not the max) when
gradient_accumulation_steps > 1, or when the model family has not measured the overlap
(`ModelFamily.gradients_overlap_activations`: the wan family has, the dit family has not).
Backward fills the gradients as it frees the activations
(relay zeroes them with set_to_none): at the end of the forward they do not exist yet, at
the optimizer step the activations are gone; under accumulation they live across forwards.

What is counted, per rank (P = parameters of one model, S = ranks of a shard group):
- states without gradients: fp32 parameters sharded over S (4 bytes / S), AdamW's two
  moments (8 bytes / S) or Muon's one momentum for the hidden matrices, the fp32 EMA shadow
  (4 bytes / S); a frozen role (Stage2's teacher) holds its parameters only. A LoRA run's
  trained role is its frozen base (parameters only) plus the adapters, which alone hold
  gradients, optimizer state and the EMA (Muon's momentum for their matrices).
- gradients: fp32, sharded (4 bytes / S) of the largest trained role (Stage2 steps its
  student and its critic apart); a LoRA role's are its adapters' only.
- the FSDP2 working set: the unsharded compute-dtype copy of the block being run and of the
  one prefetched, plus that block's unsharded fp32 gradient before its reduce-scatter.
- activations of the trained forward at the configured sequence (video + caption tokens,
  Stage1/Stage2 teacher forcing holds clean and noisy video), video and caption tokens each
  divided by cp, rounded up (Ulysses splits both streams): ACT_BYTES (or the family's
  `activation_bytes`) bytes per token x hidden per block without checkpointing; with it, only
  each block's input (CKPT_BYTES, or the family's `checkpoint_bytes`) plus one block's full
  activations during its recompute; selective checkpointing adds each block's attention
  output (ATTENTION_BYTES, bf16: counted, not calibrated).
- with `packing_token_budget` (trainer.data.order.BatchPlan), a micro-batch is one pack of at
  most that many joint tokens (video after patchify + caption) whatever train_batch_size and
  the clip shape say: the budget sets the activations. A pack's video tokens run `copies` times
  (teacher forcing: clean and noisy) and are split by cp, its captions are not, so the split of
  the budget between the two matters under cp: the estimate splits it as the known sample does
  (its video : caption tokens), or takes the worse of all-video and all-caption when no sample
  shape is known here.

The constants are calibrated, not derived, on peaks (allocated) measured on one H200 (torch
2.11, compiled blocks, bf16, FA4, batch 1, one GPU so S = 1).

The wan family (`activation_bytes` 36.5, `checkpoint_bytes` 3.0), five peaks (docs/wan.md,
docs/performance.md; benchmarks/results/step-wan*.json and wan-chain-1.3b-h200/):
- Wan2.1-1.3B shape (hidden 1536 x 30 blocks, 32,760 video + 512 caption tokens), AdamW, no
  EMA, no checkpointing (benchmarks/step.py): 67.7 GiB measured, 36.3 bytes per token x hidden
  per block after its 15.9 GiB of states without gradients; estimate 70.0 (+3 %).
- hidden 5120 x 8 blocks (8,190 + 512 tokens), same settings: 46.2 measured, 36.7 bytes after
  34.0 GiB; estimate 48.1 (+4 %). Its activations (12.1) and gradients (11.3) are close, so
  this peak bounds the constant more than it measures it.
- train.py at 1.3B with full checkpointing, AdamW, EMA, gradient_accumulation_steps 1: SFT
  29.4 measured, estimate 29.2 (-1 %); Stage1 (clean and noisy video, 66,032 tokens) 32.9,
  estimate 35.1 (+7 %); Stage2 (student with EMA, critic, frozen teacher) 58.5, estimate 56.2
  (-4 %). These fix `checkpoint_bytes` (a bf16 block input and some of its bookkeeping).
The estimate before this model (every gradient added to the activations, 33 / 4 bytes) said
70.3, 58.3, 35.7, 42.9 and 69.3 GiB for the five (+4 % to +30 %).

The default constants (ACT_BYTES 39, CKPT_BYTES 4) and the additive peak are those of relay's
dit family, calibrated on benchmarks/step.py runs: hidden 1536 x 30 (33,272 tokens) peaked at
67.3 GiB without checkpointing, 26.0 with full and 26.8 with selective checkpointing; hidden
3072 x 8 (16,892) at 39.4 and hidden 5120 x 8 (8,702) at 60.0. The additive estimate errs high
at 1.3B with checkpointing (~32 against 26.0); under the max() it would err low on the two width
runs (-14 %, -12 %), so the dit family keeps the sum until those peaks are re-measured.
Re-check the constants when the model's forward, the optimizer step or the compile settings
change.
"""

from __future__ import annotations

import dataclasses
import math

from trainer.stages.declaration import MemoryRole
from trainer.stages.registry import get_stage

GIB = 2**30
ACT_BYTES = 39.0      # saved bytes per token x hidden_size per block, no checkpointing (bf16)
CKPT_BYTES = 4.0      # kept per token x hidden_size per block under full checkpointing
ATTENTION_BYTES = 2.0  # selective checkpointing also keeps each block's bf16 attention output
OVERHEAD_GIB = 2.0    # CUDA context, allocator fragmentation, communication buffers


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """GiB per GPU, by part; `lines` says how each was computed. `states_gib` holds no
    gradients: those of the largest trained role (`gradients_gib`) share the peak with the
    activations (the larger of the two), or add to them when `accumulating`."""

    states_gib: float
    gradients_gib: float
    working_gib: float
    activations_gib: float
    overhead_gib: float
    lines: tuple[str, ...]
    accumulating: bool = False

    @property
    def peak_term_gib(self) -> float:
        """What the step's peak adds to the states: max(activations, gradients), or their sum
        under gradient accumulation."""
        if self.accumulating:
            return self.activations_gib + self.gradients_gib
        return max(self.activations_gib, self.gradients_gib)

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.working_gib + self.peak_term_gib + self.overhead_gib

    def activation_room_gib(self, gpu_gib: float) -> float:
        """The most GiB the activations may take for the total to stay within `gpu_gib`
        (activations scale with the tokens a rank holds); 0 when nothing fits, whatever the
        activations."""
        room = gpu_gib - self.states_gib - self.working_gib - self.overhead_gib
        if self.accumulating:
            room -= self.gradients_gib
        elif room < self.gradients_gib:  # the gradients alone do not fit beside the states
            return 0.0
        return max(room, 0.0)

    def describe(self) -> str:
        return "\n".join([*self.lines, f"  total ~{self.total_gib:.1f} GiB per GPU "
                          f"(states {self.states_gib:.2f} + working set {self.working_gib:.2f} + "
                          f"{self.peak_term_gib:.2f} + overhead {self.overhead_gib:g})"])


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
                    lora: bool = False, lora_params: int | None = None,
                    gradient_accumulation_steps: int = 1, args=None) -> MemoryEstimate:
    """The memory one GPU needs for a step of `stage` (see the module docstring); with
    `pack_budget` (packing_token_budget) a micro-batch is one pack of that many joint tokens
    and batch_per_rank is not used. `family` (trainer.models.family) counts the parameters of
    the model `cfg` describes and gives its width and depth. `lora`: the trained role is a
    frozen base with `lora_params` adapter parameters (None: not known here, not counted).
    `gradient_accumulation_steps` > 1: the gradients live across the micro-batches' forwards,
    so they add to the activations instead of sharing the peak with them. `args`: the run's
    arguments, for roles that depend on them (Stage1's guidance teacher)."""
    counts = family.param_counts(cfg)
    geometry = family.geometry(cfg)
    p, per_block = counts.total, counts.per_block
    h, layers = geometry.hidden_size, geometry.num_layers
    lines = [f"  model: {p / 1e9:.3f}B parameters ({layers} blocks of {per_block / 1e6:.1f}M), "
             f"sharded over {shard_group} rank(s)"]
    states = 0.0
    grads, grads_of = 0.0, None  # the largest trained role's gradients, and its name
    declaration = get_stage(stage)
    for role in declaration.memory_roles(use_ema, args):
        if lora and role.trained:
            role_gib, role_grads, line = _lora_role(role, p, lora_params, use_muon, shard_group)
        else:
            role_gib, role_grads, line = _full_role(role, p, counts.muon if use_muon else 0,
                                                    use_muon, shard_group)
        states += role_gib
        lines.append(line)
        if role.trained and (grads_of is None or role_grads > grads):
            grads, grads_of = role_grads, role.name
    lines.append(f"  states without gradients: {states:.2f} GiB")
    # Two blocks gathered in bf16 (the one running, the one prefetched), one block's fp32
    # gradient before its reduce-scatter; nothing is gathered in one process.
    working = (2 * 2 + 4) * per_block / GIB if shard_group > 1 else 0.0
    lines.append(f"  FSDP2 working set: (2 blocks x 2 B + 4 B) x {per_block / 1e6:.1f}M = "
                 f"{working:.2f} GiB")
    copies = declaration.video_copies  # teacher forcing runs clean | noisy video
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
        ckpt_bytes = getattr(family, "checkpoint_bytes", None) or CKPT_BYTES
        kept = ckpt_bytes + (ATTENTION_BYTES if selective else 0.0)
        acts = unit * (kept * layers + act_bytes)
        how = f"({kept:g} B x {layers} blocks + {act_bytes:g} B for the recomputed one)"
    else:
        acts = unit * act_bytes * layers
        how = f"{act_bytes:g} B x {layers} blocks"
    lines.append(f"  activations: {tokens} tokens per rank ({shape}) x hidden {h} x {how} = "
                 f"{acts:.2f} GiB ({_checkpointing_name(checkpointing, selective)})")
    overlap = getattr(family, "gradients_overlap_activations", False)
    accumulating = gradient_accumulation_steps > 1 or not overlap
    lines.append(f"  gradients ({grads_of}, the largest trained role): {grads:.2f} GiB")
    if accumulating:
        why = (f"gradient_accumulation_steps {gradient_accumulation_steps}: the gradients live "
               f"across the micro-batches' forwards" if overlap else
               "the family's peaks were calibrated with both held")
        lines.append(f"  activations + gradients = {acts:.2f} + {grads:.2f} = {acts + grads:.2f} "
                     f"GiB ({why})")
    else:
        won = "activations" if acts >= grads else "gradients"
        lines.append(f"  max(activations {acts:.2f}, gradients {grads:.2f}) = "
                     f"{max(acts, grads):.2f} GiB ({won}: backward fills the gradients as it "
                     f"frees the activations)")
    lines.append(f"  overhead: {OVERHEAD_GIB:g} GiB")
    return MemoryEstimate(states, grads, working, acts, OVERHEAD_GIB, tuple(lines), accumulating)


def _full_role(role: MemoryRole, p: int, muon: int, use_muon: bool,
               shard_group: int) -> tuple[float, float, str]:
    """(GiB of states without gradients, GiB of gradients, the line saying so) of a role:
    fp32 parameters, and for a trained one the optimizer state (Muon's one momentum for the
    `muon` hidden-matrix parameters, AdamW's two moments for the rest), its EMA and fp32
    gradients (4 B, counted apart)."""
    bytes_per = 4.0  # fp32 parameters
    what = ["params 4"]
    if role.trained:
        optim = (4 * muon + 8 * (p - muon)) / p
        bytes_per += optim
        what.append(f"{'Muon+AdamW' if use_muon else 'AdamW'} {optim:.1f}")
    if role.ema:
        bytes_per += 4
        what.append("EMA 4")
    role_gib = bytes_per * p / shard_group / GIB
    line = (f"  {role.name}: ({' + '.join(what)}) = {bytes_per:.1f} B x {p / 1e9:.3f}B "
            f"/ {shard_group} = {role_gib:.2f} GiB")
    if not role.trained:
        return role_gib, 0.0, line + " (frozen)"
    grads = 4.0 * p / shard_group / GIB
    return role_gib, grads, line + f"; gradients 4 B = {grads:.2f} GiB"


def _lora_role(role: MemoryRole, p: int, adapters: int | None, use_muon: bool,
               shard_group: int) -> tuple[float, float, str]:
    """(GiB of states without gradients, GiB of gradients, the line saying so) of a
    LoRA-trained role: the fp32 base, parameters only, and the adapters with their optimizer
    state (Muon: one momentum, every adapter weight is a matrix), EMA and gradients."""
    base_gib = 4.0 * p / shard_group / GIB
    if adapters is None:
        return base_gib, 0.0, (
            f"  {role.name}: frozen base (params 4) = 4.0 B x {p / 1e9:.3f}B / "
            f"{shard_group} = {base_gib:.2f} GiB; LoRA adapters not counted (the model family "
            f"does not list its linear layers)")
    per = 4 + (4 if use_muon else 8) + (4 if role.ema else 0)
    what = ["params 4", f"{'Muon' if use_muon else 'AdamW'} {4 if use_muon else 8}"]
    if role.ema:
        what.append("EMA 4")
    adapter_gib = per * adapters / shard_group / GIB
    grads = 4.0 * adapters / shard_group / GIB
    return base_gib + adapter_gib, grads, (
        f"  {role.name}: frozen base (params 4) = 4.0 B x {p / 1e9:.3f}B / {shard_group} = "
        f"{base_gib:.2f} GiB; LoRA adapters ({' + '.join(what)}) = {per:.1f} B x "
        f"{adapters / 1e6:.3f}M / {shard_group} = {adapter_gib:.3f} GiB; their gradients "
        f"4 B = {grads:.3f} GiB")


def _checkpointing_name(checkpointing: bool, selective: bool) -> str:
    if not checkpointing:
        return "without checkpointing"
    return "selective checkpointing" if selective else "with checkpointing"
