"""Using a trained checkpoint: load it for sampling, write videos, score it, export it.

Everything here reads a checkpoint the trainer wrote (a checkpoint-N/ directory, or an
output_dir meaning its newest complete checkpoint) together with the resolved config saved
inside it, so the model is rebuilt exactly as trained. This backs `relay sample`, `relay eval`,
the trainer's validation, and `relay export` (trainer.evaluation.export).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainer.checkpoint.layout import CheckpointError, list_checkpoints
from trainer.checkpoint.warm_start import load_warm_start
from trainer.config.schema import ResolvedArgs
from trainer.models.lora_targets import lora_enabled


class InferenceError(Exception):
    """A checkpoint or request that cannot be sampled; the message says what to fix."""


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module
    args: ResolvedArgs
    text_encoder: object
    checkpoint: Path
    weights: str
    latent_shape: tuple[int, int, int, int]  # [C, T, H, W] of one sample
    attention: str = "dense"  # how video self-attention runs: "dense" or "sparse S, tile TxHxW"

    @property
    def step(self) -> int:
        return int(self.checkpoint.name.split("-")[-1])


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint-N/ directory as given, or an output_dir's newest complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise InferenceError(f"{path} does not exist. Pass a checkpoint-N/ directory or a run's "
                             f"output_dir.")
    if (path / "COMPLETE").is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise InferenceError(f"{path} holds no complete checkpoint (checkpoint-N/ with a "
                             f"COMPLETE marker). Train longer or point at another run.")
    return found[-1]


def _checkpoint_args(checkpoint: Path) -> ResolvedArgs:
    for candidate in (checkpoint / "resolved-config.json",
                      checkpoint.parent / "resolved-config.json"):
        if candidate.is_file():
            return ResolvedArgs(json.loads(candidate.read_text()))
    raise InferenceError(f"no resolved-config.json in {checkpoint} or its run directory; "
                         f"relay cannot rebuild the model it was trained with.")


def _check_family(checkpoint: Path, args: ResolvedArgs) -> None:
    """The run's model_family is one this process can build: a plug-in
    ("package.module:Class") is imported as the run imported it. Raises InferenceError."""
    from trainer.models.registry import FamilyError, family_of

    try:
        family_of(args)
    except FamilyError as exc:
        raise InferenceError(f"cannot rebuild the model of {checkpoint}: {exc}") from None


def inference_member(args: ResolvedArgs, checkpoint: Path) -> str | None:
    """The checkpoint member whose live weights are sampled, for a stage with several roles
    (its declaration's `inference_member`); None for a stage of one model. Raises
    InferenceError when the run's stage cannot be found here (a plug-in off the path)."""
    from trainer.config.schema import ConfigError
    from trainer.stages.registry import stage_of

    try:
        return stage_of(args).inference_member
    except ConfigError as exc:
        raise InferenceError(f"cannot sample {checkpoint}: {exc}") from None


def _members(checkpoint: Path) -> list[str]:
    return list(json.loads((checkpoint / "COMPLETE").read_text()).get("members", []))


ATTENTION_CHOICES = ("dense", "trained")


def load_model_for_inference(path: str | Path, weights: str = "auto",
                             device: torch.device | str = "cpu",
                             attention: str = "dense") -> LoadedModel:
    """Rebuild and load the model of a checkpoint. weights: auto (EMA if saved), ema, live.
    attention: dense (full video self-attention, as diffusers runs the weights) or trained
    (the sparse video attention the run trained with, at its target sparsity; dense for a
    run trained dense)."""
    if attention not in ATTENTION_CHOICES:
        raise InferenceError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, "
                             f"got {attention!r}.")
    from trainer.build import build_model, build_text_encoder

    checkpoint = resolve_checkpoint_dir(path)
    args = _checkpoint_args(checkpoint)
    members = _members(checkpoint)
    if weights == "auto":
        weights = "ema" if "ema" in members else "live"
    if weights == "ema" and "ema" not in members:
        raise InferenceError(f"{checkpoint} has no EMA weights (members: {', '.join(members)}). "
                             f"Use --weights live.")
    _check_family(checkpoint, args)
    model = build_model(args, torch.device(device))
    # Multi-role checkpoints keep the sampled model's live weights under its role name.
    member = inference_member(args, checkpoint) if weights == "live" else None
    try:
        if lora_enabled(args):  # base by reference, adapters from the checkpoint (docs/lora.md)
            from trainer.checkpoint.lora_weights import load_lora_checkpoint

            load_lora_checkpoint(model, args, checkpoint, weights=weights, member=member)
        else:
            load_warm_start(checkpoint, model, weights=weights, member=member)
    except CheckpointError as exc:
        raise InferenceError(str(exc)) from None
    model.eval()
    return LoadedModel(model=model, args=args, text_encoder=build_text_encoder(args),
                       checkpoint=checkpoint, weights=weights,
                       latent_shape=_latent_shape(args),
                       attention=apply_attention(model, args, attention))


def apply_attention(model: nn.Module, args: ResolvedArgs, attention: str) -> str:
    """Makes the model's video self-attention dense, or (`attention` "trained") the sparse
    attention its run trained with; returns what it now runs, for reports."""
    sparsity = args.get("video_attention_sparsity") or 0.0
    if sparsity <= 0:
        return "dense"  # never set: the dense path
    from trainer.models.sparse_attention import set_video_attention_sparsity

    tile = args.video_attention_tile
    if attention != "trained":
        set_video_attention_sparsity(model, 0.0, tile)
        return "dense"
    own_tile = bool(args.get("video_attention_own_tile"))
    set_video_attention_sparsity(model, sparsity, tile, own_tile)
    return (f"sparse {sparsity:g}, tile {'x'.join(str(x) for x in tile)}"
            + (", own tile" if own_tile else ""))


def _latent_shape(args: ResolvedArgs) -> tuple[int, int, int, int]:
    from trainer.build import sample_latent_shape

    try:
        return sample_latent_shape(args)
    except Exception as exc:  # the training data may live on another machine
        raise InferenceError(f"cannot read the latent shape from the training data "
                             f"{args.data_path}: {exc}") from None


def generate(loaded: LoadedModel, prompts: list[str], *, steps: int | None,
             guidance: float | None, seed: int,
             first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """Latents [B, C, T, H, W] for the prompts, with the sampler of the checkpoint's stage.

    steps / guidance None: the stage's own settings (those its validation uses).
    """
    from trainer.stages.base import autocast_context
    from trainer.stages.registry import sampling_plan

    plan = sampling_plan(loaded.args)
    steps = plan.steps if steps is None else steps
    guidance = plan.guidance if guidance is None else guidance
    if steps < 1:
        raise InferenceError(f"--steps must be at least 1, got {steps}.")
    device = next(loaded.model.parameters()).device
    text, mask = loaded.text_encoder.encode(list(prompts))
    null_text, null_mask = loaded.text_encoder.null_embedding()
    generator = torch.Generator().manual_seed(seed)
    shape = (len(prompts), *loaded.latent_shape)
    sampler = plan.load_sampler()
    # the checkpoint's training compute dtype, as validation samples: bf16 on a GPU by default
    with autocast_context(device, loaded.args.get("dtype", "auto")):
        return sampler(loaded.model, text.to(device), mask.to(device), null_text.to(device),
                       null_mask.to(device), shape=shape, steps=steps, guidance=guidance,
                       shift=plan.shift, generator=generator,
                       first_frame=first_frame)


def _load_first_frame(path: str, loaded: LoadedModel) -> torch.Tensor:
    from PIL import Image

    c, _, h, w = loaded.latent_shape
    try:
        image = Image.open(path).convert("RGB").resize((w, h), Image.NEAREST)
    except (OSError, ValueError) as exc:
        raise InferenceError(f"cannot read --first-frame {path}: {exc}") from None
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
    return pixels.permute(2, 0, 1)[:c, None][None]  # [1, C, 1, H, W]


def sample_to_dir(checkpoint: str, prompt: str, *, out_dir: str, steps: int | None,
                  guidance: float | None,
                  seed: int, weights: str = "auto", first_frame: str | None = None,
                  attention: str = "dense") -> dict:
    """`relay sample`: one clip for one prompt, written as video, contact sheet and frames."""
    from trainer.evaluation.media import write_clip_files
    from trainer.encoders.vae import latents_to_clips

    loaded = load_model_for_inference(checkpoint, weights, attention=attention)
    cond = _load_first_frame(first_frame, loaded) if first_frame else None
    latents = generate(loaded, [prompt], steps=steps, guidance=guidance, seed=seed,
                       first_frame=cond)
    # A run from before vae_path existed has no such key: the identity VAE.
    clip = latents_to_clips(latents[:1], loaded.args.get("vae_path"))[0]
    paths = write_clip_files(clip, Path(out_dir))
    return {k: str(v) for k, v in paths.items()}


def evaluate_loaded(loaded: LoadedModel, *, steps: int | None, guidance: float | None,
                    seed: int, captions=None) -> dict:
    """Sample the fixed caption set of the checkpoint's data and score it from the pixels
    (colour and direction; for the benchmark every attribute and fidelity)."""
    from trainer.evaluation.evaluate import evaluation_suite
    from trainer.encoders.vae import latents_to_clips
    from trainer.stages.registry import sampling_plan

    plan = sampling_plan(loaded.args)
    steps = plan.steps if steps is None else steps
    guidance = plan.guidance if guidance is None else guidance

    suite_captions, score = evaluation_suite(loaded.args.get("synthetic_generator", "shapes"))
    captions = list(captions or suite_captions)
    latents = generate(loaded, captions, steps=steps, guidance=guidance, seed=seed)
    report = score(latents_to_clips(latents, loaded.args.get("vae_path")), captions)
    report.update({"checkpoint": str(loaded.checkpoint), "weights": loaded.weights,
                   "attention": loaded.attention, "steps": steps, "guidance": guidance,
                   "seed": seed, "step": loaded.step})
    return report


def evaluate_checkpoint(checkpoint: str, *, steps: int | None, guidance: float | None, seed: int,
                        weights: str = "auto", out: str | None = None,
                        attention: str = "dense") -> dict:
    """`relay eval`: score a checkpoint and write eval.json (default: in its run directory)."""
    loaded = load_model_for_inference(checkpoint, weights, attention=attention)
    report = evaluate_loaded(loaded, steps=steps, guidance=guidance, seed=seed)
    path = Path(out) if out else loaded.checkpoint.parent / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    report["path"] = str(path)
    return report
