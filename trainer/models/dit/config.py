"""The video DiT's configuration: every constructor argument of VideoDiT, and its checks.

Plain Python (no torch), so the login node can validate a model before a job is submitted:
`DiTConfig(**kwargs)` raises ValueError saying what is wrong with an architecture, and
`MODEL_CONFIG_DEFAULTS` is what `transformer_config_overrides` starts from.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["DiTConfig", "MODEL_CONFIG_DEFAULTS", "TIME_FREQ_DIM", "dit_geometry"]

from trainer.diffusion.timesteps import NUM_TRAIN_TIMESTEPS  # noqa: F401  (re-exported)
from trainer.models.backends import ATTENTION_BACKENDS
from trainer.models.family import Geometry

TIME_FREQ_DIM = 256  # width of the sinusoidal timestep features fed to the time MLPs


@dataclass
class DiTConfig:
    """Every constructor argument of VideoDiT, validated; `to_dict()` rebuilds the model."""

    in_channels: int = 3
    out_channels: int | None = None  # None = in_channels
    hidden_size: int = 96
    num_attention_heads: int = 4
    num_layers: int = 4
    mlp_ratio: float = 4.0
    patch_size: tuple[int, int, int] = (1, 4, 4)  # (t, h, w)
    rope_axes_dim: tuple[int, int, int] = (8, 8, 8)  # (frame, row, col); sums to head_dim
    rope_theta: float = 10000.0
    text_dim: int = 32
    qk_norm: bool = True
    causal_chunk_size: int | None = None  # latent frames per chunk; None = bidirectional
    attn_window_chunks: int | None = None  # earlier chunks a chunk may see; None = all
    two_time: bool = False
    time_gate: float = 0.25
    attention_backend: str = "auto"  # see trainer/models/attention.py; auto = fastest that runs here
    zero_init_modulation: bool = True

    def __post_init__(self) -> None:
        self.patch_size = _int_triple("patch_size", self.patch_size)
        self.rope_axes_dim = _int_triple("rope_axes_dim", self.rope_axes_dim, low=0)
        for name in ("in_channels", "hidden_size", "num_attention_heads", "num_layers", "text_dim"):
            _require_int(name, getattr(self, name), low=1)
        if self.out_channels is not None:
            _require_int("out_channels", self.out_channels, low=1)
        for name in ("mlp_ratio", "rope_theta"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)) \
                    or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("qk_norm", "two_time", "zero_init_modulation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if sum(self.rope_axes_dim) != head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(
                f"rope_axes_dim {list(self.rope_axes_dim)} must be even numbers summing to the head "
                f"dim hidden_size / num_attention_heads = {head_dim}"
            )
        if self.causal_chunk_size is not None:
            _require_int("causal_chunk_size", self.causal_chunk_size, low=1)
            if self.causal_chunk_size % self.patch_size[0]:
                raise ValueError(
                    f"causal_chunk_size ({self.causal_chunk_size} latent frames) must be a multiple "
                    f"of the temporal patch size {self.patch_size[0]}: chunks are whole patch-frames"
                )
        if self.attn_window_chunks is not None:
            _require_int("attn_window_chunks", self.attn_window_chunks, low=0)
            if self.causal_chunk_size is None:
                raise ValueError("attn_window_chunks needs causal_chunk_size: the window counts chunks")
        if isinstance(self.time_gate, bool) or not isinstance(self.time_gate, (int, float)) \
                or not 0.0 <= self.time_gate <= 1.0:
            raise ValueError(f"time_gate must be a number in [0, 1], got {self.time_gate!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is unknown; known: "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def output_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], where: str = "VideoDiT") -> "DiTConfig":
        """The config for these keyword arguments.

        Raises ValueError naming the closest valid key for an unknown key, or saying why a value
        is invalid.
        """
        valid = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
                raise ValueError(f"unknown {where} key {key!r}{hint}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (tuples as lists); `VideoDiT(**d)` rebuilds the same model."""
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        d["rope_axes_dim"] = list(self.rope_axes_dim)
        return d


def dit_geometry(config: dict[str, Any]) -> Geometry:
    """The geometry (trainer.models.family.Geometry) of a complete DiT config dict."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    return Geometry(
        patch_size=tuple(config["patch_size"]), num_heads=heads, head_dim=h // heads,
        hidden_size=h, num_layers=config["num_layers"], latent_channels=config["in_channels"],
        out_channels=config.get("out_channels") or config["in_channels"],
        text_dim=config["text_dim"], causal_chunk_frames=config.get("causal_chunk_size"),
        two_time=bool(config.get("two_time")),
        time_gate=float(config["time_gate"]) if config.get("two_time") else None)


def _require_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _int_triple(name: str, value: Any, low: int = 1) -> tuple[int, int, int]:
    if isinstance(value, int) or len(value) != 3:
        raise ValueError(f"{name} must be three integers (t, h, w), got {value!r}")
    for item in value:
        _require_int(name, item, low)
    return tuple(int(v) for v in value)


MODEL_CONFIG_DEFAULTS: dict[str, Any] = DiTConfig().to_dict()

