"""A third model family, defined entirely outside relay's package: a per-patch MLP conditioned
on the time and the mean caption. It exists to prove that a family plugs in through
trainer.models.registry alone (no product file names it).

    python tests/families/pixel_mlp.py <train.py arguments>   registers it, then runs train.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.models.family import Geometry, ModelFamily, ParamCounts  # noqa: E402
from trainer.models.registry import register_family  # noqa: E402

FREQ = 16  # sinusoidal time features


class PixelMLPFamily(ModelFamily):
    name = "pixel_mlp"
    capabilities = frozenset({"per_frame_times"})

    def defaults(self) -> dict[str, Any]:
        return {"in_channels": 3, "hidden": 24, "layers": 2, "text_dim": 32,
                "patch": [1, 4, 4]}

    def validate(self, config: dict[str, Any]) -> None:
        if config["hidden"] < 1 or config["layers"] < 1:
            raise ValueError("hidden and layers must be >= 1")

    def geometry(self, config: dict[str, Any]) -> Geometry:
        return Geometry(patch_size=tuple(config["patch"]), num_heads=1, head_dim=config["hidden"],
                        hidden_size=config["hidden"], num_layers=config["layers"],
                        latent_channels=config["in_channels"], out_channels=config["in_channels"],
                        text_dim=config["text_dim"])

    def param_counts(self, config: dict[str, Any]) -> ParamCounts:
        h, patch = config["hidden"], config["in_channels"] * math.prod(config["patch"])
        per_block = h * h + h
        root = (patch * h + h) + (FREQ * h + h) + (config["text_dim"] * h + h) + (h * patch + patch)
        return ParamCounts(total=root + config["layers"] * per_block, per_block=per_block,
                           muon=config["layers"] * h * h)

    def forward_flops(self, config: dict[str, Any], video_tokens: int, text_tokens: int) -> float:
        h, patch = config["hidden"], config["in_channels"] * math.prod(config["patch"])
        return 2 * video_tokens * (2 * patch * h + config["layers"] * h * h)

    def bidirectional_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return dict(config)

    def build(self, config: dict[str, Any]):
        return PixelMLP(config)


def _module_class():
    import torch
    from torch import nn

    class _PixelMLP(nn.Module):
        def __init__(self, config: dict[str, Any]):
            super().__init__()
            self.config = dict(config)
            h = config["hidden"]
            self.patch = tuple(config["patch"])
            volume = config["in_channels"] * math.prod(self.patch)
            self.embed = nn.Linear(volume, h)
            self.time = nn.Linear(FREQ, h)
            self.caption = nn.Linear(config["text_dim"], h)
            self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(config["layers"]))
            self.out = nn.Linear(h, volume)

        @property
        def geometry(self) -> Geometry:
            return PixelMLPFamily().geometry(self.config)

        def forward(self, x, t, text, text_mask=None, r=None):
            b, c, frames, height, width = x.shape
            pt, ph, pw = self.patch
            tokens = (x.reshape(b, c, frames // pt, pt, height // ph, ph, width // pw, pw)
                      .permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, frames // pt, -1, c * pt * ph * pw))
            t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
            t = t.reshape(b, -1)[:, ::pt] if t.dim() > 1 else t.reshape(b, 1)
            freqs = torch.exp(torch.arange(FREQ // 2, device=x.device, dtype=x.dtype) * -0.5)
            angles = t[..., None] / 1000 * freqs
            time = self.time(torch.cat([angles.sin(), angles.cos()], -1))[:, :, None]
            if text_mask is None:
                caption = text.mean(1)
            else:
                weights = text_mask.to(text.dtype)[..., None]
                caption = (text * weights).sum(1) / weights.sum(1).clamp_min(1)
            hidden = self.embed(tokens) + time + self.caption(caption)[:, None, None]
            for block in self.blocks:
                hidden = hidden + torch.nn.functional.gelu(block(hidden))
            out = self.out(hidden).reshape(b, frames // pt, height // ph, width // pw, c, pt, ph, pw)
            return out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, frames, height, width)

        def fsdp_units(self):
            return list(self.blocks)

        def checkpoint_units(self):
            return list(self.blocks)

        def compile_blocks(self) -> None:
            for block in self.blocks:
                block.compile()

        def attach_context_parallel(self, ulysses) -> None:
            raise ValueError("pixel_mlp does not run context-parallel")

    return _PixelMLP


def PixelMLP(config: dict[str, Any]):  # noqa: N802 - a class built on first use (torch lazily)
    return _module_class()(config)


register_family(PixelMLPFamily())

if __name__ == "__main__":
    from trainer import train

    sys.exit(train.main(sys.argv[1:]))
