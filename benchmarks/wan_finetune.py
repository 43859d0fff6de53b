"""A fine-tune of a Wan2.1-1.3B-sized `wan` model through train.py on one GPU, at the real clip
shape, with checkpoints, a resume and a validation clip decoded by a Wan VAE.

    python benchmarks/wan_finetune.py --root /tmp/wan-ft --json wan-finetune.json
                                      [--steps 100 --resume-steps 50] [--size 1.3b|tiny]

What it does, as a user's run would (SFT; with --stage1-steps and --stage2-steps also the
distillation stages after it, from SFT's and Stage1's outputs as config/pipeline/wan-distill-1.3b.yaml
wires them):
1. writes `--samples` clips of random latents at the size's shape ([16, 21, 60, 104] at 1.3b:
   81 frames of 832x480 through Wan's 4x8x8 VAE) with random caption embeddings of 20-120
   tokens x 4096, in relay's shard layout (docs/data.md); a randomly initialised
   AutoencoderKLWan (Wan2.1's VAE config, `save_pretrained`) for the validation decode;
2. runs `trainer/train.py --config config/wan/t2v-1.3b-sft.yaml` from random weights (no
   download: the wan family's defaults are Wan2.1-T2V-1.3B's architecture) for `--steps` steps,
   saving every `--save-interval` and validating (sample, decode to mp4) at the end;
3. runs the same command again with `--steps + --resume-steps`: it must resume from the newest
   checkpoint and go on.
The report: per-phase wall time, median step time after warm-up, peak memory, the steps each
phase logged and saved, the validation clips written. The synthetic data are noise, so the loss
says nothing about quality; the run shows the path works at size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # latent [C, T, H, W], caption width, model overrides (None: the family's 1.3B defaults)
    "1.3b": dict(latent=(16, 21, 60, 104), text_dim=4096, overrides=None),
    "tiny": dict(latent=(16, 3, 8, 8), text_dim=32,
                 overrides={"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64,
                            "num_layers": 2, "text_dim": 32, "freq_dim": 32}),
}


def write_data(out: Path, samples: int, latent: tuple, text_dim: int, seed: int = 0) -> Path:
    """Random latents and caption embeddings in relay's shard layout (bf16 latents)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(samples):
        z = torch.randn(latent, generator=g).to(torch.bfloat16)
        length = int(torch.randint(20, 121, (1,), generator=g))
        text = torch.randn(length, text_dim, generator=g).numpy().astype(np.float32)
        rows.append({"id": f"noise-{i:05d}", "caption": f"random clip {i}",
                     "vae_latent_bytes": z.view(torch.int16).numpy().tobytes(),
                     "vae_latent_shape": list(latent), "vae_latent_dtype": "bfloat16",
                     "text_embedding_bytes": text.tobytes(), "text_embedding_shape": [length, text_dim],
                     "text_embedding_dtype": "float32", "media_type": "video"})
    pq.write_table(pa.Table.from_pylist(rows), out / "part-00000.parquet", row_group_size=4)
    return out


def write_vae(out: Path, tiny: bool) -> Path:
    """A random AutoencoderKLWan: Wan2.1's config (z_dim 16), or a narrow one for `tiny`."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8) if tiny else AutoencoderKLWan()
    vae.save_pretrained(out)
    return out


STAGE_CONFIGS = {"sft": "config/wan/t2v-1.3b-sft.yaml", "stage1": "config/wan/t2v-1.3b-stage1.yaml",
                 "stage2": "config/wan/t2v-1.3b-stage2.yaml"}


def stage_argv(args, root: Path, stage: str, max_steps: int) -> list[str]:
    """train.py's command line for one stage of the chain: SFT from random weights, Stage1 from
    SFT's EMA, Stage2's student from Stage1's EMA and its teacher and critic from SFT's."""
    size = SIZES[args.size]
    c, t, h, w = size["latent"]
    argv = [sys.executable, "trainer/train.py", "--config", STAGE_CONFIGS[stage],
            "--data_path", str(root / "data"), "--output_dir", str(root / stage),
            "--vae_path", str(root / "vae"), "--text_encoder", "standin",
            "--text_max_tokens", "512", "--expected_latent_shape", json.dumps([c, t, h, w]),
            "--global_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--max_steps", str(max_steps), "--save_interval", str(args.save_interval),
            "--save_total_limit", "2", "--log_interval", "1",
            "--validation_interval", str(max_steps), "--validation_num_captions", "1",
            "--validation_steps", str(args.validation_steps), "--validation_weights", "ema",
            "--report_to", "none"]
    if stage == "sft":
        argv += ["--pretrained_transformer_path", "null", "--load_transformer_weights", "false",
                 "--warmup_steps", "10"]
    elif stage == "stage1":
        argv += ["--pretrained_transformer_path", str(root / "sft")]
    else:
        argv += ["--student_init_path", str(root / "stage1"), "--teacher_init_path",
                 str(root / "sft"), "--critic_init_path", str(root / "sft")]
    if size["overrides"] is not None:  # the stage configs repeat the 1.3B architecture
        causal = {"stage1": {"causal_chunk_size": 1, "two_time": True, "time_gate": 0.25},
                  "stage2": {"causal_chunk_size": 1}}.get(stage, {})
        argv += ["--transformer_config_overrides", json.dumps({**size["overrides"], **causal}),
                 "--dtype", "float32", "--compile_transformer", "false",
                 "--enable_gradient_checkpointing", "false"]
    return argv


def train(argv: list[str], log: Path) -> dict:
    start = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.run(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return {"argv": argv[1:], "returncode": proc.returncode, "wall_s": time.perf_counter() - start,
            "log_tail": log.read_text()[-3000:]}


def _loss(record: dict) -> float | None:
    # Stage2 logs the critic's loss every step and the student's on its updates
    return record.get("loss", record.get("critic_loss"))


def summarise(run: Path, first_step: int, last_step: int, warmup: int) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    steps = [r for r in records if "step_time_s" in r and first_step <= r.get("step", 0) <= last_step]
    times = [r["step_time_s"] for r in steps[warmup:] if "step_time_s" in r]
    peaks = [r["peak_device_mem_gb"] for r in steps if r.get("peak_device_mem_gb") is not None]
    return {"logged_steps": [steps[0]["step"], steps[-1]["step"]] if steps else None,
            "first_loss": _loss(steps[0]) if steps else None,
            "last_loss": _loss(steps[-1]) if steps else None,
            "median_step_s": statistics.median(times) if times else None,
            "peak_device_mem_gib": max(peaks) if peaks else None,
            "checkpoints": sorted(p.name for p in run.glob("checkpoint-*")),
            "validation_files": sorted(str(p.relative_to(run)) for p in run.rglob("*.mp4"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--resume-steps", type=int, default=50)
    parser.add_argument("--stage1-steps", type=int, default=0,
                        help="then Stage1 (TF-AnyFlow) from SFT's EMA for this many steps (0: none)")
    parser.add_argument("--stage2-steps", type=int, default=0,
                        help="then Stage2 (DMD via SGF) for this many outer steps (0: none)")
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--validation-steps", type=int, default=8)
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    report: dict = {"command": " ".join(["python", "benchmarks/wan_finetune.py",
                                         *(argv or sys.argv[1:])]), "size": args.size}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))

    start = time.perf_counter()
    write_data(args.root / "data", args.samples, size["latent"], size["text_dim"])
    write_vae(args.root / "vae", tiny=args.size == "tiny")
    report["setup_s"] = time.perf_counter() - start
    save()
    sft_total = args.steps + args.resume_steps
    phases = [("sft", "sft", args.steps, 1), ("sft-resumed", "sft", sft_total, args.steps + 1)]
    if args.stage1_steps:
        phases.append(("stage1", "stage1", args.stage1_steps, 1))
    if args.stage1_steps and args.stage2_steps:
        phases.append(("stage2", "stage2", args.stage2_steps, 1))
    for phase, stage, max_steps, first in phases:
        log = args.root / f"{phase}.log"
        report[phase] = train(stage_argv(args, args.root, stage, max_steps), log)
        if report[phase]["returncode"] == 0:
            report[phase].update(summarise(args.root / stage, first, max_steps, warmup=5))
            report[phase]["resumed_from"] = next(
                (line.split("resumed from ", 1)[1] for line in log.read_text().splitlines()
                 if "resumed from " in line), None)
        save()
        print(json.dumps({k: v for k, v in report[phase].items() if k not in ("argv", "log_tail")}),
              flush=True)
        if report[phase]["returncode"] != 0:
            print(report[phase]["log_tail"], file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
