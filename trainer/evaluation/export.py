"""`relay export`: a checkpoint's weights written in the layout a user loads next.

One writer per format (EXPORT_FORMATS), each given the same ExportSource (which checkpoint,
which weights, the model config it was trained with):

- `relay`: model.safetensors plus model_config.json beside it (`--out` names the file); relay's
  warm starts read it.
- `diffusers`: a diffusers directory (`--out` names it). transformer/ holds config.json and
  diffusion_pytorch_model.safetensors (shards and an index above `max_shard_size`), written by
  diffusers' own class of the family (the family's `diffusers_export`) from a model built on the meta device
  and given the checkpoint's tensors. The pipeline's other parts (model_index.json, vae/,
  text_encoder/, tokenizer/, scheduler/) come from the diffusers pipeline directory the run
  started from (its `pretrained_transformer_path`, followed back through warm starts from other
  relay runs) or from `components`; each file of 1 MiB or more is hardlinked (a copy where the
  filesystem refuses a link), smaller ones are copied, so the export stands alone and costs no
  space on the same filesystem. A causal model (a Stage2 student: `causal_chunk_size` set, single
  time) is written with diffusers' keys, which are its own, and relay-sampling.json beside
  transformer/ (SAMPLING_FILE: the chunking, steps, timesteps and shift relay samples it with);
  diffusers' WanPipeline runs those weights bidirectionally. A two-time model (Stage1) is refused:
  its second time input has no place in diffusers' class (docs/wan.md, "Distilling Wan").
  A Wan2.2 A14B pipeline (transformer/ the high-noise expert, transformer_2/ the low-noise one,
  boundary_ratio in model_index.json) gets each expert in its folder: a run goes into the
  folder it started from (followed back as the pipeline is), `other_expert` (a run of the
  other folder) into the other; without it the other folder is the source pipeline's
  (docs/wan.md, "Wan2.2 A14B: two experts").

Every writer writes under a temporary name and renames into place; an existing output is
replaced only with `overwrite`. Every file written gets the mode a new file gets under the
umask (trainer.runtime.files.follow_umask: safetensors and diffusers create them 0600). Torch
and diffusers are imported inside the writers only: the login side reads the format names
without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from trainer.models.family import DiffusersExport
from trainer.runtime.files import follow_umask, replace_directory

LINK_FROM_BYTES = 1 << 20  # component files this large are hardlinked, smaller ones copied
DEFAULT_MAX_SHARD_SIZE = "10GB"  # diffusers' own default for save_pretrained
_FOLLOW_LIMIT = 16  # warm starts followed back from run to run to find a pipeline directory


class ExportError(Exception):
    """An export that cannot be written as asked; the message says what to do instead."""


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """What an export reads: a checkpoint-N/ directory, its run's arguments, the weights."""

    checkpoint: Path
    args: Any  # trainer.config.schema.ResolvedArgs
    weights: str  # "ema" or "live"
    member: str | None  # the member holding the live weights of a multi-role stage
    model_config: dict[str, Any]

    def describe(self) -> str:
        return f"the {self.weights} weights of {self.checkpoint}"


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    write: Callable[..., list[str]]  # (source, out, *, overwrite, **options) -> lines to print
    out: str  # what --out names
    options: tuple[str, ...] = ()  # keyword options (the --flags) the writer takes


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, format: str = "relay",
                      weights: str = "auto", overwrite: bool = False, **options) -> list[str]:
    """Export a checkpoint-N/ directory (or an output_dir's newest checkpoint) as `format`.

    `weights`: auto (EMA when saved), ema or live. `options` are the format's own (None: not
    given). Returns the lines that say what was written. Raises ExportError for a request the
    format cannot take, InferenceError for a path that names no checkpoint, CheckpointError
    for weights that cannot be read or written.
    """
    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {format!r}; known: {', '.join(EXPORT_FORMATS)}")
    spec = EXPORT_FORMATS[format]
    given = {key: value for key, value in options.items() if value is not None}
    foreign = [key for key in given if key not in spec.options]
    if foreign:
        flags = ", ".join(_flag(key) for key in foreign)
        owners = sorted({name for name, other in EXPORT_FORMATS.items()
                         if set(foreign) & set(other.options)})
        raise ExportError(f"{flags} {'applies' if len(foreign) == 1 else 'apply'} to "
                          f"--format {' or '.join(owners) or '(none)'}, not to --format {format}.")
    source = read_export_source(path, weights)
    _check_lora_request(source, format, bool(given.get("merge_lora")))
    if given.get("other_expert") is not None:  # read with the same --weights choice
        other = read_export_source(given["other_expert"], weights)
        from trainer.models.lora_targets import lora_enabled

        if lora_enabled(other.args):
            _check_lora_request(other, format, bool(given.get("merge_lora")))
        given["other_expert"] = other
    from trainer.evaluation.lora_export import LoraExportError
    from trainer.models.registry import FamilyError

    try:
        return spec.write(source, Path(out), overwrite=overwrite, **given)
    except LoraExportError as exc:
        raise ExportError(str(exc)) from None
    except FamilyError as exc:  # a plug-in family this process cannot import
        raise ExportError(f"cannot rebuild the model of {source.checkpoint}: {exc}") from None


def _check_lora_request(source: "ExportSource", format: str, merge_lora: bool) -> None:
    """A LoRA run's checkpoint holds adapters only: a full-weight format needs --merge-lora
    (trainer.evaluation.lora_export), and --merge-lora needs a LoRA run."""
    from trainer.models.lora_targets import lora_enabled

    lora = lora_enabled(source.args)
    if lora and format != "peft" and not merge_lora:
        raise ExportError(
            f"{source.checkpoint} is a LoRA run (lora_rank {source.args['lora_rank']}): it holds "
            f"the adapters only, the frozen base stays at {source.args.get('pretrained_transformer_path')}. "
            f"Export the adapters with --format peft, or the base with the adapters merged in "
            f"with --format {format} --merge-lora.")
    if merge_lora and not lora:
        raise ExportError(f"--merge-lora merges a LoRA run's adapters into its base, and "
                          f"{source.checkpoint} is a run that trained every weight (lora_rank "
                          f"0). Leave --merge-lora out.")


def read_export_source(path: str | os.PathLike, weights: str = "auto") -> ExportSource:
    """The checkpoint `path` means, its run's arguments and model config, and the weights
    `weights` picks (auto: EMA when the checkpoint has it). Raises InferenceError."""
    from trainer.checkpoint.layout import read_complete
    from trainer.evaluation.inference import (InferenceError, _checkpoint_args,
                                              inference_member, resolve_checkpoint_dir)
    from trainer.models.registry import FamilyError, model_config

    checkpoint = resolve_checkpoint_dir(path)
    args = _checkpoint_args(checkpoint)
    complete = read_complete(checkpoint)
    members = list(complete.get("members", []))
    if weights == "auto":
        weights = "ema" if "ema" in members else "live"
    if weights == "ema" and "ema" not in members:
        raise InferenceError(f"{checkpoint} has no EMA weights (members: {', '.join(members)}). "
                             f"Use --weights live.")
    # The config recorded at save time: the run's own, even where its source directory moved.
    config = complete.get("model_config")
    if config is None:
        try:
            config = model_config(args)
        except (ValueError, FamilyError) as exc:
            raise InferenceError(f"cannot rebuild the model config of {checkpoint}: {exc}") from None
    member = inference_member(args, checkpoint) if weights == "live" else None
    return ExportSource(checkpoint=checkpoint, args=args, weights=weights, member=member,
                        model_config=dict(config))


# ---------------------------------------------------------------------------------------------
# --format relay
# ---------------------------------------------------------------------------------------------

def write_relay(source: ExportSource, out: Path, *, overwrite: bool,
                merge_lora: bool = False) -> list[str]:
    """model.safetensors at `out` and model_config.json beside it (warm_start.export_weights);
    `merge_lora`: a LoRA run's base with its adapters merged in (trainer.evaluation.lora_export)."""
    from trainer.checkpoint.weights_source import MODEL_CONFIG_FILE
    from trainer.checkpoint.warm_start import export_weights

    state = None
    if merge_lora:
        from trainer.evaluation.lora_export import merged_state_dict

        state = merged_state_dict(source)
    written = export_weights(source.checkpoint, out, weights=source.weights, member=source.member,
                             model_config=source.model_config, overwrite=overwrite, state=state)
    return [f"wrote {written} and {written.with_name(MODEL_CONFIG_FILE)}"
            f"{' (LoRA merged into its base)' if merge_lora else ''}"]


# ---------------------------------------------------------------------------------------------
# --format diffusers
# ---------------------------------------------------------------------------------------------

TRANSFORMER_DIR = "transformer"
TRANSFORMER_2_DIR = "transformer_2"  # Wan2.2 A14B's low-noise expert (transformer/: high noise)
EXPERT_NAMES = {TRANSFORMER_DIR: "the high-noise expert", TRANSFORMER_2_DIR: "the low-noise expert"}
MODEL_INDEX = "model_index.json"
SAMPLING_FILE = "relay-sampling.json"  # a causal model's few-step settings, beside transformer/
SAMPLING_FORMAT = "relay.sampling"


def write_diffusers(source: ExportSource, out: Path, *, overwrite: bool,
                    components: str | None = None,
                    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
                    merge_lora: bool = False,
                    other_expert: ExportSource | None = None) -> list[str]:
    """A diffusers directory at `out`: the transformer always (transformer/, or transformer_2/
    for a run started from a Wan2.2 A14B pipeline's low-noise expert); model_index.json and the
    other components when a source pipeline directory is known (`components`: a pipeline
    directory, "none" for the transformer only, None: the one the run started from).
    `other_expert`: the other expert of an A14B pipeline, written into the other folder;
    without it an A14B pipeline's other expert folder is taken from the pipeline. Returns the
    lines to print. Raises ExportError (nothing written) for a family diffusers has no class
    for, a components directory that is not a complete pipeline fitting the transformer, two
    experts that do not make a pair, or an `out` that exists (without `overwrite`) or is not a
    directory an export may replace."""
    from trainer.models.registry import family_names, family_of, get_family

    family = source.args.get("model_family") or "dit"
    spec = family_of(source.args).diffusers_export
    if spec is None:
        known = ", ".join(f"{name} (diffusers' {get_family(name).diffusers_export.class_name})"
                          for name in family_names() if get_family(name).diffusers_export)
        raise ExportError(
            f"{source.checkpoint} is a model_family {family!r} run, and diffusers has no class "
            f"for that model, so --format diffusers cannot write it. --format diffusers writes "
            f"the families diffusers loads: {known}. Export this run with --format relay "
            f"(model.safetensors and model_config.json, which relay's warm starts, relay sample "
            f"and relay eval read).")
    _refuse_two_time(source)
    config = _diffusers_config(spec, source.model_config, family)
    sampling = _sampling_settings(spec, source)
    pipeline, note = _find_pipeline(components, source.args)
    experts = pipeline is not None and _holds_two_experts(pipeline)
    slot = _expert_folder(source.args) or TRANSFORMER_DIR
    other_slot = TRANSFORMER_2_DIR if slot == TRANSFORMER_DIR else TRANSFORMER_DIR
    other_config = None
    if other_expert is not None:
        other_config = _check_other_expert(spec, family, source, other_expert, slot, sampling,
                                           pipeline, experts)
    elif slot == TRANSFORMER_2_DIR and pipeline is not None and not experts:
        raise ExportError(
            f"{source.checkpoint} is a Wan2.2 A14B low-noise expert (its run started from a "
            f"transformer_2/ folder), and {pipeline} ({note}) has one transformer, so "
            f"WanPipeline would run it at every timestep. Give --components the A14B pipeline "
            f"(model_index.json with transformer_2 and boundary_ratio), or --components none to "
            f"write {TRANSFORMER_2_DIR}/ only.")
    if pipeline is not None:
        names = _pipeline_components(pipeline, spec)
        problems = spec.check_components(config, pipeline)
        if other_config is not None:
            problems += [f"{p} (the other expert)" for p in spec.check_components(other_config,
                                                                                  pipeline)]
        if problems:
            raise ExportError(
                f"the pipeline directory {pipeline} ({note}) does not fit this transformer: "
                f"{'; '.join(problems)}. Give --components a pipeline of the same model "
                f"(or --components none to write transformer/ only).")
    _check_out_dir(out, overwrite, source.checkpoint, pipeline,
                   other_expert.checkpoint if other_expert is not None else None)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.relay-export-{uuid.uuid4().hex[:8]}"
    try:
        lines = [_write_expert(spec, config, source, merge_lora, tmp, out, slot, max_shard_size,
                               experts or other_expert is not None)]
        if other_expert is not None:
            lines.append(_write_expert(spec, other_config, other_expert, merge_lora, tmp, out,
                                       other_slot, max_shard_size, True))
        sparse = _trained_sparse(source.args)
        if sampling is not None or sparse is not None:
            written = {**(sampling or {"format": SAMPLING_FORMAT, "version": 1}), **(sparse or {})}
            (tmp / SAMPLING_FILE).write_text(json.dumps(written, indent=2) + "\n")
        if sparse is not None:
            lines.append(f"wrote {out / SAMPLING_FILE}: trained with sparse video attention "
                         f"(sparsity {sparse['trained_sparse']['video_attention_sparsity']:g}); "
                         f"the weights are a dense model's")
        if sampling is not None:
            lines.append(f"wrote {out / SAMPLING_FILE}: a causal model (chunks of "
                         f"{_count(sampling['causal_chunk_size'], 'latent frame')}) distilled for "
                         f"{sampling['steps']} steps at shift {sampling['shift']:g}; diffusers' "
                         f"WanPipeline runs these weights bidirectionally, relay samples them "
                         f"causally with a KV cache (relay sample)")
        if pipeline is not None:
            taken = [*names, *([other_slot] if experts and other_expert is None else [])]
            linked, copied = _place_components(pipeline, taken, tmp)
            _write_model_index(pipeline, spec, tmp)
            lines.append(f"took {', '.join([MODEL_INDEX, *taken])} from {pipeline} ({note}): "
                         f"{_count(linked, 'file')} hardlinked, {copied} copied"
                         + (f"; {other_slot}/ is {EXPERT_NAMES[other_slot]} as it was there"
                            if experts and other_expert is None else ""))
        else:
            written = f"{slot}/" + (f" and {other_slot}/" if other_expert is not None else "")
            lines.append(f"wrote {written} only: {note}; pass --components PIPELINE_DIR for "
                         f"a directory {_pipeline_class(spec)}.from_pretrained loads.")
        replace_directory(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return lines


def _write_expert(spec: DiffusersExport, config: dict[str, Any], source: ExportSource,
                  merge_lora: bool, tmp: Path, out: Path, folder: str, max_shard_size: str,
                  expert: bool) -> str:
    """Write the transformer of `source` into tmp/`folder`; the line that says so (`expert`:
    it is one of an A14B pipeline's two)."""
    from trainer.checkpoint.warm_start import read_weights
    from trainer.checkpoint.weights_source import resolve_weights_source
    from trainer.models.lora_targets import lora_enabled

    if merge_lora and lora_enabled(source.args):  # a LoRA run's base with its adapters merged in
        from trainer.evaluation.lora_export import merged_state_dict

        state = merged_state_dict(source)
    else:
        state = read_weights(resolve_weights_source(source.checkpoint, weights=source.weights,
                                                    member=source.member))
    files = _save_transformer(spec, config, state, tmp / folder, max_shard_size)
    del state
    return (f"wrote {out / folder}: {spec.class_name} config.json and "
            f"{_count(len(files), 'safetensors file')}{' with an index' if len(files) > 1 else ''}"
            f", from {source.describe()}{f' ({EXPERT_NAMES[folder]})' if expert else ''}")


def _check_other_expert(spec: DiffusersExport, family: str, source: ExportSource,
                        other: ExportSource, slot: str, sampling, pipeline: Path | None,
                        experts: bool) -> dict[str, Any]:
    """The diffusers config of `other`, the second expert of an A14B export whose first,
    `source`, goes into `slot`. Raises ExportError when the two do not make a pair: another
    family, a two-time or causal model, both of one folder, or a pipeline of one transformer."""
    other_family = other.args.get("model_family") or "dit"
    if other_family != family:
        raise ExportError(f"--other-expert {other.checkpoint} is a model_family {other_family!r} "
                          f"run and {source.checkpoint} a {family!r} one: the experts of one "
                          f"pipeline are one model family. Give a run of the other expert.")
    _refuse_two_time(other)
    if sampling is not None or _sampling_settings(spec, other) is not None:
        raise ExportError(
            f"{source.checkpoint} or --other-expert {other.checkpoint} is a causal model "
            f"(causal_chunk_size set): relay samples a causal model alone, chunk by chunk, and "
            f"a pair of experts is sampled by WanPipeline bidirectionally, switching at "
            f"boundary_ratio. Export each causal model on its own.")
    other_slot = _expert_folder(other.args)
    if other_slot == slot:
        raise ExportError(
            f"{source.checkpoint} and --other-expert {other.checkpoint} are both "
            f"{EXPERT_NAMES[slot]}: each run started from an A14B pipeline's {slot}/ folder. "
            f"Give --other-expert a run of the other expert (started from "
            f"{TRANSFORMER_2_DIR if slot == TRANSFORMER_DIR else TRANSFORMER_DIR}/).")
    if pipeline is not None and not experts:
        raise ExportError(
            f"--other-expert writes a second transformer, which WanPipeline runs only for a "
            f"pipeline with transformer_2 and boundary_ratio in its model_index.json, and "
            f"{pipeline} has one transformer. Give --components the Wan2.2 A14B pipeline the "
            f"experts were trained from, or --components none to write both folders only.")
    return _diffusers_config(spec, other.model_config, family)


def _refuse_two_time(source: ExportSource) -> None:
    """A two-time model (Stage1's u(x, t, r)) has no diffusers form: its second time input
    (condition_embedder.time_embedder_r) feeds every block's time embedding (time_gate), so
    dropping it runs another model. Raises ExportError saying what to export instead."""
    config = source.model_config
    if not config.get("two_time"):
        return
    raise ExportError(
        f"{source.checkpoint} is a two-time model (two_time: true, time_gate "
        f"{config.get('time_gate')}: a Stage1 flow map), and diffusers' WanTransformer3DModel "
        f"has no second time input: dropping condition_embedder.time_embedder_r would change "
        f"what every block computes. Export the Stage2 student distilled from it (its second "
        f"time input is dropped there) with --format diffusers, or this run with --format "
        f"relay (relay sample and relay eval read it).")


def _trained_sparse(args) -> dict[str, Any] | None:
    """SAMPLING_FILE's note on a run trained with sparse video attention, or None."""
    if not args.get("video_attention_sparsity"):
        return None
    return {"trained_sparse": {
        **{key: args.get(key) for key in ("video_attention_sparsity", "video_attention_tile",
                                          "video_attention_own_tile",
                                          "video_attention_sparsity_warmup_steps")},
        "note": "trained with sparse video self-attention (each query tile over its top-k key "
                "tiles; docs/model.md): the weights are a dense model's, which diffusers and "
                "relay sample with dense attention."}}


def _sampling_settings(spec: DiffusersExport, source: ExportSource) -> dict[str, Any] | None:
    """SAMPLING_FILE's content for a model whose config sets one of `spec.sampling_keys` (a
    causal student), or None: the chunking, the steps and timesteps it was distilled for (its
    sampler's defaults), the shift, the guidance."""
    config = source.model_config
    if all(config.get(key) is None for key in spec.sampling_keys):
        return None
    from trainer.stages.registry import DEFAULT_STAGE, sampling_plan
    from trainer.stages.rollout import inference_sigmas

    args = source.args
    plan = sampling_plan(args)
    steps, guidance = plan.steps, plan.guidance
    shift = float(plan.shift)
    sigmas = inference_sigmas(steps, shift)
    return {
        "format": SAMPLING_FORMAT, "version": 1,
        "model_family": args.get("model_family"), "stage": args.get("stage", DEFAULT_STAGE),
        "checkpoint": str(source.checkpoint), "weights": source.weights,
        **{key: config.get(key) for key in sorted(spec.sampling_keys)},
        "sampler": "causal KV-cache rollout: chunk after chunk, each denoised at every step "
                   "then committed to the cache at t = 0",
        "steps": steps,
        "denoising_steps": list(args.get("dmd_denoising_steps") or []),
        "warp_denoising_step": args.get("warp_denoising_step"),
        "shift": shift,
        "sigmas": sigmas,
        "timesteps": [s * 1000.0 for s in sigmas],
        "guidance": guidance,
        "note": "diffusers' WanPipeline runs these weights bidirectionally (every frame at "
                "once, its own scheduler and steps); relay samples them causally with these "
                "settings (relay sample --checkpoint <run> --steps N).",
    }


def _diffusers_config(spec: DiffusersExport, config: dict[str, Any], family: str
                      ) -> dict[str, Any]:
    """The class's constructor arguments from relay's model config. Raises ExportError where
    relay's config sets what the installed diffusers' class cannot run (a causal or two-time
    form, a newer argument)."""
    import inspect

    import diffusers

    from trainer.models.registry import get_family

    accepted = set(inspect.signature(getattr(diffusers, spec.class_name).__init__).parameters)
    defaults = get_family(family).defaults()
    kept = {k: v for k, v in config.items() if k in accepted}
    changed = sorted(k for k, v in config.items() if k not in accepted
                     and k not in spec.ignored_keys | spec.sampling_keys
                     and (k not in defaults or v != defaults[k]))
    if changed:
        settings = ", ".join(f"{k}: {json.dumps(config[k])}" for k in changed)
        raise ExportError(
            f"this run's model config sets {settings}, which diffusers {diffusers.__version__}'s "
            f"{spec.class_name} has no argument for: it would load the weights and run another "
            f"model. Export this run with --format relay (model.safetensors and "
            f"model_config.json, which relay's warm starts, relay sample and relay eval read).")
    return kept


def _save_transformer(spec: DiffusersExport, config: dict[str, Any], state: dict, directory: Path,
                      max_shard_size: str) -> list[Path]:
    """Write `state` with diffusers' save_pretrained from the class built on the meta device
    (no memory for a second copy of the weights); check what was written. Returns the
    safetensors files."""
    import torch

    import diffusers

    from trainer.checkpoint.layout import CheckpointError
    from trainer.checkpoint.weights_source import resolve_weights_source, safetensors_keys

    with torch.device("meta"):
        model = getattr(diffusers, spec.class_name)(**config)
    # safetensors refuses tensors that share memory: each gets its own contiguous storage.
    tensors = {key: value.detach().contiguous() for key, value in state.items()}
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint's weights do not fit diffusers' {spec.class_name} "
                          f"built from the run's config: {str(exc).splitlines()[0]}") from None
    try:
        model.save_pretrained(str(directory), safe_serialization=True,
                              max_shard_size=max_shard_size)
    except ValueError as exc:  # a max_shard_size diffusers cannot read
        raise ExportError(f"--max-shard-size {max_shard_size!r}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"could not write the export ({exc.strerror or exc}); nothing "
                              f"was left at the output path. Free space or choose another.") from None
    files = resolve_weights_source(directory, weights="live").files
    # diffusers leaves its safetensors readable by their owner only; an export is for sharing:
    # as readable as any file this process creates.
    follow_umask(*files)
    written = {key: shape for file in files for key, shape in safetensors_keys(file).items()}
    expected = {key: tuple(value.shape) for key, value in tensors.items()}
    if written != expected:
        raise CheckpointError(f"the safetensors written to {directory} do not hold the "
                              f"checkpoint's tensors ({len(written)} of {len(expected)} keys "
                              f"with their shapes); nothing was published.")
    return list(files)


def _find_pipeline(components: str | None, args) -> tuple[Path | None, str]:
    """(the pipeline directory whose other components the export takes, how it was found) or
    (None, why there is none). Raises ExportError for a --components that is no pipeline."""
    if components == "none":
        return None, "--components none"
    if components is not None:
        path = Path(components)
        if not (path / MODEL_INDEX).is_file():
            what = "does not exist" if not path.exists() else (
                "is a file" if not path.is_dir() else f"has no {MODEL_INDEX}")
            raise ExportError(
                f"--components {path} is not a diffusers pipeline directory: it {what}. Give "
                f"the directory a diffusers pipeline loads from (model_index.json, vae/, "
                f"text_encoder/, tokenizer/, scheduler/), or leave --components out.")
        return path, "--components"
    pipeline, _, note = _origin(args)
    return pipeline, note


def _expert_folder(args) -> str | None:
    """The transformer folder of a pipeline directory the run started from (followed back
    through the relay runs it started from): transformer/ or, Wan2.2 A14B's low-noise expert,
    transformer_2/; None when it started from a pipeline directory itself or from none."""
    return _origin(args)[1]


def _origin(args) -> tuple[Path | None, str | None, str]:
    """(the pipeline directory the run's weights came from, the transformer folder of it that
    was named or None, how it was found), followed back through earlier relay runs; (None,
    None, why there is none) when they lead to no pipeline directory."""
    path = _start_path(args)
    for _ in range(_FOLLOW_LIMIT):
        if path is None:
            return None, None, "the run did not start from a diffusers pipeline directory"
        start = Path(path)
        pipeline = _pipeline_root(start)
        if pipeline is not None:
            folder = start.name if start != pipeline else None
            return pipeline, folder, "the pipeline the run started from"
        earlier = _run_args(start)
        if earlier is None:
            return None, None, (f"the run started from {start}, which is not (or no longer) a "
                                f"diffusers pipeline directory")
        path = _start_path(earlier)
    return None, None, "the runs it started from lead to no diffusers pipeline directory"


def _start_path(args) -> str | None:
    """The weights a run's own model started from, the key its stage declares first:
    pretrained_transformer_path (when loaded), or a Stage2 run's student_init_path (the Stage1
    run, which started from SFT, which started from the pipeline directory)."""
    from trainer.stages.registry import model_source_key

    key = model_source_key(args)
    return args.get(key) if key else None


def _pipeline_root(path: Path) -> Path | None:
    """A diffusers pipeline directory: `path` itself, or the parent of its transformer/ (or
    transformer_2/, an A14B pipeline's low-noise expert)."""
    if (path / MODEL_INDEX).is_file():
        return path
    if path.name in EXPERT_NAMES and (path.parent / MODEL_INDEX).is_file():
        return path.parent
    return None


def _holds_two_experts(pipeline: Path) -> bool:
    """Whether `pipeline` is a Wan2.2 A14B pipeline: its model_index.json names transformer_2
    and sets boundary_ratio (without one WanPipeline never runs transformer_2)."""
    index = _read_json(pipeline / MODEL_INDEX)
    return isinstance(index, dict) and isinstance(index.get(TRANSFORMER_2_DIR), list) and \
        index[TRANSFORMER_2_DIR][0] is not None and index.get("boundary_ratio") is not None


def _run_args(path: Path) -> dict[str, Any] | None:
    """The resolved arguments of the relay run a warm-start path names (an output_dir, a
    checkpoint-N/ or one of its members), or None for anything else."""
    from trainer.checkpoint.layout import METADATA_FILE, RESOLVED_CONFIG_FILE

    candidates = [path / RESOLVED_CONFIG_FILE]
    if (path / METADATA_FILE).is_file():  # a checkpoint member: the checkpoint's config
        candidates += [path.parent / RESOLVED_CONFIG_FILE, path.parent.parent / RESOLVED_CONFIG_FILE]
    for candidate in candidates:
        found = _read_json(candidate)
        if found is not None:
            return found
    return None


def _pipeline_components(pipeline: Path, spec: DiffusersExport) -> list[str]:
    """The component folders model_index.json names, other than the transformers (transformer/,
    an A14B pipeline's transformer_2/). Raises ExportError for an unreadable index, a missing
    folder, or a pipeline whose transformers are not the family's."""
    index = _read_json(pipeline / MODEL_INDEX)
    if not isinstance(index, dict):
        raise ExportError(f"{pipeline / MODEL_INDEX} is not a readable JSON object: the "
                          f"pipeline directory is damaged; download it again.")
    named = {key: value for key, value in index.items() if not key.startswith("_")
             and isinstance(value, list) and len(value) == 2 and value[0] is not None}
    for folder in EXPERT_NAMES:
        transformer = named.pop(folder, None)
        if transformer is not None and transformer[1] != spec.class_name:
            raise ExportError(f"{pipeline} is a pipeline of {transformer[1]} ({folder}), not of "
                              f"{spec.class_name}: its components do not go with this "
                              f"transformer.")
    if _holds_two_experts(pipeline):  # an expert folder may be taken from it: both must be there
        named.update({folder: ["diffusers", spec.class_name] for folder in EXPERT_NAMES
                      if not (pipeline / folder).is_dir()})
    missing = [name for name in named if not (pipeline / name).is_dir()]
    if missing:
        raise ExportError(f"{pipeline} names {', '.join(missing)} in {MODEL_INDEX} but has no "
                          f"such folder: the download is incomplete; fetch it again.")
    return sorted(name for name in named if name not in EXPERT_NAMES)


def _pipeline_class(spec: DiffusersExport) -> str:
    return {"WanTransformer3DModel": "WanPipeline"}.get(spec.class_name, "DiffusionPipeline")


def _write_model_index(pipeline: Path, spec: DiffusersExport, target: Path) -> None:
    """The pipeline's model_index.json, its transformer entry (and an A14B pipeline's
    transformer_2 entry; boundary_ratio as it was) naming the exported class (a source may
    leave it null), written as a new file (never through a link to the source's)."""
    index = _read_json(pipeline / MODEL_INDEX)
    index[TRANSFORMER_DIR] = ["diffusers", spec.class_name]
    if _holds_two_experts(pipeline):
        index[TRANSFORMER_2_DIR] = ["diffusers", spec.class_name]
    (target / MODEL_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _place_components(pipeline: Path, names: list[str], target: Path) -> tuple[int, int]:
    """Files of `names` (files or folders of `pipeline`) into `target`: hardlinked from
    LINK_FROM_BYTES, copied below (or where the filesystem refuses a link); symlinks followed
    (a Hugging Face cache's snapshot links to its blobs). Returns (linked, copied)."""
    linked = copied = 0
    for name in names:
        root = pipeline / name
        files = [root] if root.is_file() else [
            Path(folder) / file for folder, _, found in os.walk(root, followlinks=True)
            for file in found]
        for file in files:
            destination = target / file.relative_to(pipeline)
            destination.parent.mkdir(parents=True, exist_ok=True)
            if file.stat().st_size >= LINK_FROM_BYTES:
                try:
                    os.link(file.resolve(), destination)
                    linked += 1
                    continue
                except OSError:
                    pass  # another filesystem, or links not allowed: copy
            shutil.copy2(file, destination)
            copied += 1
    return linked, copied


def _check_out_dir(out: Path, overwrite: bool, checkpoint: Path, pipeline: Path | None,
                   other_checkpoint: Path | None = None) -> None:
    """Refuse an `out` that is a file, overlaps a checkpoint or the source pipeline, or
    exists without `overwrite`; with it, only a diffusers directory (a previous export) may be
    replaced, never a directory holding something else."""
    resolved = out.resolve()
    for other, what in ((checkpoint.resolve(), "the checkpoint"),
                        (pipeline.resolve() if pipeline else None, "the source pipeline"),
                        (other_checkpoint.resolve() if other_checkpoint else None,
                         "the other expert's checkpoint")):
        if other is not None and (resolved == other or other in resolved.parents
                                  or resolved in other.parents):
            raise ExportError(f"--out {out} overlaps {what} {other}: an export never writes "
                              f"into what it reads. Choose another directory.")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, and --format diffusers writes a directory: choose a "
                          f"directory path (it is created).")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(f"{out} already exists: an export does not replace it unless asked. "
                          f"Choose another directory, or replace it on purpose with relay "
                          f"export --force.")
    if not ((out / TRANSFORMER_DIR).is_dir() or (out / TRANSFORMER_2_DIR).is_dir()
            or (out / MODEL_INDEX).is_file()):
        raise ExportError(f"{out} holds files that are not a diffusers directory (no "
                          f"transformer/, no {MODEL_INDEX}); --force replaces only a previous "
                          f"export. Choose another directory.")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _write_peft(source: ExportSource, out: Path, *, overwrite: bool,
                other_expert: ExportSource | None = None) -> list[str]:
    """A LoRA run's adapters as a peft/diffusers LoRA directory; with `other_expert`, the LoRA
    runs of both experts of a Wan2.2 A14B directory as two named adapters
    (trainer.evaluation.lora_export)."""
    from trainer.evaluation.lora_export import write_peft, write_peft_pair

    if other_expert is None:
        return write_peft(source, out, overwrite=overwrite)
    runs = [(source, _expert_folder(source.args)), (other_expert, _expert_folder(other_expert.args))]
    folders = {folder: run for run, folder in runs}
    if set(folders) != {"transformer", "transformer_2"}:
        said = "; ".join(f"{run.describe()} started from {folder + '/' if folder else 'no expert folder'}"
                         for run, folder in runs)
        raise ExportError(
            f"--format peft --other-expert writes the LoRA adapters of a Wan2.2 A14B pair, one "
            f"run of each expert: {said}. Give one LoRA run started from the directory's "
            f"transformer/ (the high-noise expert) and one from its transformer_2/.")
    return write_peft_pair(folders, out, overwrite=overwrite)


EXPORT_FORMATS: dict[str, ExportFormat] = {
    "relay": ExportFormat(write_relay, out="the model.safetensors file (model_config.json "
                                           "beside it)", options=("merge_lora",)),
    "diffusers": ExportFormat(write_diffusers, out="the directory (transformer/, and the "
                                                   "pipeline's components when known)",
                              options=("components", "max_shard_size", "merge_lora",
                                       "other_expert")),
    "peft": ExportFormat(_write_peft, out="the directory (adapter_model.safetensors and "
                                          "adapter_config.json of a LoRA run; with "
                                          "--other-expert, high_noise/ and low_noise/)",
                         options=("other_expert",)),
}
