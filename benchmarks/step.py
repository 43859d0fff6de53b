"""One training step on one GPU: relay's own train_step against diffusers' Wan at the same size.

    python benchmarks/step.py --json step.json [--size wan-1.3b] [--runs relay:compiled:off,...]
                              [--steps 5] [--warmup 2] [--profile relay:compiled:off,...]
                              [--profile-dir DIR] [--attention auto]

In one process, on one GPU, with the same batch, tokens, dtype and optimizer:

1. the matrix-product ceiling: an 8192^3 bf16 product on random data (median of 20);
2. the attention kernels at the size's video attention shape, forward + backward: cuDNN SDPA
   and every kernel relay can route to here (FA4, flex);
3. each run `model:mode:checkpointing` (mode eager or compiled, checkpointing on, off, or
   (relay's models only) selective: attention outputs kept, the rest of each block recomputed),
   where model is one of
   - `relay`: relay's own DiT at the size (its adaLN is a Linear(D, 6D) per block);
   - `relay-wan`: relay's `wan` family, the Wan architecture itself, through relay's kernels;
   - `relay-wan-lora`: the same model as a LoRA of rank `--lora-rank` (the family's default
     targets: q/k/v/out of both attentions) over its own random weights as the frozen base;
   - `relay-wan-sparse`: relay-wan with sparse video self-attention
     (`video_attention_sparsity`, trainer/models/sparse_attention.py) at each of `--sparsity`
     (one run per value, named relay-wan-sparse@S) with tiles of `--sparse-tile`;
   - `wan`: diffusers' `WanTransformer3DModel` as shipped (its attention through
     `dispatch_attention_fn`, PyTorch SDPA by default);
   - `wan-fa4`: the same diffusers model with relay's FA4 operator
     (trainer.models.fa4_ops) in place of its attention dispatch, so the comparison with
     relay-wan is of everything but the kernel;
   each run: `warmup` steps, then `steps` timed steps (wall clock between
   device synchronisations; median, min, max), the peak allocated and reserved memory, tokens/s
   and MFU from counted FLOPs (benchmarks/flops.py) over the measured ceiling and over 989
   TFLOP/s (the H100/H200 dense bf16 datasheet figure).

relay's step is `FlowMatchingStage.train_step` on a model built by the same functions as
training (`prepare_for_training`, `build_optimization`), from train.py's own argument parser:
the loss, gradient clipping, fused AdamW, the LR schedule. Wan's step does the same work with
diffusers' `WanTransformer3DModel` (random weights, no download): bf16 autocast over float32
weights, flow-matching loss, clipping, fused AdamW with the same settings, `compile` of its
repeated blocks, `enable_gradient_checkpointing`. Caption dropout is off in both (a dropped
caption is padding only relay would see). --profile runs one more step of the named runs
under torch.profiler and writes its top kernels.

Sizes: wan-1.3b (Wan2.1-T2V-1.3B: hidden 1536, 30 layers, 21 x 60 x 104 latents = 32,760
video tokens, 512 caption tokens), h3072-16k and h5120-8k (8 layers, to fit one GPU with
AdamW), tiny (for a CPU smoke run). Results go to --json as they come, so a run that dies
keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.runtime.cuda_memory import configure_cuda_allocator  # noqa: E402  (before torch touches CUDA)

configure_cuda_allocator()

import torch  # noqa: E402

from benchmarks.flops import model_forward_flops, train_flops  # noqa: E402

DATASHEET_TFLOPS = 989.0
SIZES = {
    # hidden, heads, layers, ffn, latent (C, T, H, W), caption tokens, caption width
    "wan-1.3b": dict(hidden=1536, heads=12, layers=30, ffn=8960, latent=(16, 21, 60, 104), text=512,
                     text_dim=4096),
    "h3072-16k": dict(hidden=3072, heads=24, layers=8, ffn=14336, latent=(16, 21, 30, 104), text=512,
                      text_dim=4096),
    "h5120-8k": dict(hidden=5120, heads=40, layers=8, ffn=13824, latent=(16, 21, 30, 52), text=512,
                     text_dim=4096),
    "tiny": dict(hidden=64, heads=2, layers=2, ffn=160, latent=(4, 3, 8, 8), text=8, text_dim=32),
}
PATCH = (1, 2, 2)
MODELS = ("relay", "relay-wan", "relay-wan-lora", "relay-wan-sparse", "wan", "wan-fa4")
ATTENTION_KERNELS = re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*(sdpa|mha)", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# shapes and the two models


def video_tokens(size: dict) -> int:
    _, t, h, w = size["latent"]
    return (t // PATCH[0]) * (h // PATCH[1]) * (w // PATCH[2])


def rope_axes(head_dim: int) -> list[int]:
    """Wan's split of the head between (frame, row, col): 44/42/42 of 128, pairs kept whole."""
    hw = 2 * (head_dim // 6)
    return [head_dim - 2 * hw, hw, hw]


def relay_overrides(size: dict, attention: str) -> dict:
    head_dim = size["hidden"] // size["heads"]
    return dict(in_channels=size["latent"][0], hidden_size=size["hidden"],
                num_attention_heads=size["heads"], num_layers=size["layers"],
                mlp_ratio=size["ffn"] / size["hidden"], patch_size=list(PATCH),
                rope_axes_dim=rope_axes(head_dim), text_dim=size["text_dim"], qk_norm=True,
                attention_backend=attention)


def wan_config(size: dict) -> dict:
    return dict(patch_size=PATCH, num_attention_heads=size["heads"],
                attention_head_dim=size["hidden"] // size["heads"], in_channels=size["latent"][0],
                out_channels=size["latent"][0], text_dim=size["text_dim"], freq_dim=256,
                ffn_dim=size["ffn"], num_layers=size["layers"], cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6)


class FixedBatches:
    """The data side of a step: the same host batch every step, copied to the GPU by the step."""

    def __init__(self, size: dict, pin: bool, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        latents = torch.randn(1, *size["latent"], generator=g)
        text = torch.randn(1, size["text"], size["text_dim"], generator=g)
        self.batch = {"latents": latents.pin_memory() if pin else latents,
                      "text": text.pin_memory() if pin else text,
                      "text_mask": torch.ones(1, size["text"], dtype=torch.bool),
                      "sample_index": torch.zeros(1, dtype=torch.long)}
        self.position = 0

    def next_batch(self) -> dict:
        # What the data loader adds: the sample's place in the stream, which keys its draws.
        self.position += 1
        return {**self.batch, "sample_keys": [self.position]}


def relay_args(size: dict, mode: str, checkpointing: str, attention: str, workdir: str,
               family: str = "dit", lora_base: str | None = None, lora_rank: int = 0,
               sparsity: float = 0.0, tile: tuple = (2, 8, 8)):
    """train.py's arguments for this run, through train.py's own parser (a LoRA run of rank
    `lora_rank` over the frozen base in the safetensors file `lora_base`)."""
    from trainer.resolve import resolve_config

    config = str(Path(__file__).resolve().parents[1] / "config/tiny/pretrain.yaml")
    overrides = (relay_overrides(size, attention) if family == "dit"
                 else {**wan_config(size), "patch_size": list(PATCH), "attention_backend": attention})
    argv = ["--model_family", family, "--transformer_config_overrides", json.dumps(overrides),
            "--train_batch_size", "1", "--use_muon", "false", "--learning_rate", "1e-4",
            "--warmup_steps", "10", "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0",
            "--cfg_drop_prob", "0", "--image_cond_prob", "0", "--video_cond_prob", "0",
            "--text_max_tokens", str(size["text"]), "--dtype", "auto",
            "--compile_transformer", str(mode == "compiled").lower(),
            "--enable_gradient_checkpointing", str(checkpointing != "off").lower(),
            "--use_dedicated_gradient_checkpointing", str(checkpointing == "selective").lower(),
            "--output_dir", workdir, "--data_path", workdir, "--validation_interval", "-1"]
    if sparsity:
        argv += ["--video_attention_sparsity", str(sparsity), "--video_attention_tile",
                 json.dumps(list(tile))]
    if lora_rank:
        argv += ["--lora_rank", str(lora_rank), "--pretrained_transformer_path", lora_base,
                 "--load_transformer_weights", "true"]
    # The step reads fixed in-memory batches (FixedBatches), never the data directory.
    return resolve_config(config, argv, check_paths=False)


def build_relay(size: dict, mode: str, checkpointing: str, attention: str, device, workdir: str,
                family: str = "dit", lora_rank: int = 0, sparsity: float = 0.0,
                tile: tuple = (2, 8, 8)):
    """(step function, parameter count, model config) of relay's FlowMatchingStage on the
    family's model (relay's DiT, or its wan family); with `lora_rank`, a LoRA of the family's
    default targets over the model's own random weights, saved as its frozen base first."""
    from safetensors.torch import save_file

    from trainer.build import build_ema, build_optimization, build_text_encoder, prepare_for_training
    from trainer.models.registry import family_of, model_config
    from trainer.stages.fm import FlowMatchingStage

    base = str(Path(workdir) / "base.safetensors")
    args = relay_args(size, mode, checkpointing, attention, workdir, family, sparsity=sparsity,
                      tile=tile)
    with torch.device(device):  # initialised on the GPU: 1.5 B parameters are slow on the host
        model = family_of(args).build(model_config(args))
    if lora_rank:  # as build_trained_model does: the frozen base and its adapters first
        from trainer.checkpoint.lora_weights import prepare_lora

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, base)
        args = relay_args(size, mode, checkpointing, attention, workdir, family, base, lora_rank)
        model = prepare_lora(model, args)
    model = prepare_for_training(model, args)
    if sparsity:  # as train.py's loop sets it before each step (here: the target throughout)
        from trainer.models.sparse_attention import set_video_attention_sparsity

        set_video_attention_sparsity(model, sparsity, tile)
    optimizer, scheduler = build_optimization(args, model, max_steps=args.max_steps)
    ema = build_ema(args, model)
    stage = FlowMatchingStage(model, model, optimizer, scheduler, ema,
                              FixedBatches(size, pin=device.type == "cuda"), args,
                              build_text_encoder(args), device)
    params = sum(p.numel() for p in model.parameters())

    def step(index: int) -> float:
        return stage.train_step(index)["loss"]

    step.params = list(model.parameters())
    return step, params, dict(model.config)


def route_diffusers_wan_attention(fa4: bool) -> None:
    """Route diffusers' Wan attention through relay's FA4 operator (trainer.models.fa4_ops), or
    back to diffusers' own dispatch.

    diffusers' Wan attention processor calls `dispatch_attention_fn(q, k, v, attn_mask=...)`
    with q/k/v [B, N, heads, head_dim], the layout FA4 takes; the benchmark's captions have no
    padding, so no mask reaches it (a mask is refused rather than ignored)."""
    import diffusers.models.attention_dispatch as attention_dispatch
    import diffusers.models.transformers.transformer_wan as transformer_wan

    from trainer.models.fa4_ops import fa4_attention

    def dispatch(query, key, value, attn_mask=None, **_):
        if attn_mask is not None:
            raise ValueError("the wan-fa4 benchmark run takes no attention mask")
        return fa4_attention(query, key, value)

    transformer_wan.dispatch_attention_fn = (dispatch if fa4
                                             else attention_dispatch.dispatch_attention_fn)


def build_wan(size: dict, mode: str, checkpointing: str, device, fa4: bool = False):
    """(step function, parameter count, config) of the same training step on diffusers' Wan
    (its attention through relay's FA4 operator with `fa4`)."""
    from diffusers import WanTransformer3DModel

    from trainer.optim.optimizers import build_lr_scheduler

    import torch._inductor.config as inductor_config

    # A known pitfall: wrong adaLN-table gradients in compiled Wan blocks on
    # torch 2.11 without this (relay's compile_transformer_blocks sets it too).
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False
    route_diffusers_wan_attention(fa4)
    with torch.device(device):
        model = WanTransformer3DModel(**wan_config(size))
    model.train()
    if checkpointing == "on":
        model.enable_gradient_checkpointing()
    if mode == "compiled":
        model.compile_repeated_blocks()
    params = list(model.parameters())
    # relay's defaults (adam_beta1/2, eps, weight decay) through the same constructor arguments
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=device.type == "cuda" or None)
    scheduler = build_lr_scheduler(optimizer, lr_scheduler_type="constant", warmup_steps=10,
                                   max_steps=1000, lr_decay_steps=None, lr_decay_floor_ratio=0.0)
    data = FixedBatches(size, pin=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(_: int) -> float:
        batch = {k: v.to(device, non_blocking=True) for k, v in data.next_batch().items()
                 if isinstance(v, torch.Tensor)}
        x0 = batch["latents"]
        noise = torch.randn_like(x0)
        sigma = torch.rand(x0.shape[0], device=device)
        x_t = x0 + sigma.view(-1, 1, 1, 1, 1) * (noise - x0)
        with autocast:
            pred = model(x_t, timestep=sigma * 1000, encoder_hidden_states=batch["text"],
                         return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        float(norm)  # relay's step reads the norm and the loss on the host, so does this one
        return float(loss.detach())

    return step, sum(p.numel() for p in params), dict(model.config)


# --------------------------------------------------------------------------------------------
# measurements


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling(device, n: int, repeats: int = 20) -> dict:
    """TFLOP/s of an n^3 product on random data (bf16 on a GPU, float32 on a CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    times = []
    for i in range(repeats + 3):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"n": n, "dtype": str(dtype), "median_s": median, "tflops": 2 * n ** 3 / median / 1e12}


def time_attention(device, size: dict, attention: str, repeats: int = 10) -> list[dict]:
    """Forward + backward of the video attention (N queries over N + L keys) by kernel."""
    from trainer.models import attention as attn

    n, length = video_tokens(size), size["text"]
    heads, head_dim = size["heads"], size["hidden"] // size["heads"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, n, heads, head_dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, n + length, heads, head_dim, device=device, dtype=dtype, generator=g)
            for _ in range(2))
    grad = torch.randn_like(q)
    flops = 3 * 4 * n * (n + length) * heads * head_dim
    results, reference = [], None
    kernels = ["sdpa"] + [k for k in ("fa4", "flash_attn", "flex")
                          if attn._runs_here(k, device, dtype, head_dim)]
    for kernel in kernels:
        plan = attn.AttentionPlan(kernel, None, None)
        if kernel == "flex":
            plan = attn.AttentionPlan("flex", None, attn._flex_block_mask(
                None, torch.full((1,), n + length, device=device), n, n + length, device))
        try:
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            times, first = [], None
            for i in range(repeats + 2):
                synchronize(device)
                start = time.perf_counter()
                out = attn.attend(plan, *inputs)
                out.backward(grad)
                synchronize(device)
                (times if i >= 2 else []).append(time.perf_counter() - start)
                first = first if first is not None else time.perf_counter() - start
            if reference is None:
                reference = out.detach().float()
            median = statistics.median(times)
            results.append({"kernel": kernel, "median_s": median, "first_call_s": first,
                            "tflops": flops / median / 1e12,
                            "max_abs_diff_vs_sdpa": float((out.detach().float() - reference).abs().max())})
        except Exception as exc:  # one kernel failing must not cost the rest of the run
            results.append({"kernel": kernel, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    return results


def free_memory(device) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}


def profile_step(step, index: int, device, top: int = 60) -> dict:
    """One step under torch.profiler: its wall time, kernel time, top kernels, attention share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step(index)
        synchronize(device)
    wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        # GPU-side ranges of annotations (the optimizer's step) span kernels counted already
        if event.device_type == torch.autograd.DeviceType.CUDA and \
                not getattr(event, "is_user_annotation", False):
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total / 1e6 if hasattr(event, "device_time_total") \
                else event.cuda_time_total / 1e6
            entry[1] += 1
    total = sum(t for t, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    attention = sum(t for name, (t, _) in kernels.items() if ATTENTION_KERNELS.search(name))
    # a small model's step is bound by the host: what the host spends its time on, by operator
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {"wall_s": wall, "kernel_s": total, "attention_kernel_s": attention,
            "attention_share": attention / total if total else None,
            "top_kernels": [{"name": name[:200], "s": t, "calls": calls, "share": t / total}
                            for name, (t, calls) in ranked[:top]],
            "top_host_ops": [{"name": e.key[:200], "self_cpu_s": e.self_cpu_time_total / 1e6,
                              "calls": e.count} for e in host]}


def run_one(spec: str, size_name: str, args, device, ceiling_tflops: float | None) -> dict:
    """Build, warm up, time (and maybe profile) one `model:mode:checkpointing` run."""
    model_name, mode, checkpointing = spec.split(":")
    model_name, _, sparsity = model_name.partition("@")  # relay-wan-sparse@0.9
    sparsity = float(sparsity or 0)
    size = SIZES[size_name]
    result = {"run": spec, "size": size_name, "model": model_name, "mode": mode,
              "checkpointing": checkpointing, "video_tokens": video_tokens(size),
              "text_tokens": size["text"]}
    free_memory(device)
    build_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        try:
            if model_name.startswith("relay"):
                family = "dit" if model_name == "relay" else "wan"
                lora = args.lora_rank if model_name == "relay-wan-lora" else 0
                step, params, config = build_relay(size, mode, checkpointing, args.attention, device,
                                                   workdir, family, lora, sparsity,
                                                   tuple(args.sparse_tile))
                result["sparsity"] = sparsity
                result["trainable_parameters"] = sum(p.numel() for p in step.params if p.requires_grad)
                forward = model_forward_flops(family, config, video_tokens(size), size["text"])
            else:
                step, params, config = build_wan(size, mode, checkpointing, device,
                                                 fa4=model_name == "wan-fa4")
                forward = model_forward_flops("wan", config, video_tokens(size), size["text"])
            # A LoRA step computes no weight gradients of the frozen base: forward plus the
            # input gradients, 2x the forward (the adapters' own products are negligible).
            flops = 2 * forward if model_name == "relay-wan-lora" else train_flops(forward)
            result.update(parameters=params, train_flops=flops,
                          build_s=time.perf_counter() - build_start)
            first = time.perf_counter()
            times, losses = [], []
            for i in range(args.warmup + args.steps):
                synchronize(device)
                start = time.perf_counter()
                losses.append(step(i))
                synchronize(device)
                if i == 0:
                    result["first_step_s"] = time.perf_counter() - first
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            median = statistics.median(times)
            result.update(step_s=median, step_min_s=min(times), step_max_s=max(times),
                          step_times_s=times, losses=losses,
                          video_tokens_per_s=video_tokens(size) / median,
                          tokens_per_s=(video_tokens(size) + size["text"]) / median,
                          achieved_tflops=result["train_flops"] / median / 1e12,
                          **memory_gib(device))
            result["mfu_datasheet"] = result["achieved_tflops"] / DATASHEET_TFLOPS
            if ceiling_tflops:
                result["mfu_measured_ceiling"] = result["achieved_tflops"] / ceiling_tflops
            if spec in args.profile:
                result["profile"] = profile_step(step, args.warmup + args.steps, device)
        except torch.OutOfMemoryError as exc:
            result.update(error="out of memory", detail=str(exc)[:1500], **memory_gib(device))
        except Exception as exc:  # record and go on: one broken run must not lose the others
            import traceback

            result.update(error=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc()[-4000:], **memory_gib(device))
        finally:
            step = None
    free_memory(device)
    return result


def versions(device) -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    for dist in ("flash-attn-4", "flash-attn", "quack-kernels", "nvidia-cutlass-dsl", "diffusers",
                 "triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        found["gpu_capability"] = list(torch.cuda.get_device_capability(device))
    return found


def print_table(results: list[dict]) -> None:
    print(f"{'run':<30} {'step s':>8} {'min..max':>13} {'peak GiB':>9} {'MFU(989)':>9} {'MFU(meas)':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['run']:<30} {r['error'][:60]}")
            continue
        print(f"{r['run']:<30} {r['step_s']:8.3f} {r['step_min_s']:6.3f}..{r['step_max_s']:.3f} "
              f"{r.get('peak_allocated_gib', float('nan')):9.1f} {r['mfu_datasheet']:9.1%} "
              f"{r.get('mfu_measured_ceiling', float('nan')):9.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="wan-1.3b", choices=sorted(SIZES))
    parser.add_argument("--runs", default="relay:compiled:off,wan:compiled:off",
                        help="comma-separated model:mode:checkpointing (relay|relay-wan|wan|wan-fa4, "
                             "eager|compiled, on|off|selective)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=32,
                        help="the rank of relay-wan-lora runs (the wan family's default targets)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sparsity", default="0.5,0.8,0.9",
                        help="relay-wan-sparse runs: one run per comma-separated sparsity")
    parser.add_argument("--sparse-tile", default="2,8,8",
                        help="relay-wan-sparse runs: the tile, frames,rows,cols in tokens")
    parser.add_argument("--attention", default="auto", help="relay's attention_backend")
    parser.add_argument("--profile", default="", help="runs to profile one extra step of")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--skip-kernels", action="store_true", help="no attention kernel timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--activation-memory-budget", type=float, default=None,
                        help="the compile partitioner's activation_memory_budget (the fraction of "
                             "its default saved activations to keep) for both models; default: "
                             "relay's own, trainer.models.common.compiling.ACTIVATION_MEMORY_BUDGET")
    parser.add_argument("--coordinate-descent-tuning", action="store_true",
                        help="Inductor tunes each generated kernel's block sizes by timing them "
                             "(longer first compile), for every run of this process")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.coordinate_descent_tuning:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    # One partitioner setting for both models (it is process-wide, and relay's compile sets its
    # own), so their compiled steps are compared under the same recompute policy.
    import torch._functorch.config as functorch_config

    import trainer.models.common.compiling

    if args.activation_memory_budget is not None and not 0 <= args.activation_memory_budget <= 1:
        parser.error(f"--activation-memory-budget {args.activation_memory_budget}: a fraction "
                     "from 0 (recompute everything) to 1 (torch's default)")
    if args.activation_memory_budget is None:
        args.activation_memory_budget = trainer.models.common.compiling.ACTIVATION_MEMORY_BUDGET
    functorch_config.activation_memory_budget = args.activation_memory_budget
    trainer.models.common.compiling.ACTIVATION_MEMORY_BUDGET = args.activation_memory_budget
    args.profile = [p for p in args.profile.split(",") if p]
    args.sparse_tile = [int(x) for x in args.sparse_tile.split(",")]
    runs = [r for r in args.runs.split(",") if r]
    for spec in runs + args.profile:
        parts = spec.split(":")
        if (len(parts) != 3 or parts[0] not in MODELS or parts[1] not in ("eager", "compiled")
                or parts[2] not in ("on", "off", "selective")
                or parts[2] == "selective" and not parts[0].startswith("relay")):
            parser.error(f"run {spec!r} is not model:mode:checkpointing "
                         f"({'|'.join(MODELS)} : eager|compiled : on|off, or selective for "
                         "relay's models)")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    report = {"command": " ".join(["python", "benchmarks/step.py", *(argv or sys.argv[1:])]),
              "size": {"name": args.size, **SIZES[args.size]}, "versions": versions(device),
              "allocator": __import__("os").environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "activation_memory_budget": args.activation_memory_budget,
              "coordinate_descent_tuning": args.coordinate_descent_tuning, "runs": []}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))

    report["matmul"] = matmul_ceiling(device, args.matmul_size)
    print(f"matmul {args.matmul_size}^3: {report['matmul']['tflops']:.0f} TFLOP/s", flush=True)
    save()
    if not args.skip_kernels:
        report["attention_kernels"] = time_attention(device, SIZES[args.size], args.attention)
        for row in report["attention_kernels"]:
            print("attention", json.dumps(row), flush=True)
        save()
    sparse = [f"relay-wan-sparse@{s}{spec[len('relay-wan-sparse'):]}" for spec in runs
              if spec.startswith("relay-wan-sparse:") for s in args.sparsity.split(",")]
    runs = [r for r in runs if not r.startswith("relay-wan-sparse:")] + sparse
    for spec in runs:
        result = run_one(spec, args.size, args, device, report["matmul"]["tflops"])
        report["runs"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("profile", "traceback")}),
              flush=True)
        save()
    print_table(report["runs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
