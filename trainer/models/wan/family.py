"""The Wan2.1/2.2 text-to-video transformer as a model family (`model_family: wan`).

Torch-free. The config keys are those of diffusers' `WanTransformer3DModel` (its
transformer/config.json), plus relay's `attention_backend`; the defaults are Wan2.1-T2V-1.3B's.
The module half, trainer.models.wan.module.WanTransformer, has diffusers' state-dict keys, so
the "diffusers" layout is the identity but for the second time input (`two_time`:
`condition_embedder.time_embedder_r.*`, `second_time_keys`), which neither diffusers nor the
Wan release has: both adapters drop it on the way out (`convert_from_relay`) and a load leaves
it to `init_second_time_from_first`. "original" is the layout of the Wan release
(`self_attn.q`, `head.head`, ...).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from pathlib import Path
from typing import Any

from trainer.models.backends import ATTENTION_BACKENDS
from trainer.models.family import (ConfigDirError, DiffusersExport, Geometry, ParamCounts,
                                   RelayCausalFamily, StateDictAdapter)
from trainer.models.wan.config import (DIFFUSERS_CLASS, QK_NORM, RELAY_KEYS, SECOND_TIME_PREFIX,
                                      WAN_DEFAULTS, WAN_TEXT_LEN, rope_axes, wan_geometry)
from trainer.models.wan.linears import WAN_LORA_TARGETS, wan_linear_shapes


def _component_checks(config: dict[str, Any], pipeline: Path) -> list[str]:
    """Where a Wan pipeline's VAE or text encoder does not fit the exported transformer."""
    problems = []
    vae = _read_json(pipeline / "vae" / "config.json")
    if vae is not None and "z_dim" in vae and vae["z_dim"] != config["in_channels"]:
        problems.append(f"its VAE (vae/config.json) makes {vae['z_dim']}-channel latents and the "
                        f"transformer takes in_channels {config['in_channels']}")
    text = _read_json(pipeline / "text_encoder" / "config.json")
    if text is not None and "d_model" in text and text["d_model"] != config["text_dim"]:
        problems.append(f"its text encoder (text_encoder/config.json) is {text['d_model']} wide "
                        f"and the transformer takes text_dim {config['text_dim']}")
    return problems


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# Keys only the original Wan release (or ComfyUI's copy of it) has.
_ORIGINAL_MARKERS = (".self_attn.", ".cross_attn.", "head.head.", "model.diffusion_model.")

# attention_backend picks a kernel, not the math; zero_init_modulation only how a new model
# starts; time_gate and attn_window_chunks act only with two_time and causal_chunk_size, which
# must keep their defaults (or go to the sampling file).
DIFFUSERS_EXPORT = DiffusersExport(
    class_name=DIFFUSERS_CLASS,
    ignored_keys=frozenset({"attention_backend", "time_gate", "zero_init_modulation"}),
    check_components=_component_checks,
    sampling_keys=frozenset({"causal_chunk_size", "attn_window_chunks"}))


class WanFamily(RelayCausalFamily):
    """`model_family: wan`: Wan's DiT with cross-attention to the caption, a time projection
    shared by all blocks and a (6, D) scale/shift/gate table per block."""

    name = "wan"
    # Per-frame times come from the per-token time path Wan2.2 TI2V uses.
    capabilities = frozenset({"per_frame_times", "packed", "teacher_forcing", "kv_cache",
                              "two_time", "context_parallel", "sparse_video_attention"})
    second_time_keys = (SECOND_TIME_PREFIX + "*",)
    lora_target_modules = WAN_LORA_TARGETS
    run_config_keys = RELAY_KEYS
    # Measured on one H200 at Wan2.1-1.3B size and at hidden 5120 x 8 blocks, and through
    # train.py's SFT, Stage1 and Stage2 at 1.3B with checkpointing (trainer.checks.memory).
    activation_bytes = 36.5
    checkpoint_bytes = 3.0
    gradients_overlap_activations = True
    # Norms (norm1/2/3, the q/k norms), the (6, D) modulation table and the embedders.
    muon_excluded_name_parts = ("norm", "scale_shift_table", "embed")
    diffusers_export = DIFFUSERS_EXPORT
    writes_tiny_pipeline = True
    toy_size = {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2}
    # WanPipeline's max_sequence_length, num_inference_steps and guidance_scale.
    pipeline_defaults = {"text_max_tokens": WAN_TEXT_LEN, "validation_steps": 50,
                         "validation_guidance": 5.0}

    def defaults(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in WAN_DEFAULTS.items()}

    def validate(self, config: dict[str, Any]) -> None:
        patch = config["patch_size"]
        if isinstance(patch, (str, int)) or len(patch) != 3 or not all(_is_int(p, 1) for p in patch):
            raise ValueError(f"patch_size must be three integers >= 1 (t, h, w), got {patch!r}")
        for key in ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim",
                    "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len"):
            if not _is_int(config[key], 1):
                raise ValueError(f"{key} must be an integer >= 1, got {config[key]!r}")
        if config["out_channels"] is not None and not _is_int(config["out_channels"], 1):
            raise ValueError(f"out_channels must be an integer >= 1, got {config['out_channels']!r}")
        if config["freq_dim"] % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {config['freq_dim']}")
        head_dim = config["attention_head_dim"]
        if head_dim % 2 or any(d <= 0 or d % 2 for d in rope_axes(head_dim)):
            raise ValueError(f"attention_head_dim must be even and at least 8 (Wan's RoPE splits a "
                             f"head into frame, row and column pairs), got {head_dim}")
        if not isinstance(config["cross_attn_norm"], bool):
            raise ValueError(f"cross_attn_norm must be true or false, got {config['cross_attn_norm']!r}")
        if isinstance(config["eps"], bool) or not isinstance(config["eps"], (int, float)) \
                or config["eps"] <= 0:
            raise ValueError(f"eps must be a positive number, got {config['eps']!r}")
        if config["qk_norm"] != QK_NORM:
            raise ValueError(f"qk_norm {config['qk_norm']!r} is not supported: relay's wan module "
                             f"implements only qk_norm: {QK_NORM}, as every Wan2.1/2.2 checkpoint has")
        if config["image_dim"] is not None or config["added_kv_proj_dim"] is not None:
            raise ValueError("image_dim / added_kv_proj_dim are set: this is a Wan image-to-video "
                             "(I2V) transformer with an image encoder branch, which relay's wan "
                             "module does not implement; use a text-to-video (T2V or TI2V) one")
        if config["pos_embed_seq_len"] is not None:
            raise ValueError("pos_embed_seq_len is set: this is a Wan first-last-frame (FLF2V) "
                             "transformer, which relay's wan module does not implement")
        if config["attention_backend"] not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {config['attention_backend']!r} is unknown; "
                             f"known: {', '.join(ATTENTION_BACKENDS)}")
        chunk, window = config.get("causal_chunk_size"), config.get("attn_window_chunks")
        if chunk is not None:
            if not _is_int(chunk, 1):
                raise ValueError(f"causal_chunk_size must be null or an integer >= 1 (latent "
                                 f"frames per chunk), got {chunk!r}")
            if chunk % patch[0]:
                raise ValueError(f"causal_chunk_size ({chunk} latent frames) must be a multiple of "
                                 f"the temporal patch size {patch[0]}: chunks are whole patch-frames")
        if window is not None:
            if not _is_int(window, 0):
                raise ValueError(f"attn_window_chunks must be null or an integer >= 0, got {window!r}")
            if chunk is None:
                raise ValueError("attn_window_chunks needs causal_chunk_size: the window counts chunks")
        if not isinstance(config.get("two_time", False), bool):
            raise ValueError(f"two_time must be true or false, got {config['two_time']!r}")
        gate = config.get("time_gate", 0.25)
        if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0.0 <= gate <= 1.0:
            raise ValueError(f"time_gate must be a number in [0, 1], got {gate!r}")

    def config(self, overrides: dict[str, Any] | None, settings: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        """The complete config. When the run warm starts from a diffusers directory
        (`pretrained_transformer_path` with `load_transformer_weights: true`), the architecture
        is its transformer/config.json: `overrides` may then be empty, may set
        `attention_backend`, and may repeat the directory's values, but a key that disagrees
        with the directory raises ConfigDirError naming it. Another path (a state dict, a
        relay checkpoint, the original release layout) leaves the config to `overrides`."""
        config = super().config(overrides, settings)
        settings = settings or {}
        from trainer.encoders.directories import tiny_wan_pending

        file = self.config_file(settings)
        pending = file is None and tiny_wan_pending(settings)
        if file is None and not pending:
            return config
        path = settings["pretrained_transformer_path"]
        try:
            if pending:  # make_tiny_wan writes trainer.models.wan.tiny's pipeline there first
                from trainer.models.wan.tiny import TRANSFORMER

                file = f"{path}/transformer/config.json (written by make_tiny_wan)"
                directory = {**self.defaults(), **TRANSFORMER}
            else:
                directory = self.config_from_dir(str(path))
        except ValueError as exc:
            if (Path(path) / "transformer_2").is_dir():  # an A14B root: the advice is its own
                raise ConfigDirError(f"pretrained_transformer_path: {exc}.") from None
            raise ConfigDirError(f"pretrained_transformer_path: {exc}. model_family wan reads the "
                                 f"architecture from a diffusers directory's transformer/config.json: "
                                 f"point pretrained_transformer_path at a complete Wan diffusers "
                                 f"directory.") from None
        overrides = dict(overrides or {})
        differ = [key for key, value in sorted(overrides.items())
                  if key not in RELAY_KEYS and _plain(value) != _plain(directory[key])]
        if differ:
            details = ", ".join(f"{key}: overrides {overrides[key]!r}, directory "
                                f"{directory[key]!r}" for key in differ)
            raise ConfigDirError(
                f"transformer_config_overrides disagree with {file}, which pretrained_transformer_"
                f"path {path} loads: {details}. The weights have the directory's architecture: "
                f"remove {', '.join(differ)} from transformer_config_overrides (it may be empty; "
                f"only relay's own keys, {', '.join(RELAY_KEYS)}, may differ).")
        directory.update({key: overrides[key] for key in RELAY_KEYS if key in overrides})
        return {**directory, **self.settings_config(settings)}

    def settings_config(self, settings: dict[str, Any]) -> dict[str, Any]:
        # adaLN-Zero for a model built from scratch (WanTransformer.zero_modulation); loaded
        # weights replace it
        return {"zero_init_modulation": settings.get("zero_init_modulation", True)}

    def config_file(self, settings: dict[str, Any]) -> str | None:
        path = settings.get("pretrained_transformer_path")
        if path is None or not settings.get("load_transformer_weights"):
            return None
        file = diffusers_config_file(path)
        return None if file is None else str(file)

    def config_from_dir(self, path: str) -> dict[str, Any]:
        """The config of a diffusers Wan pipeline directory (model_index.json + transformer/)
        or of its transformer/ folder, from transformer/config.json (or of a folder of the
        original release, from its config.json of class WanModel). Raises ValueError for a
        directory without one, or whose transformer is not a WanTransformer3DModel."""
        root = Path(path)
        if (root / "model_index.json").is_file() or (root / "transformer").is_dir():
            if (root / "transformer_2").is_dir():
                raise ValueError(
                    f"{root} holds two transformers (transformer/ and transformer_2/: a Wan2.2 "
                    f"A14B mixture of experts, the high-noise expert in transformer/ and the "
                    f"low-noise one in transformer_2/), and a run trains one expert, each its "
                    f"own model on its own timesteps. To train both, run the two-expert "
                    f"pipeline (config/pipeline/wan-a14b.yaml: one stage from "
                    f"{root / 'transformer'}, one from {root / 'transformer_2'}; each gets its "
                    f"timesteps from boundary_ratio in model_index.json) and export them together "
                    f"with relay export --format diffusers --other-expert; to train one, give "
                    f"its folder as pretrained_transformer_path")
            root = root / "transformer"
        file = root / "config.json"
        if not file.is_file():
            raise ValueError(f"{path} is not a diffusers Wan directory: {file} does not exist (give "
                             f"a pipeline directory with model_index.json and transformer/, or its "
                             f"transformer/ folder)")
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{file} is not readable JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file} is not a JSON object")
        cls = raw.get("_class_name", DIFFUSERS_CLASS)
        if cls == ORIGINAL_CLASS:
            raw = _from_original_config(raw, file)
        elif cls != DIFFUSERS_CLASS:
            raise ValueError(f"{file} describes a {cls}, not a {DIFFUSERS_CLASS}: the directory is "
                             f"not a Wan transformer, so model_family wan cannot read it")
        config = {k: v for k, v in raw.items() if not k.startswith("_")}
        unknown = sorted(set(config) - set(WAN_DEFAULTS))
        if unknown:
            raise ValueError(f"{file} has keys relay's wan module does not know: {', '.join(unknown)}")
        config = {**self.defaults(), **config}
        config["patch_size"] = list(config["patch_size"])
        self.validate(config)
        return config

    def geometry(self, config: dict[str, Any]) -> Geometry:
        return wan_geometry(config)

    def linear_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return wan_linear_shapes(config)

    def param_counts(self, config: dict[str, Any]) -> ParamCounts:
        d = config["num_attention_heads"] * config["attention_head_dim"]
        f = config["ffn_dim"]
        patch = math.prod(config["patch_size"])
        out = (config["out_channels"] or config["in_channels"]) * patch
        attention = 4 * (d * d + d) + 2 * d  # q, k, v, out; RMSNorm on q and k
        per_block = (2 * attention + (2 * d if config["cross_attn_norm"] else 0)
                     + (d * f + f + f * d + d) + 6 * d)  # + FFN + the block's table
        root = ((config["in_channels"] * patch * d + d)  # patch embedding
                + (config["freq_dim"] * d + d + d * d + d)  # time MLP
                + (d * 6 * d + 6 * d)  # the shared time projection
                + (config["text_dim"] * d + d + d * d + d)  # text MLP
                + (d * out + out) + 2 * d)  # proj_out, the output table
        muon = config["num_layers"] * (8 * d * d + 2 * d * f)
        # the second time input: a copy of the time MLP
        second = (config["freq_dim"] * d + d + d * d + d) if config.get("two_time") else 0
        return ParamCounts(total=root + second + config["num_layers"] * per_block,
                           per_block=per_block, muon=muon, second_time=second)

    def forward_flops(self, config: dict[str, Any], video_tokens: int, text_tokens: int) -> float:
        """Per block: self-attention over the video, cross-attention from the video to the
        caption (its K/V computed per block), the FFN (tests/test_step_flops.py holds it to the
        products diffusers' WanTransformer3DModel runs); a second time input adds its MLP."""
        d = config["num_attention_heads"] * config["attention_head_dim"]
        patch = math.prod(config["patch_size"])
        out_channels = config["out_channels"] or config["in_channels"]
        n, length = video_tokens, text_tokens
        self_attention = 4 * _linear(n, d, d) + _attention(n, n, d)
        cross_attention = 2 * _linear(n, d, d) + 2 * _linear(length, d, d) + _attention(n, length, d)
        ffn = _linear(n, d, config["ffn_dim"]) + _linear(n, config["ffn_dim"], d)
        embed = (_linear(n, config["in_channels"] * patch, d)
                 + _linear(length, config["text_dim"], d) + _linear(length, d, d)
                 + _linear(1, config["freq_dim"], d) + _linear(1, d, d) + _linear(1, d, 6 * d)
                 + _linear(n, d, out_channels * patch))
        if config.get("two_time"):
            embed += _linear(1, config["freq_dim"], d) + _linear(1, d, d)
        return config["num_layers"] * (self_attention + cross_attention + ffn) + embed

    def source_layout(self, keys) -> str:
        """"original" for the Wan release's own layout (or ComfyUI's copy of it), else
        "diffusers" (whose keys are the module's)."""
        return "original" if any(m in key for key in keys for m in _ORIGINAL_MARKERS) \
            else "diffusers"

    def state_dict_adapter(self, layout: str) -> StateDictAdapter:
        if layout == "relay":
            return StateDictAdapter()
        if layout == "diffusers":
            return DiffusersWanAdapter()
        if layout == "original":
            return OriginalWanAdapter()
        raise ValueError(f"model family 'wan' has no {layout!r} state-dict layout; known: "
                         f"relay, diffusers (the same keys), original (the Wan release's)")

    def write_tiny_pipeline(self, directory, *, seed: int = 0,
                            boundary_ratio: float | None = None):
        from trainer.models.wan.tiny import write_tiny_wan_pipeline

        return write_tiny_wan_pipeline(directory, seed=seed, boundary_ratio=boundary_ratio)

    def build(self, config: dict[str, Any]):
        from trainer.models.wan.module import WanTransformer

        # A config recorded before relay's causal / two-time keys existed gets their defaults.
        config = {**self.defaults(), **config}
        self.validate(config)
        return WanTransformer(config)


def is_second_time_key(key: str) -> bool:
    """Whether a module key belongs to the second time input (absent from public layouts)."""
    return any(fnmatch.fnmatchcase(key, p) for p in WanFamily.second_time_keys)


class DiffusersWanAdapter(StateDictAdapter):
    """diffusers' WanTransformer3DModel keys: relay's own, less the second time input, which
    `convert_from_relay` leaves out (a diffusers export holds the single-time model's keys;
    a two-time model loaded from diffusers weights gets E_r from init_second_time_from_first)."""

    def convert_from_relay(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if not is_second_time_key(k)}


# (relay/diffusers name, original Wan name): whole-key prefixes; the first that matches wins.
_ROOT_NAMES = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("proj_out.", "head.head."),
    ("patch_embedding.", "patch_embedding."),
)
_BLOCK_NAMES = tuple(
    (f"{relay}.{a}", f"{original}.{b}")
    for relay, original in (("attn1", "self_attn"), ("attn2", "cross_attn"))
    for a, b in (("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."), ("to_out.0.", "o."),
                 ("norm_q.", "norm_q."), ("norm_k.", "norm_k."))
) + (
    # diffusers' norm2 (before the cross-attention) is the release's norm3, and the other way
    # round; only the cross-attention norm has weights
    ("norm2.", "norm3."),
    ("norm3.", "norm2."),
    ("ffn.net.0.proj.", "ffn.0."),
    ("ffn.net.2.", "ffn.2."),
)
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.*)$")


class OriginalWanAdapter(StateDictAdapter):
    """Keys of the Wan release (`blocks.0.self_attn.q.weight`, `head.modulation`, ...) to and
    from relay's (= diffusers') keys; a ComfyUI-style `model.diffusion_model.` prefix is
    dropped. A key of neither layout passes through unchanged, for strict loading to name it."""

    PREFIX = "model.diffusion_model."

    def to_relay(self, key: str) -> str | None:
        key = key.removeprefix(self.PREFIX)
        return _rename(key, {o: r for r, o in _ROOT_NAMES}, {o: r for r, o in _BLOCK_NAMES},
                       ("head.modulation", "scale_shift_table"), ("modulation", "scale_shift_table"))

    def from_relay(self, key: str) -> str:
        return _rename(key, dict(_ROOT_NAMES), dict(_BLOCK_NAMES),
                       ("scale_shift_table", "head.modulation"), ("scale_shift_table", "modulation"))

    def convert_from_relay(self, state: dict[str, Any]) -> dict[str, Any]:
        """The release's keys; the second time input, which the release has not, is left out."""
        return {self.from_relay(k): v for k, v in state.items() if not is_second_time_key(k)}


def _rename(key: str, root: dict[str, str], block: dict[str, str], root_table: tuple[str, str],
            block_table: tuple[str, str]) -> str:
    if key == root_table[0]:
        return root_table[1]
    match = _BLOCK.match(key)
    if match:
        index, rest = match.groups()
        if rest == block_table[0]:
            return f"blocks.{index}.{block_table[1]}"
        for source, target in block.items():
            if rest.startswith(source):
                return f"blocks.{index}.{target}{rest[len(source):]}"
        return key
    for source, target in root.items():
        if key.startswith(source):
            return target + key[len(source):]
    return key


ORIGINAL_CLASS = "WanModel"  # the config.json of the original Wan release
# The original release's config keys, as diffusers' (None: read, nothing to set).
_ORIGINAL_KEYS = {"dim": None, "num_heads": "num_attention_heads", "in_dim": "in_channels",
                  "out_dim": "out_channels", "text_dim": "text_dim", "freq_dim": "freq_dim",
                  "ffn_dim": "ffn_dim", "num_layers": "num_layers", "eps": "eps",
                  "cross_attn_norm": "cross_attn_norm", "patch_size": "patch_size",
                  "qk_norm": None, "model_type": None, "text_len": None, "window_size": None}


def _from_original_config(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """A diffusers-keyed config from the original release's config.json (`WanModel`: dim,
    num_heads, in_dim, ...). Raises ValueError for what relay's module does not implement."""
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    unknown = sorted(set(config) - set(_ORIGINAL_KEYS))
    if unknown:
        raise ValueError(f"{file} has keys relay's wan module does not know: {', '.join(unknown)}")
    model_type = config.get("model_type", "t2v")
    if model_type not in ("t2v", "ti2v"):
        raise ValueError(f"{file} describes a Wan {model_type!r} model: relay's wan module "
                         f"implements the text-to-video ones (t2v, ti2v) only")
    if config.get("qk_norm", True) is not True:
        raise ValueError(f"{file} sets qk_norm: false; relay's wan module implements only the "
                         f"RMSNorm on q and k every Wan2.1/2.2 checkpoint has")
    if list(config.get("window_size", [-1, -1])) != [-1, -1]:
        raise ValueError(f"{file} sets a local attention window_size "
                         f"{config['window_size']}, which relay's wan module does not implement")
    dim, heads = config.get("dim"), config.get("num_heads")
    if not (_is_int(dim, 1) and _is_int(heads, 1)) or dim % heads:
        raise ValueError(f"{file}: dim ({dim!r}) must be a multiple of num_heads ({heads!r})")
    out = {new: config[old] for old, new in _ORIGINAL_KEYS.items() if new and old in config}
    out["attention_head_dim"] = dim // heads
    return out


def diffusers_config_file(path: str | Path) -> Path | None:
    """The transformer config.json a warm-start path reads its architecture from, or None when
    the path has none (a file, a relay checkpoint or output_dir, a folder of safetensors
    without a config.json). The file may not exist: a pipeline directory (model_index.json, or
    a transformer/ folder) names transformer/config.json either way. A folder of the original
    release names its config.json (class WanModel: dim, num_heads, in_dim, ...)."""
    root = Path(path)
    if not root.is_dir() or (root / "COMPLETE").exists() or (root / ".metadata").exists():
        return None
    if (root / "model_index.json").is_file() or (root / "transformer").is_dir():
        if any(child.name.startswith("checkpoint-") for child in root.iterdir()):
            return None  # a relay output_dir
        return root / "transformer" / "config.json"
    file = root / "config.json"
    return file if file.is_file() else None


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _linear(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


def _attention(queries: int, keys: int, width: int) -> int:
    # scores (q k^T) and the weighted sum of values: 2 * queries * keys * head_dim per head each
    return 2 * 2 * queries * keys * width
