"""What sparse video attention (`video_attention_sparsity` > 0) requires of a run (no torch here),
called from trainer.preflight: valid keys, a model family that has it, and none of the forms it
does not run (docs/model.md, "Sparse video attention").

It runs the bidirectional forward's video self-attention only: tiles of one sample's latent grid,
every query tile over its top-k key tiles, in tile-major order for the whole forward pass. So
it is refused, each in one paragraph saying what and how to fix, for
- a stage that calls teacher forcing or the KV-cache rollout (the causal distillation stages):
  their block-causal masks over [clean | noisy] chunks and cached keys are another sparsity
  pattern, which the tile selection does not compose with;
- a causal model (`causal_chunk_size` set), whose plain forward is block-causal too;
- packed batches (`packing_token_budget`, or data of mixed shapes): FA4's block-sparse backward
  has no varlen form, and one pack holds several grids;
- context parallel (`cp_size` > 1): Ulysses hands attention every token of a subset of heads,
  but the tile-major order and the selection would have to cross ranks.
"""

from __future__ import annotations

from trainer.config.schema import ConfigError, ResolvedArgs


def validate_sparse_attention(args: ResolvedArgs) -> None:
    """Raise ConfigError when the run's sparse video attention keys are invalid or it cannot
    run with these arguments; nothing to check at sparsity 0 beyond the keys themselves."""
    sparsity = args.video_attention_sparsity
    tile = args.video_attention_tile
    warmup = args.video_attention_sparsity_warmup_steps
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(
            f"`video_attention_sparsity` must lie in [0, 1): it is the fraction of video key "
            f"tiles each query tile skips (0: dense attention), got {sparsity}. Set a value "
            f"such as 0.5 or 0.9, or 0 for dense attention.")
    if not (isinstance(tile, (list, tuple)) and len(tile) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in tile)):
        raise ConfigError(
            f"`video_attention_tile` must be three positive integers [frames, rows, cols] of "
            f"latent tokens after patching, got {tile}. Set e.g. [2, 8, 8] (128 tokens, the "
            f"tile FlashAttention 4's block-sparse kernel runs).")
    if warmup < 0:
        raise ConfigError(
            f"`video_attention_sparsity_warmup_steps` must be >= 0 (0: the target sparsity "
            f"from the first step), got {warmup}.")
    if sparsity == 0:
        if args.video_attention_own_tile:
            raise ConfigError(
                "`video_attention_own_tile: true` keeps each query tile's own key tile among "
                "the tiles sparse attention attends, but video_attention_sparsity is 0 (dense "
                "attention, every tile attended). Set video_attention_sparsity (e.g. 0.8), or "
                "leave video_attention_own_tile out.")
        return
    from trainer.checks.stage import _needs_of_the_data
    from trainer.models.family import CAPABILITIES
    from trainer.models.registry import family_of, model_config
    from trainer.stages.registry import builtin_stages, stage_of

    family = family_of(args)
    fix = "set video_attention_sparsity: 0 (dense attention)"
    if family.missing_capabilities(["sparse_video_attention"]):
        raise ConfigError(
            f"video_attention_sparsity {sparsity:g} asks for "
            f"{CAPABILITIES['sparse_video_attention']}, which model family {family.name!r} "
            f"cannot do. Train with a family that has it (model_family: wan or dit), or {fix}.")
    stage = stage_of(args)
    causal_forms = ("teacher_forcing", "kv_cache")
    causal = [c for c in causal_forms if c in stage.capabilities]
    if causal:
        bidirectional = " or ".join(d.name for d in builtin_stages()
                                    if not set(causal_forms) & set(d.capabilities))
        raise ConfigError(
            f"video_attention_sparsity {sparsity:g}: stage {args.stage} runs "
            f"{' and '.join(CAPABILITIES[c] for c in causal)}, which sparse video attention "
            f"does not support (it selects key tiles within one bidirectional forward; the "
            f"block-causal masks over [clean | noisy] chunks and the cached keys are another "
            f"pattern). Train the sparse model with stage {bidirectional} (pretrain, SFT or "
            f"LoRA), and run "
            f"this stage with {fix}.")
    geometry = family.geometry(model_config(args))
    if geometry.causal_chunk_frames is not None:
        raise ConfigError(
            f"video_attention_sparsity {sparsity:g}: the model is causal (its config has "
            f"causal chunks of {geometry.causal_chunk_frames} latent frames), so its forward is "
            f"block-causal, which sparse video attention does not support. Train a "
            f"bidirectional model (no causal chunks in transformer_config_overrides), or {fix}.")
    if "packed" in _needs_of_the_data(args):
        raise ConfigError(
            f"video_attention_sparsity {sparsity:g}: this run's batches are packs "
            f"(packing_token_budget, or data of mixed shapes), which sparse video attention does "
            f"not support (FlashAttention 4's block-sparse backward has no varlen form, and a "
            f"pack holds several grids). Train on data of one shape without "
            f"packing_token_budget, or {fix}.")
    if args.cp_size > 1:
        raise ConfigError(
            f"video_attention_sparsity {sparsity:g}: cp_size {args.cp_size} splits each "
            f"sample's tokens over ranks (Ulysses), which sparse video attention does not "
            f"support (its tile order and key selection would cross ranks). Set cp_size: 1 (and "
            f"shard with FSDP over more data-parallel ranks), or {fix}.")
