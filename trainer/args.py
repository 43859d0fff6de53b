"""The one argument parser of train.py: every key, its type, its default and its help.

Precedence (the contract in docs/config-reference.md): parser default < YAML < ``--key value``.
The YAML's top-level sections (``model``, ``training``, ...) are free-form and flattened; what
counts is the key. argparse runs with defaults suppressed, so a parser default can never beat a
YAML value: defaults are filled in last, only for keys nobody set.

Public entry points:
  resolve_args(argv)            -> ResolvedArgs (dict-like), or raises ConfigError
  resolve_config(path, overrides, world_size=None) -> the same, for the launcher
  validate_args(args, world_size=None) -> raises ConfigError on contradictions
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import yaml


class ConfigError(Exception):
    """A configuration the run must not start with. The message says what and how to fix it."""


# ---------------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------------

# kind: the value type. "path" is a string that is made absolute; "dict" a mapping;
# "int_list"/"str_list" lists; "path_or_dict" is data_path's `dir` or `{dir: repeat_count}`.
KINDS = ("int", "float", "bool", "str", "path", "dict", "int_list", "str_list", "path_or_dict")


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    kind: str
    default: Any
    help: str
    choices: tuple | None = None
    nullable: bool = False


SECTIONS: dict[str, list[Arg]] = {
    "model": [
        Arg("transformer_config_overrides", "dict", {},
            "The complete transformer architecture: every constructor argument of "
            "trainer.model.VideoDiT (hidden_size, num_attention_heads, num_layers, mlp_ratio, "
            "rope_axes_dim, patch_size, in_channels, text_dim, qk_norm, causal_chunk_size, ...). "
            "Nothing is read from a pretrained-model directory."),
        Arg("zero_init_modulation", "bool", True,
            "adaLN-Zero: initialise every modulation gate and the output head to zero, so a new "
            "model starts as the identity. Top-level only; never inside the overrides."),
        Arg("pretrained_transformer_path", "path", None,
            "Warm start: a plain state dict (.pt, .safetensors, a directory holding "
            "model_state.pt), a checkpoint-N/ directory, its transformer/ DCP directory, or an "
            "output_dir (its newest complete checkpoint). Used only while output_dir has no "
            "checkpoint of its own. Needs load_transformer_weights: true.", nullable=True),
        Arg("load_transformer_weights", "bool", False,
            "Load pretrained_transformer_path at start. false with a path set is rejected."),
        Arg("pretrained_weights", "str", "live",
            "Which weights of a training checkpoint a warm start reads: the live weights or "
            "the EMA shadow.", choices=("live", "ema")),
        Arg("warm_start_allow_missing", "str_list", [],
            "fnmatch patterns of model keys the warm-start source may lack (keys a stage adds, "
            "e.g. 'r_embedder.*'). Anything else missing is an error."),
        Arg("warm_start_allow_unexpected", "str_list", [],
            "fnmatch patterns of source keys the model may drop (e.g. 'r_embedder.*' when the "
            "Stage2 student loads Stage1 weights). Anything else unexpected is an error."),
        Arg("text_encoder", "str", "standin",
            "Text encoder used for sampling prompts. 'standin': the deterministic seeded token "
            "table of the embedded data.", choices=("standin",)),
        Arg("text_max_tokens", "int", 8, "Caption length in tokens (padded and masked)."),
    ],
    "training": [
        Arg("stage", "str", "fm",
            "Training objective: fm = flow matching (pretrain, SFT); tf_anyflow = Stage1 causal "
            "teacher forcing + AnyFlow flow-map loss; dmd_sgf = Stage2 DMD via SGF (student, "
            "teacher, critic).", choices=("fm", "tf_anyflow", "dmd_sgf")),
        Arg("max_steps", "int", 1000, "Optimizer steps to train for."),
        Arg("learning_rate", "float", 1e-4, "Peak learning rate of AdamW."),
        Arg("weight_decay", "float", 0.0, "Decoupled weight decay (AdamW and Muon)."),
        Arg("adam_beta1", "float", 0.9, "AdamW beta1."),
        Arg("adam_beta2", "float", 0.95, "AdamW beta2."),
        Arg("adam_eps", "float", 1e-8, "AdamW epsilon."),
        Arg("use_muon", "bool", False,
            "Muon for the 2-D hidden matrices of the transformer blocks, AdamW for embeddings, "
            "norms, biases, modulation and the head."),
        Arg("muon_learning_rate", "float", 0.02,
            "Peak Muon learning rate (spectral-norm units, KellerJordan scaling)."),
        Arg("warmup_steps", "int", 0, "Linear warm-up steps from zero to the peak LR."),
        Arg("lr_scheduler_type", "str", "constant", "LR schedule after warm-up.",
            choices=("constant", "linear", "cosine")),
        Arg("lr_decay_steps", "int", None,
            "Steps of decay after warm-up (null: until max_steps).", nullable=True),
        Arg("lr_decay_floor_ratio", "float", 0.0,
            "The decayed LR never goes below this fraction of the peak."),
        Arg("max_grad_norm", "float", 1.0, "Gradient clipping norm (0 disables)."),
        Arg("gradient_accumulation_steps", "int", 1, "Micro-batches per optimizer step."),
        Arg("train_batch_size", "int", 8, "Micro-batch size per data-parallel rank."),
        Arg("global_batch_size", "int", None,
            "Optional check: must equal train_batch_size x gradient_accumulation_steps x "
            "data-parallel size.", nullable=True),
        Arg("seed", "int", 42, "Seed of the model init, the data order and the noise."),
        Arg("dtype", "str", "auto",
            "Compute dtype: auto = bf16 autocast on GPU, fp32 on CPU.",
            choices=("auto", "float32", "bfloat16")),
        Arg("deterministic", "bool", False,
            "torch deterministic algorithms (bit-identical resume on CPU; slower on GPU)."),
        Arg("compile_transformer", "bool", False,
            "torch.compile each transformer block (the kernel warm-up compiles the same graphs)."),
        Arg("use_ema", "bool", False, "Keep an fp32 EMA shadow of the trained weights."),
        Arg("ema_decay", "float", 0.999, "EMA decay d: ema <- d*ema + (1-d)*live."),
        Arg("ema_start_step", "int", 0, "Optimizer step at which the EMA starts (a copy)."),
        Arg("ema_update_every", "int", 1, "Update the EMA every N optimizer steps."),
    ],
    "diffusion": [
        Arg("flow_snr_type", "str", "lognorm", "Base sampler of the noise level sigma.",
            choices=("uniform", "lognorm", "mix", "mode")),
        Arg("flow_lognorm_loc", "float", 0.0, "Logit-normal location m."),
        Arg("flow_lognorm_scale", "float", 1.0, "Logit-normal scale s."),
        Arg("flow_mode_scale", "float", 1.29, "Scale c of the 'mode' sampler."),
        Arg("flow_mix_uniform_ratio", "float", 0.3,
            "Fraction of uniform draws in the 'mix' sampler."),
        Arg("train_timestep_shift", "float", 1.0,
            "Fixed shift s: sigma = s*u / (1 + (s-1)*u); s > 1 trains noisier."),
        Arg("train_timestep_shift_mode", "str", "fixed",
            "fixed: use train_timestep_shift; dynamic: s = exp(mu(video tokens)).",
            choices=("fixed", "dynamic")),
        Arg("dynamic_shift_base_tokens", "int", 256, "Dynamic shift: token count of base_shift."),
        Arg("dynamic_shift_max_tokens", "int", 4096, "Dynamic shift: token count of max_shift."),
        Arg("dynamic_shift_base", "float", 0.5, "Dynamic shift: mu at base tokens."),
        Arg("dynamic_shift_max", "float", 1.15, "Dynamic shift: mu at max tokens."),
        Arg("loss_weighting", "str", "none", "Per-sample loss weight w(sigma).",
            choices=("none", "gaussian", "beta08")),
    ],
    "data": [
        Arg("data_path", "path_or_dict", None,
            "A directory of parquet shards, or a mapping {directory: repeat_count}.",
            nullable=True),
        Arg("synthetic_data", "bool", False,
            "Generate the embedded moving-shapes dataset into data_path (cached; regenerated "
            "only when these settings change)."),
        Arg("synthetic_num_samples", "int", 2048, "Clips in the synthetic dataset."),
        Arg("synthetic_seed", "int", 0, "Seed of the synthetic dataset."),
        Arg("synthetic_num_frames", "int", 8, "Frames per synthetic clip."),
        Arg("synthetic_height", "int", 16, "Synthetic clip height in pixels."),
        Arg("synthetic_width", "int", 16, "Synthetic clip width in pixels."),
    ],
    "tasks": [
        Arg("cfg_drop_prob", "float", 0.1,
            "Probability of replacing a sample's caption with the null caption (for CFG)."),
        Arg("image_cond_prob", "float", 0.0,
            "Probability that a sample keeps its first latent frame clean (t = 0, no loss)."),
        Arg("video_cond_prob", "float", 0.0,
            "Probability that a sample keeps its first video_cond_frames frames clean."),
        Arg("video_cond_frames", "int", 2, "Clean leading frames of a video-conditioned sample."),
    ],
    "distributed": [
        Arg("hybrid_shard", "bool", False,
            "FSDP2 hybrid shard: shard within a node, replicate across nodes."),
        Arg("cp_size", "int", 1,
            "Ulysses context-parallel degree; the world splits as dp x cp. Must divide the "
            "world size and num_attention_heads."),
        Arg("enable_gradient_checkpointing", "bool", False,
            "Recompute each transformer block's activations in the backward pass (less memory, "
            "about one more forward of compute)."),
        Arg("dist_backend", "str", "auto", "Process-group backend (auto: nccl on GPU, else gloo).",
            choices=("auto", "nccl", "gloo")),
    ],
    "validation": [
        Arg("validation_interval", "int", 0,
            "Sample the fixed validation captions every N steps into samples/step-<N>/ and log "
            "their colour/direction accuracy (0: only at the end of the run; -1: never)."),
        Arg("validation_steps", "int", 30,
            "Sampling steps of validation (FM Euler steps; flow-map / rollout steps for the "
            "distilled stages use validation_sampling_steps of their own stage)."),
        Arg("validation_guidance", "float", 4.0,
            "CFG scale of validation samples, standard convention u + w (c - u) (1 = none)."),
        Arg("validation_num_captions", "int", 16,
            "How many of the fixed evaluation captions validation samples."),
        Arg("validation_seed", "int", 0, "Seed of validation noise."),
        Arg("validation_weights", "str", "both",
            "Which weights validation samples: live, ema, or both (ema only where EMA is on).",
            choices=("live", "ema", "both")),
    ],
    "stage1": [
        Arg("anyflow_epsilon", "float", 5.0,
            "Finite-difference half-width in raw timestep units (ALGORITHMS.md §6.5)."),
        Arg("anyflow_diffusion_ratio", "float", 0.5,
            "Fraction of the global batch trained on the diagonal r = t (plain FM)."),
        Arg("anyflow_consistency_ratio", "float", 0.25,
            "Fraction of the global batch trained with r = 0 (the x0 map)."),
        Arg("anyflow_fuse_guidance_scale", "float", 1.0,
            "Guidance fused into the target, w: target = w v_c + (1 - w) u(t, t | null). "
            "1 = no fusion."),
        Arg("anyflow_pair_sampler", "str", "v15",
            "(t, r) sampler: v15 (t ~ U, r = u2 t) or nvlabs (t = max, r = min of two uniforms).",
            choices=("v15", "nvlabs")),
        Arg("anyflow_time_gate", "float", 0.25,
            "Gate g of the two-time embedding e(t, r) = (1 - g) E_t(t) + g E_r(r)."),
        Arg("flowmap_sampling_steps", "int", 4,
            "Flow-map steps of Stage1 validation samples."),
    ],
    "stage2": [
        Arg("student_init_path", "path", None,
            "Stage2 student source (a Stage1 output_dir or checkpoint); its E_r (r_embedder.*) "
            "tensors are dropped.", nullable=True),
        Arg("student_init_weights", "str", "ema", "Student source weights.",
            choices=("live", "ema")),
        Arg("teacher_init_path", "path", None,
            "Stage2 frozen teacher (real score) source: an SFT output_dir or checkpoint.",
            nullable=True),
        Arg("teacher_init_weights", "str", "ema", "Teacher source weights.",
            choices=("live", "ema")),
        Arg("critic_init_path", "path", None,
            "Stage2 trainable critic (fake score) source; usually the same as the teacher.",
            nullable=True),
        Arg("critic_init_weights", "str", "ema", "Critic source weights.",
            choices=("live", "ema")),
        Arg("critic_learning_rate", "float", 4e-4, "Critic AdamW learning rate."),
        Arg("critic_adam_beta1", "float", 0.0, "Critic AdamW beta1."),
        Arg("critic_adam_beta2", "float", 0.999, "Critic AdamW beta2."),
        Arg("generator_update_interval", "int", 5,
            "Student updates when step % N == 0 (step > 0); the critic updates every step."),
        Arg("rollout_mode", "str", "simulate",
            "simulate: the student rolls out from noise; data_latent: noise data latents to "
            "the exit step.", choices=("simulate", "data_latent")),
        Arg("dmd_denoising_steps", "int_list", [1000, 750, 500, 250],
            "Student rollout timesteps (raw units), warped onto the shifted grid when "
            "warp_denoising_step is true."),
        Arg("warp_denoising_step", "bool", True,
            "Warp dmd_denoising_steps onto the train_timestep_shift grid (§7.3)."),
        Arg("real_guidance_scale", "float", 3.0,
            "Teacher CFG in the reference convention R_s(c, u) = c + s (c - u) (s = 3 is "
            "standard w = 4; 0 = conditional only)."),
        Arg("min_score_timestep_ratio", "float", 0.02,
            "Lower clamp of the teacher/critic score noise level."),
        Arg("max_score_timestep_ratio", "float", 0.98,
            "Upper clamp of the teacher/critic score noise level."),
        Arg("critic_max_grad_norm", "float", 1.0, "Critic gradient clipping (0 disables)."),
    ],
    "output": [
        Arg("output_dir", "path", None,
            "Run directory: checkpoints, metrics, samples. A run resumes from its newest "
            "readable checkpoint here.", nullable=True),
        Arg("save_interval", "int", 500, "Save a checkpoint every N steps (and at the end)."),
        Arg("save_total_limit", "int", 3,
            "Keep at most N complete checkpoints (0 keeps all); the newest is never pruned."),
        Arg("log_interval", "int", 10, "Write a metrics.jsonl record every N steps."),
        Arg("report_to", "str", "none", "Experiment tracker.", choices=("none", "wandb")),
        Arg("wandb_project", "str", "relay", "W&B project (WANDB_API_KEY comes from the env)."),
        Arg("wandb_run_name", "str", None, "W&B run name (default: output_dir's name).",
            nullable=True),
        Arg("async_checkpoint", "bool", False,
            "Save checkpoints in the background (at most one in flight, finished before exit)."),
        Arg("resume_data_state", "bool", True,
            "Resume the data cursors with the checkpoint. false restarts the data stream (needed "
            "when the data-parallel size changed)."),
        Arg("preemption_signal", "str", "SIGUSR2",
            "Signal that asks the run to save at the next step and exit for requeue (SIGTERM "
            "is always handled too).", choices=("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")),
    ],
}

# Old key names still accepted, translated with a warning.
LEGACY_KEYS: dict[str, str] = {
    "heads_num": "num_attention_heads",
    "mm_single_blocks_depth": "num_layers",
    "rope_dim_list": "rope_axes_dim",
    "hidden_dim": "hidden_size",
    "lr": "learning_rate",
    "batch_size": "train_batch_size",
}
# Legacy names that belong inside transformer_config_overrides rather than at the top level.
MODEL_KEYS_IN_OVERRIDES = {"num_attention_heads", "num_layers", "rope_axes_dim", "hidden_size"}

ARGS: dict[str, Arg] = {a.name: a for args in SECTIONS.values() for a in args}
SECTION_OF: dict[str, str] = {a.name: s for s, args in SECTIONS.items() for a in args}
SECRET_KEYS = ("WANDB_API_KEY",)


# ---------------------------------------------------------------------------------------------
# Value conversion
# ---------------------------------------------------------------------------------------------

def _expected(arg: Arg) -> str:
    base = {
        "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
        "path": "a path string", "dict": "a mapping", "int_list": "a list of integers",
        "str_list": "a list of strings",
        "path_or_dict": "a directory or a mapping {directory: repeat_count}",
    }[arg.kind]
    if arg.choices:
        base = "one of " + ", ".join(arg.choices)
    return base + (" or null" if arg.nullable else "")


def convert_value(arg: Arg, value: Any, where: str) -> Any:
    """Check and normalise one value; raise ConfigError naming the key and the expected type."""

    def bad() -> ConfigError:
        return ConfigError(
            f"{where}: `{arg.name}` must be {_expected(arg)}, got {value!r}. "
            f"Fix the value (see docs/config-reference.md)."
        )

    if value is None:
        if arg.nullable:
            return None
        raise bad()
    kind = arg.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise bad()
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        out: Any = value
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        out = float(value)
    elif kind in ("str", "path"):
        if not isinstance(value, str):
            raise bad()
        out = value
    elif kind == "dict":
        if not isinstance(value, dict):
            raise bad()
        out = value
    elif kind in ("int_list", "str_list"):
        item = int if kind == "int_list" else str
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            raise bad()
        out = list(value)
    elif kind == "path_or_dict":
        if isinstance(value, str):
            out = value
        elif isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in value.items()
        ):
            out = dict(value)
        else:
            raise bad()
    else:  # pragma: no cover - schema error
        raise AssertionError(kind)
    if arg.choices and out not in arg.choices:
        raise bad()
    return out


def _parse_cli_text(arg: Arg, text: str) -> Any:
    """Turn a command-line string into a value of the key's kind (YAML syntax for the rest)."""
    low = text.strip().lower()
    if arg.nullable and low in ("null", "none", "~"):
        return None
    if arg.kind == "bool":
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"command line: `--{arg.name}` must be true or false, got {text!r}.")
    if arg.kind in ("str", "path"):
        return text
    if arg.kind == "path_or_dict" and not text.lstrip().startswith("{"):
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(
            f"command line: `--{arg.name}` must be {_expected(arg)}, got {text!r} "
            f"(write lists as [1,2] and mappings as {{key: value}})."
        ) from None
    if arg.kind == "float" and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    return value


# ---------------------------------------------------------------------------------------------
# YAML loading and flattening
# ---------------------------------------------------------------------------------------------

def closest_key(name: str, candidates) -> str | None:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return match[0] if match else None


def _unknown_key_error(where: str, key: str) -> ConfigError:
    guess = closest_key(key, ARGS)
    hint = f" Did you mean `{guess}`?" if guess else ""
    return ConfigError(
        f"{where}: unknown key `{key}`.{hint} Every key must be a train.py argument; "
        f"see docs/config-reference.md for the list."
    )


def _translate_legacy(key: str, where: str) -> tuple[str, bool]:
    """Return (new_name, is_model_key). Warns once per use."""
    if key in LEGACY_KEYS:
        new = LEGACY_KEYS[key]
        warnings.warn(f"{where}: `{key}` is an old name; it is read as `{new}`. "
                      f"Rename it to silence this warning.", stacklevel=3)
        return new, new in MODEL_KEYS_IN_OVERRIDES
    return key, False


def load_yaml_config(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML config, resolve interpolation, and flatten its sections.

    Returns {key: value} of argparse keys. Raises ConfigError for a missing or unreadable file,
    an unknown key, a key set twice, or an interpolation that does not resolve.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist. Pass an existing YAML with --config.")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({_one_line(exc)}). "
                          f"A key written twice in one section is also rejected here.") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}. Fix the interpolation or set the "
                          f"environment variable it reads.") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got "
                          f"{type(raw).__name__}.")
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    legacy_model: dict[str, Any] = {}

    def put(key: str, value: Any, section: str | None) -> None:
        where = f"{path}" + (f", section `{section}`" if section else "")
        key, is_model = _translate_legacy(key, where)
        if is_model:
            legacy_model[key] = value
            return
        if key not in ARGS:
            raise _unknown_key_error(where, key)
        if key in flat:
            raise ConfigError(f"{path}: `{key}` is set twice (in {origin[key]} and in "
                              f"{section or 'the top level'}). Keep one.")
        flat[key] = convert_value(ARGS[key], value, where)
        origin[key] = f"section `{section}`" if section else "the top level"

    for top, value in raw.items():
        if isinstance(value, dict) and top not in ARGS and top not in LEGACY_KEYS:
            for key, inner in value.items():
                put(str(key), inner, str(top))
        else:
            put(str(top), value, None)
    if legacy_model:
        overrides = dict(flat.get("transformer_config_overrides", {}))
        for key, value in legacy_model.items():
            if key in overrides:
                raise ConfigError(f"{path}: `{key}` is set twice (old top-level name and inside "
                                  f"transformer_config_overrides). Keep the one in the overrides.")
            overrides[key] = value
        flat["transformer_config_overrides"] = overrides
    if "transformer_config_overrides" in flat:
        flat["transformer_config_overrides"] = _translate_override_keys(
            flat["transformer_config_overrides"], str(path))
    return flat


def _translate_override_keys(overrides: dict, where: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        new = LEGACY_KEYS.get(key, key)
        if new != key:
            warnings.warn(f"{where}: transformer_config_overrides.`{key}` is an old name; it is "
                          f"read as `{new}`.", stacklevel=3)
        if new in out:
            raise ConfigError(f"{where}: transformer_config_overrides sets `{new}` twice "
                              f"(once as `{key}`). Keep one.")
        out[new] = value
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2
        raise ConfigError(f"command line: {message}. Run with --help for every key.")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser: `--config`, `--dry-run`, and one `--key` per schema entry.

    Defaults are suppressed: a parsed namespace holds only what the command line gave.
    """
    parser = _Parser(
        prog="train.py", allow_abbrev=False, argument_default=argparse.SUPPRESS,
        description="relay trainer. Precedence: parser default < YAML (--config) < --key value.",
    )
    parser.add_argument("--config", help="YAML file; top-level sections group keys.")
    parser.add_argument("--dry-run", action="store_true",
                        help="Print the resolved arguments as JSON and exit 0.")
    for section, args in SECTIONS.items():
        group = parser.add_argument_group(section)
        for arg in args:
            group.add_argument(f"--{arg.name}", type=str, metavar=arg.kind.upper(),
                               help=f"{arg.help} (default: {arg.default!r})")
    return parser


def _split_legacy_cli(argv: list[str]) -> list[str]:
    """Rewrite `--old_name` to `--new_name` (warning) before argparse sees it."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, eq, rest = token[2:].partition("=")
            if name in LEGACY_KEYS and LEGACY_KEYS[name] not in MODEL_KEYS_IN_OVERRIDES:
                warnings.warn(f"command line: `--{name}` is an old name; read as "
                              f"`--{LEGACY_KEYS[name]}`.", stacklevel=3)
                token = f"--{LEGACY_KEYS[name]}{eq}{rest}"
        out.append(token)
    return out


def parse_cli(argv: list[str]) -> tuple[str | None, bool, dict[str, Any]]:
    """Return (config path, dry_run, {key: converted value}) from the command line."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(_split_legacy_cli(list(argv)))
    if unknown:
        first = next((u for u in unknown if u.startswith("--")), unknown[0])
        key = first.lstrip("-").split("=")[0]
        if first.startswith("--"):
            raise _unknown_key_error("command line", key)
        raise ConfigError(f"command line: unexpected argument {first!r}. Keys are given as "
                          f"`--key value`; the YAML goes after --config.")
    values = vars(namespace)
    config = values.pop("config", None)
    dry_run = values.pop("dry_run", False)
    converted = {}
    for key, text in values.items():
        arg = ARGS[key]
        converted[key] = convert_value(arg, _parse_cli_text(arg, text), "command line")
    return config, dry_run, converted


# ---------------------------------------------------------------------------------------------
# Resolution and validation
# ---------------------------------------------------------------------------------------------

class ResolvedArgs(dict):
    """The resolved arguments: a dict with attribute access (args.learning_rate)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_json(self) -> str:
        return json.dumps(self, indent=2, sort_keys=True)

    def digest(self) -> str:
        """A stable hash of the resolved arguments (stored in every checkpoint's COMPLETE)."""
        return hashlib.sha256(json.dumps(self, sort_keys=True).encode()).hexdigest()[:16]


def _absolute_paths(values: dict[str, Any], base: Path) -> None:
    for key, value in list(values.items()):
        arg = ARGS[key]
        if value is None:
            continue
        if arg.kind == "path":
            values[key] = str((base / os.path.expanduser(value)).resolve())
        elif arg.kind == "path_or_dict":
            if isinstance(value, str):
                values[key] = str((base / os.path.expanduser(value)).resolve())
            else:
                values[key] = {str((base / os.path.expanduser(k)).resolve()): v
                               for k, v in value.items()}


def merge_args(yaml_values: dict[str, Any], cli_values: dict[str, Any]) -> ResolvedArgs:
    """Defaults < YAML < CLI. Defaults fill only keys that neither source set."""
    merged: dict[str, Any] = {}
    for name, arg in ARGS.items():
        merged[name] = json.loads(json.dumps(arg.default))  # a fresh copy of lists and dicts
    merged.update(yaml_values)
    merged.update(cli_values)
    return ResolvedArgs(merged)


def resolve_config(config: str | None, overrides: list[str] | dict[str, Any] = (), *,
                   world_size: int | None = None, cwd: str | os.PathLike | None = None,
                   check_paths: bool = True) -> ResolvedArgs:
    """Resolve a YAML plus overrides exactly as train.py does. Raises ConfigError.

    `overrides` is either the command-line tokens (["--learning_rate", "3e-4"]) or a mapping of
    already-typed values (the launcher's pipeline YAML). Relative paths are made absolute against
    `cwd` (default: the current directory).
    """
    if isinstance(overrides, dict):
        cli = {}
        for key, value in overrides.items():
            key, _ = _translate_legacy(key, "overrides")
            if key not in ARGS:
                raise _unknown_key_error("overrides", key)
            cli[key] = convert_value(ARGS[key], value, "overrides")
    else:
        _, _, cli = parse_cli(list(overrides))
    yaml_values = load_yaml_config(config) if config else {}
    args = merge_args(yaml_values, cli)
    args["config"] = str(Path(config).resolve()) if config else None
    _absolute_paths_skip_config(args, Path(cwd) if cwd else Path.cwd())
    validate_args(args, world_size=world_size, check_paths=check_paths)
    return args


def _absolute_paths_skip_config(args: ResolvedArgs, base: Path) -> None:
    values = {k: v for k, v in args.items() if k in ARGS}
    _absolute_paths(values, base)
    args.update(values)


def resolve_args(argv: list[str] | None = None, *, world_size: int | None = None) -> tuple[ResolvedArgs, bool]:
    """Parse train.py's command line: returns (args, dry_run). Raises ConfigError."""
    argv = sys.argv[1:] if argv is None else argv
    config, dry_run, _ = parse_cli(argv)
    cli_tokens = _strip_meta_flags(argv)
    return resolve_config(config, cli_tokens, world_size=world_size), dry_run


def _strip_meta_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == "--config":
            skip = True
            continue
        if token.startswith("--config=") or token == "--dry-run":
            continue
        out.append(token)
    return out


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_args(args: ResolvedArgs, *, world_size: int | None = None,
                  check_paths: bool = True) -> None:
    """Reject contradictions before any model or process group exists. Raises ConfigError.

    world_size: the number of ranks the run will have (train.py passes WORLD_SIZE; the launcher
    passes nodes x gpus_per_node) so topology and batch arithmetic are checked early.
    """
    overrides = args.transformer_config_overrides
    _check(args.output_dir is not None,
           "`output_dir` is not set. Set it in the YAML's output section or with --output_dir.")
    _check("zero_init_modulation" not in overrides,
           "`zero_init_modulation` is repeated inside transformer_config_overrides. It is a "
           "top-level key only: move it out of the overrides.")
    if args.pretrained_transformer_path is not None and not args.load_transformer_weights:
        raise ConfigError(
            "`pretrained_transformer_path` is set but `load_transformer_weights` is false, so the "
            "path would be silently ignored. Set load_transformer_weights: true to warm start, or "
            "pretrained_transformer_path: null to train from scratch.")
    if args.load_transformer_weights and args.pretrained_transformer_path is None:
        raise ConfigError(
            "`load_transformer_weights` is true but `pretrained_transformer_path` is null. Name "
            "the checkpoint, state dict or output_dir to start from, or set "
            "load_transformer_weights: false.")
    for key in ("max_steps", "save_interval", "log_interval", "train_batch_size",
                "gradient_accumulation_steps", "cp_size", "text_max_tokens",
                "ema_update_every", "synthetic_num_samples", "synthetic_num_frames",
                "synthetic_height", "synthetic_width"):
        _check(args[key] >= 1, f"`{key}` must be at least 1, got {args[key]}.")
    for key in ("warmup_steps", "save_total_limit", "ema_start_step"):
        _check(args[key] >= 0, f"`{key}` must be >= 0, got {args[key]}.")
    for key in ("cfg_drop_prob", "image_cond_prob", "video_cond_prob", "lr_decay_floor_ratio",
                "flow_mix_uniform_ratio", "ema_decay"):
        _check(0.0 <= args[key] <= 1.0, f"`{key}` must lie in [0, 1], got {args[key]}.")
    _check(args.image_cond_prob + args.video_cond_prob <= 1.0,
           "`image_cond_prob` + `video_cond_prob` exceed 1. Lower one of them.")
    _check(args.learning_rate > 0, f"`learning_rate` must be > 0, got {args.learning_rate}.")
    _check(args.train_timestep_shift > 0,
           f"`train_timestep_shift` must be > 0, got {args.train_timestep_shift}.")
    _check(args.max_grad_norm >= 0, "`max_grad_norm` must be >= 0 (0 disables clipping).")
    if args.warmup_steps > args.max_steps:
        warnings.warn(f"`warmup_steps` ({args.warmup_steps}) exceeds `max_steps` "
                      f"({args.max_steps}): the run ends before the LR reaches its peak.")
    if args.lr_decay_steps is not None:
        _check(args.lr_decay_steps >= 1, "`lr_decay_steps` must be >= 1 or null.")
    _check(args.data_path is not None,
           "`data_path` is not set. Point it at a directory of parquet shards (or a mapping "
           "{directory: repeat_count}); with synthetic_data: true it is where the embedded data "
           "is generated and cached.")
    if isinstance(args.data_path, dict):
        _check(not args.synthetic_data,
               "`synthetic_data: true` needs `data_path` to be one directory, not a mapping.")
        for directory, repeat in args.data_path.items():
            _check(repeat >= 1, f"data_path: repeat count of {directory} must be >= 1, got {repeat}.")
    if check_paths:
        _validate_paths(args)
    _validate_model_overrides(args)
    _validate_topology(args, world_size)
    from trainer.stages.tf_anyflow import validate_tf_anyflow_args  # Stage1's own checks
    validate_tf_anyflow_args(args)
    from trainer.stages.dmd_sgf import validate_dmd_sgf_args  # Stage2's own checks
    validate_dmd_sgf_args(args)
    if args.report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("`report_to: wandb` but the wandb package is not installed. "
                              "pip install wandb, or set report_to: none.") from None
    if args.cp_size > 1 or args.hybrid_shard:
        warnings.warn("cp_size > 1 and hybrid_shard are validated but not implemented yet: the "
                      "run will refuse to start. Use cp_size: 1 and hybrid_shard: false.")


def _validate_paths(args: ResolvedArgs) -> None:
    if args.data_path is not None and not args.synthetic_data:
        dirs = [args.data_path] if isinstance(args.data_path, str) else list(args.data_path)
        for directory in dirs:
            _check(Path(directory).is_dir(),
                   f"data_path {directory} does not exist. Check the path, or generate the "
                   f"embedded data with synthetic_data: true.")
    # A warm-start path may be produced by an earlier stage of the same pipeline, so its
    # existence is checked at train time (and by `relay submit` only for stages run alone).


def _validate_model_overrides(args: ResolvedArgs) -> None:
    from trainer.model import MODEL_CONFIG_DEFAULTS

    for key in args.transformer_config_overrides:
        if key not in MODEL_CONFIG_DEFAULTS:
            guess = closest_key(key, MODEL_CONFIG_DEFAULTS)
            hint = f" Did you mean `{guess}`?" if guess else ""
            raise ConfigError(
                f"transformer_config_overrides: unknown model argument `{key}`.{hint} Valid: "
                f"{', '.join(sorted(MODEL_CONFIG_DEFAULTS))}.")


def model_config(args: ResolvedArgs) -> dict[str, Any]:
    """The full model constructor arguments: defaults < overrides, plus zero_init_modulation."""
    from trainer.model import MODEL_CONFIG_DEFAULTS

    config = dict(MODEL_CONFIG_DEFAULTS)
    config.update(args.transformer_config_overrides)
    config["zero_init_modulation"] = args.zero_init_modulation
    return config


def _validate_topology(args: ResolvedArgs, world_size: int | None) -> None:
    heads = model_config(args)["num_attention_heads"]
    _check(heads % args.cp_size == 0,
           f"num_attention_heads ({heads}) is not divisible by cp_size ({args.cp_size}). Ulysses "
           f"splits heads across the cp group: pick a cp_size that divides {heads}.")
    if world_size is None:
        return
    _check(world_size % args.cp_size == 0,
           f"world size {world_size} is not divisible by cp_size {args.cp_size}. Use a cp_size "
           f"that divides the number of GPUs (nodes x gpus_per_node).")
    dp = world_size // args.cp_size
    if args.global_batch_size is not None:
        got = args.train_batch_size * args.gradient_accumulation_steps * dp
        _check(got == args.global_batch_size,
               f"global_batch_size is {args.global_batch_size} but train_batch_size "
               f"({args.train_batch_size}) x gradient_accumulation_steps "
               f"({args.gradient_accumulation_steps}) x data-parallel size ({dp}) = {got}. Change "
               f"one of them so they agree.")


# ---------------------------------------------------------------------------------------------
# The generated config reference
# ---------------------------------------------------------------------------------------------

def render_reference() -> str:
    """docs/config-reference.md, generated from the schema (a test fails when it is stale)."""
    lines = [
        "# Config reference",
        "",
        "Generated from `trainer/args.py` by `python -m trainer.args --markdown`; do not edit by hand.",
        "",
        "Precedence: parser default < YAML (`--config FILE`) < `--key value` on the command line.",
        "YAML sections are free-form and flattened: any section may hold any key, but a key may be",
        "set only once. Unknown keys, wrong types and contradictions are errors before anything",
        "starts. Lists and mappings on the command line use YAML syntax (`--patch_size [1,4,4]`),",
        "booleans are `true|false`, `null` clears a nullable key.",
        "",
    ]
    for section, args in SECTIONS.items():
        lines += [f"## `{section}`", "", "| key | type | default | help |", "| --- | --- | --- | --- |"]
        for arg in args:
            kind = arg.kind + (" \\| null" if arg.nullable else "")
            if arg.choices:
                kind = " \\| ".join(arg.choices)
            default = json.dumps(arg.default)
            lines.append(f"| `{arg.name}` | {kind} | `{default}` | {arg.help.replace('|', '/')} |")
        lines.append("")
    lines += ["## Old key names", "", "| old | new |", "| --- | --- |"]
    lines += [f"| `{old}` | `{new}` |" for old, new in LEGACY_KEYS.items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(render_reference())
    else:
        sys.exit("usage: python -m trainer.args --markdown")
