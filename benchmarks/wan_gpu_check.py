"""The wan family on one GPU against diffusers' own WanTransformer3DModel on the same weights:
relative error of relay's bf16 forward (auto attention backend) and of diffusers' bf16 forward,
both against diffusers' fp32 forward; compiled against eager gradients. Prints JSON.

    python benchmarks/wan_gpu_check.py
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.models.wan.family import WanFamily  # noqa: E402

CONFIG = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
          "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
          "ffn_dim": 8960, "num_layers": 2, "cross_attn_norm": True,
          "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    from diffusers import WanTransformer3DModel

    device = torch.device("cuda")
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**CONFIG).to(device).eval()
    family = WanFamily()
    model = family.build(family.config(CONFIG)).to(device).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, 16, 9, 60, 104, device=device, generator=g)  # 9 x 30 x 52 = 14,040 tokens
    t = torch.tensor([700.0], device=device)
    text = torch.randn(1, 512, 4096, device=device, generator=g)
    with torch.no_grad():
        exact = reference(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours = model(x, t, text)
            theirs = reference(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
    compiled = copy.deepcopy(model)
    compiled.compile_blocks()
    grads = []
    for m in (model, compiled):
        m.train().zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x, t, text)
        out.float().square().mean().backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    worst = max(_rel(grads[1][n], grads[0][n]) for n in grads[0])
    print(json.dumps({
        "config": "Wan2.1-1.3B width (12 x 128, ffn 8960), 2 layers, 14,040 video + 512 caption tokens",
        "relay_bf16_vs_fp32_rel_err": _rel(ours, exact),
        "diffusers_bf16_vs_fp32_rel_err": _rel(theirs, exact),
        "compiled_vs_eager_worst_grad_rel_err": worst,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
    }, indent=2))


if __name__ == "__main__":
    main()
