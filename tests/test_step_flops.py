"""The benchmark's FLOP counts against torch's own count of the products the models run."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.flops import model_forward_flops
from trainer.models.dit.module import VideoDiT

torch.set_num_threads(1)


def _counted(fn) -> int:
    # The math SDPA runs its two products as plain matmuls, which the counter sees (it has no
    # formula for the fused CPU attention kernel).
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("text_tokens", [3, 7])
def test_relay_count_matches_the_products_the_model_runs(text_tokens):
    config = dict(in_channels=4, hidden_size=32, num_attention_heads=2, num_layers=3, mlp_ratio=3.0,
                  patch_size=(1, 2, 2), rope_axes_dim=(4, 6, 6), text_dim=12, attention_backend="sdpa")
    model = VideoDiT(**config)
    x = torch.randn(1, 4, 3, 4, 6)  # 3 x 2 x 3 = 18 video tokens
    text = torch.randn(1, text_tokens, 12)
    counted = _counted(lambda: model(x, torch.tensor([300.0]), text))
    assert model_forward_flops("dit", model.config, 18, text_tokens) == counted


def test_wan_count_matches_the_products_the_model_runs():
    diffusers = pytest.importorskip("diffusers")
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                  out_channels=4, text_dim=12, freq_dim=32, ffn_dim=48, num_layers=2,
                  rope_max_seq_len=32)
    model = diffusers.WanTransformer3DModel(**config)
    x = torch.randn(1, 4, 3, 4, 6)
    text = torch.randn(1, 5, 12)
    counted = _counted(lambda: model(x, timestep=torch.tensor([300.0]), encoder_hidden_states=text))
    assert model_forward_flops("wan", dict(model.config), 18, 5) == counted


def test_the_step_benchmark_runs_both_models_training_steps_on_the_cpu(tmp_path):
    # The GPU benchmark's own code path at the tiny size: relay's train_step (keyed draws and
    # all) and diffusers' Wan, so a change to the stages cannot silently break the benchmark.
    import json

    from benchmarks import step

    out = tmp_path / "step.json"
    assert step.main(["--size", "tiny", "--runs", "relay:eager:off,relay:eager:selective,wan:eager:on",
                      "--steps", "1", "--warmup", "1", "--skip-kernels", "--device", "cpu",
                      "--matmul-size", "256", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["run"] for r in runs] == ["relay:eager:off", "relay:eager:selective", "wan:eager:on"]
    for run in runs:
        assert "error" not in run, run.get("traceback", run.get("error"))
        assert run["step_s"] > 0 and all(torch.isfinite(torch.tensor(run["losses"])))
