"""The wan module's linear layers, for LoRA (torch-free): the default targets and the shapes.

`WAN_LORA_TARGETS` is what a LoRA of the wan family adapts when lora_target_modules is empty:
q, k, v and the output projection of the self-attention (attn1) and the cross-attention to the
caption (attn2) of every block, the layers diffusers' Wan LoRAs adapt. The FFN joins with
`ffn.net.0.proj` and `ffn.net.2`. `wan_linear_shapes` lists every nn.Linear of
trainer.models.wan.module.WanTransformer with diffusers' module names.
"""

from __future__ import annotations

import math
from typing import Any

WAN_LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


def wan_linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) features of every nn.Linear of the wan module for `config`."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    out = (config["out_channels"] or config["in_channels"]) * math.prod(config["patch_size"])
    shapes = {"condition_embedder.time_embedder.linear_1": (config["freq_dim"], d),
              "condition_embedder.time_embedder.linear_2": (d, d),
              "condition_embedder.time_proj": (d, 6 * d),
              "condition_embedder.text_embedder.linear_1": (config["text_dim"], d),
              "condition_embedder.text_embedder.linear_2": (d, d)}
    if config.get("two_time"):  # the second time input, an MLP like the first
        shapes["condition_embedder.time_embedder_r.linear_1"] = (config["freq_dim"], d)
        shapes["condition_embedder.time_embedder_r.linear_2"] = (d, d)
    for i in range(config["num_layers"]):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes[f"blocks.{i}.{attn}.{proj}"] = (d, d)
        shapes[f"blocks.{i}.ffn.net.0.proj"] = (d, config["ffn_dim"])
        shapes[f"blocks.{i}.ffn.net.2"] = (config["ffn_dim"], d)
    shapes["proj_out"] = (d, out)
    return shapes
