"""The model-family interface: what the stages, preflight and the parallel code may know of a model.

A family is one architecture (relay's DiT, a public model). It has two halves:

- This module's `ModelFamily`, plain Python (no torch), for the login node and preflight: the
  family's config (from `transformer_config_overrides` or a checkpoint directory's own
  config.json), its capabilities, its geometry, parameter and FLOP counts, the bidirectional
  teacher/critic config it implies, the weights of its second time input, and a state-dict
  adapter to external layouts.
- The module protocol (trainer.models.protocol): the calls the stages make on the built model,
  and what FSDP2 shards, what compiles and where Ulysses attaches.

A stage declares the capabilities it needs (trainer.stages.declaration.StageDeclaration);
preflight refuses a family that lacks one before a job starts. Families register by name (trainer.models.registry)
and a run picks one with `model_family`.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

# What a family's module can do. A stage lists the ones it needs; preflight checks them.
CAPABILITIES: dict[str, str] = {
    "per_frame_times": "one time per latent frame (not only one per sample)",
    "packed": "packed batches: samples of different shapes in one sequence",
    "teacher_forcing": "block-causal teacher forcing over [clean | noisy] chunks",
    "kv_cache": "chunk-by-chunk rollout through a KV cache",
    "two_time": "a second time input (the flow map's r)",
    "context_parallel": "context parallel (cp_size > 1: Ulysses splits the sequence over ranks)",
    "sparse_video_attention": "sparse video self-attention over the top-k key tiles "
                              "(video_attention_sparsity > 0)",
}


@dataclass(frozen=True)
class Geometry:
    """The shape facts of one config that code outside the family needs.

    causal_chunk_frames: latent frames per causal chunk (None: a bidirectional model);
    two_time: the config has a second time input; time_gate: how strongly it acts (None when
    two_time is off)."""

    patch_size: tuple[int, int, int]
    num_heads: int
    head_dim: int
    hidden_size: int
    num_layers: int
    latent_channels: int
    out_channels: int
    text_dim: int
    causal_chunk_frames: int | None = None
    two_time: bool = False
    time_gate: float | None = None


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one config: in all, in one block, and those Muon takes (2-D hidden
    matrices inside blocks); `second_time` is what the second time input adds to `total`."""

    total: int
    per_block: int
    muon: int
    second_time: int = 0


class ConfigDirError(ValueError):
    """The directory a run reads its architecture from (a public checkpoint's config.json) is
    refused: preflight says so as it is, without blaming transformer_config_overrides."""


class StateDictAdapter:
    """Key names between relay's module and an external layout (identity by default).

    `to_relay(key)` is the module's key for an external one (None: the key has no counterpart
    and is skipped); `from_relay(key)` the external key for a module key."""

    def to_relay(self, key: str) -> str | None:
        return key

    def from_relay(self, key: str) -> str:
        return key

    def convert_to_relay(self, state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            mapped = self.to_relay(key)
            if mapped is not None:
                out[mapped] = value
        return out

    def convert_from_relay(self, state: dict[str, Any]) -> dict[str, Any]:
        return {self.from_relay(key): value for key, value in state.items()}


@dataclass(frozen=True)
class DiffusersExport:
    """How one model family is written as diffusers: the transformer class, the config keys of
    relay's that are dropped whatever their value (the others the class does not take must
    keep the family's default, or diffusers would run another model), and the checks of a
    pipeline's other components (config, pipeline directory) -> problems."""

    class_name: str
    ignored_keys: frozenset[str]
    check_components: Callable[[dict[str, Any], Path], list[str]]
    # relay's keys that change only how relay samples the weights (the causal chunking), not
    # the weights: left out of config.json and written to the sampling file
    sampling_keys: frozenset[str] = frozenset()


class ModelFamily(ABC):
    """One architecture, as everything outside its folder sees it (torch-free).

    Subclasses set `name` and `capabilities`, and implement the abstract methods. `build`
    imports the module half lazily, so the login node never imports torch through a family.
    """

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # fnmatch patterns of the weights of the second time input: a single-time model warm
    # started from a two-time one drops them, a two-time one started from a single-time one
    # initialises them from the first time input.
    second_time_keys: ClassVar[tuple[str, ...]] = ()
    # Config keys that say how a run uses the weights rather than what they are (causal chunks,
    # the second time input, the attention kernel): a run started from another relay run
    # inherits every other key of that run's config and sets these itself
    # (trainer.source_model).
    run_config_keys: ClassVar[tuple[str, ...]] = ()
    # The linear layers a LoRA adapts when lora_target_modules is empty (entries as
    # trainer.models.lora_targets matches them); () means the family names none, and a LoRA run
    # must name its targets.
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    # Bytes a compiled bf16 block keeps per token x hidden_size for its backward, without
    # activation checkpointing, as measured on a GPU (trainer.checks.memory); None
    # takes the estimate's conservative default.
    activation_bytes: ClassVar[float | None] = None
    # Bytes a block keeps per token x hidden_size under full activation checkpointing (its
    # input, for the recompute), as measured on a GPU; None takes the estimate's default
    # (trainer.checks.memory.CKPT_BYTES).
    checkpoint_bytes: ClassVar[float | None] = None
    # Whether the step's peak was measured to hold the larger of the activations and the
    # gradients rather than both (backward fills the gradients as it frees the activations).
    # False, the safe default, adds them.
    gradients_overlap_activations: ClassVar[bool] = False
    # Name fragments that keep a 2-D weight under `blocks` out of Muon (trainer.optim.optimizers,
    # "Parameter split"): the family's norms, modulation and embedders, which are not hidden
    # matrices. param_counts(...).muon counts what is left.
    muon_excluded_name_parts: ClassVar[tuple[str, ...]] = ("norm", "modulation", "adaln", "embed",
                                                             "scale_shift_table")
    # What a diffusers pipeline directory of this family implies for keys the run leaves unset
    # (trainer.encoders.directories.pipeline_defaults): its pipeline's caption length, sampling
    # steps and guidance.
    pipeline_defaults: ClassVar[dict[str, Any]] = {}
    # Whether `write_tiny_pipeline` writes a tiny random pipeline directory (make_tiny_wan).
    writes_tiny_pipeline: ClassVar[bool] = False
    # How diffusers writes this family (relay export --format diffusers); None: it has no class.
    diffusers_export: ClassVar[DiffusersExport | None] = None
    # Overrides that shrink any config of this family to a CPU-sized model, width and depth
    # only (benchmarks/quality.py --toy keeps the rest: patch, channels, causality).
    toy_size: ClassVar[dict[str, Any]] = {}
    # Which positional argument of a block (`blocks[i](...)`) holds the video tokens [B, N, D]:
    # benchmarks count function evaluations as video tokens through the first block.
    block_video_arg: ClassVar[int] = 0

    # -- config -----------------------------------------------------------------------------
    @abstractmethod
    def defaults(self) -> dict[str, Any]:
        """Every constructor argument with its default (what the overrides start from)."""

    @abstractmethod
    def validate(self, config: dict[str, Any]) -> None:
        """Raise ValueError saying what is wrong with a complete config."""

    def config(self, overrides: dict[str, Any] | None, settings: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        """The complete config: defaults < `overrides` (transformer_config_overrides) < the
        run settings the family reads (`settings`, e.g. zero_init_modulation). Raises ValueError
        naming the closest valid key for an unknown one; does not validate values (`validate`)."""
        defaults = self.defaults()
        overrides = dict(overrides or {})
        repeated = sorted(set(self.settings_config({})) & set(overrides))
        if repeated:
            raise ValueError(f"`{'`, `'.join(repeated)}` is repeated inside "
                             f"transformer_config_overrides. It is a top-level key only: move it "
                             f"out of the overrides")
        for key in overrides:
            if key not in defaults:
                close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.5)
                hint = f" Did you mean `{close[0]}`?" if close else ""
                raise ValueError(
                    f"unknown {self.name} model argument `{key}`.{hint} Valid: "
                    f"{', '.join(sorted(defaults))}")
        return {**defaults, **overrides, **self.settings_config(settings or {})}

    def settings_config(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The config entries that come from top-level run settings rather than the overrides
        (with `settings` empty: every such key, at its default)."""
        return {}

    def config_file(self, settings: dict[str, Any]) -> str | None:
        """The file `config` reads the architecture from for these run settings (a public
        checkpoint's config.json), or None when transformer_config_overrides give it."""
        return None

    def config_from_dir(self, path: str) -> dict[str, Any]:
        """The config of a checkpoint directory's own config.json. Raises ValueError when this
        family reads none, or the directory is not one of its checkpoints."""
        raise ValueError(f"model family {self.name!r} reads no architecture from a directory; "
                         f"give it in transformer_config_overrides")

    # -- what a config is ---------------------------------------------------------------------
    @abstractmethod
    def geometry(self, config: dict[str, Any]) -> Geometry:
        """Patch size, heads, widths, channels and the causal / two-time settings of `config`."""

    @abstractmethod
    def param_counts(self, config: dict[str, Any]) -> ParamCounts:
        """Parameters of the model `config` builds (exact: a test holds it to the module's)."""

    @abstractmethod
    def forward_flops(self, config: dict[str, Any], video_tokens: int, text_tokens: int) -> float:
        """Matmul FLOPs of one forward of one sample (2 x multiply-adds, attention included)."""

    @abstractmethod
    def bidirectional_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The teacher/critic config `config` implies: the same weights' layout, bidirectional,
        single-time (Stage2's frozen teacher and trainable critic)."""

    def linear_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, int]] | None:
        """Every nn.Linear of the module `config` builds: its module name -> (in, out)
        features, so the login node can check LoRA targets and count adapters. None: the
        family does not list them (the targets are then checked when the model is built)."""
        return None

    def setting_hint(self, what: str) -> str:
        """How a user turns on `what` ("causal", "two_time", "single_time", "time_gate") in
        this family's config: text for error messages."""
        return f"set the {what} setting of the {self.name} model in transformer_config_overrides"

    def source_layout(self, keys) -> str:
        """The layout of a safetensors source whose tensors are named `keys` (all of them, as
        stored): one `state_dict_adapter` knows. "relay" (the module's own keys) unless the
        family reads other releases' layouts."""
        return "relay"

    def state_dict_adapter(self, layout: str) -> StateDictAdapter:
        """The key adapter between the module and an external `layout` ("relay" is identity).
        Raises ValueError for a layout the family does not know."""
        if layout == "relay":
            return StateDictAdapter()
        raise ValueError(f"model family {self.name!r} has no {layout!r} state-dict layout")

    def write_tiny_pipeline(self, directory, *, seed: int = 0,
                            boundary_ratio: float | None = None):
        """Write a tiny random pipeline directory of this family at `directory` (for tests and
        the tiny pipelines; `boundary_ratio`: two experts, as Wan2.2 A14B) and return its path.
        Only a family with `writes_tiny_pipeline` has one."""
        raise NotImplementedError(f"model family {self.name!r} writes no tiny pipeline")

    # -- the module half ------------------------------------------------------------------------
    @abstractmethod
    def build(self, config: dict[str, Any]):
        """The module (trainer.models.protocol.FamilyModule) for `config`, on the CPU, in fp32."""

    def missing_capabilities(self, needed) -> list[str]:
        return [c for c in needed if c not in self.capabilities]


class RelayCausalFamily(ModelFamily):
    """A family whose config carries relay's causal and two-time keys (`causal_chunk_size`,
    `attn_window_chunks`, `two_time`, `time_gate`), as relay's DiT and its wan family do: the
    teacher/critic config they imply and how a user sets them."""

    def bidirectional_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**config, "causal_chunk_size": None, "attn_window_chunks": None,
                "two_time": False}

    def setting_hint(self, what: str) -> str:
        return {
            "causal": "set `causal_chunk_size` (latent frames per chunk, e.g. 2) in "
                      "transformer_config_overrides",
            "two_time": "set `two_time: true` in transformer_config_overrides",
            "single_time": "set `two_time: false` in transformer_config_overrides",
            "time_gate": "set `time_gate` in transformer_config_overrides",
        }.get(what, super().setting_hint(what))
