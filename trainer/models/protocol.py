"""The module half of a model family: the calls the stages make on a built model, and the
hooks through which relay shards, compiles, checkpoints and splits it.

`FamilyModule` is a typing Protocol: a family's nn.Module implements the methods its
capabilities promise (trainer.models.family.CAPABILITIES) and every structural hook. The stages
call only these; trainer.build and trainer.parallel use only the hooks.

Calls, by capability (shapes: x [B, C, T, H, W] latents, text [B, L, text_dim], text_mask
[B, L]; a time is one value per sample [B] or, with per_frame_times, one per latent frame
[B, T], in raw timesteps):
- always: `forward(x, t, text, text_mask=None, r=None)` -> velocity like x.
- packed: `forward_packed(xs, ts, texts, text_masks)` -> a list, one output per sample.
- teacher_forcing: `forward_teacher_forcing(noisy, clean, t, text, text_mask, r=None)`
  (and `forward_teacher_forcing_packed`): each chunk of `noisy` sees the clean chunks before it.
- kv_cache: `new_kv_cache(text, text_mask)`, `forward_chunk(x_chunk, t_chunk, cache,
  frame_start, r_chunk=None)`, `commit_chunk(x_chunk_clean, cache, frame_start)`, and their
  packed forms `new_packed_kv_cache`, `forward_chunk_packed`, `commit_chunk_packed`.
- two_time: the `r` argument above, and `init_second_time_from_first()` (the second time
  input made equal to the first, so the model starts as the single-time one at r = t).

Hooks: `config` (the dict the family built it from), `geometry` (trainer.models.family.Geometry),
`fsdp_units()` (submodules FSDP2 shards as their own units, innermost first; the root is
sharded last), `checkpoint_units()` (what activation checkpointing wraps), `compile_blocks()`,
`attach_context_parallel(ulysses)` (where Ulysses' exchanges run). Optional:
`init_weights()` (the constructor's initialisation again, non-persistent buffers included, on
a module built on the meta device and materialised empty): a family that has it is built
sharded from the start when a multi-rank run streams its weights from safetensors files
(trainer.build); one without it is built whole first, as before.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# The calls besides forward; FSDP2 unshards around each of them (register_fsdp_forward_method).
FORWARD_METHODS = ("forward_packed", "forward_teacher_forcing", "forward_teacher_forcing_packed",
                   "new_kv_cache", "forward_chunk", "commit_chunk", "new_packed_kv_cache",
                   "forward_chunk_packed", "commit_chunk_packed")


@runtime_checkable
class FamilyModule(Protocol):
    config: dict[str, Any]

    @property
    def geometry(self): ...

    def forward(self, x, t, text, text_mask=None, r=None): ...

    def fsdp_units(self) -> list: ...

    def checkpoint_units(self) -> list: ...

    def compile_blocks(self) -> None: ...

    def attach_context_parallel(self, ulysses) -> None: ...
