"""A Wan2.1-1.3B-sized `wan` model through train.py on one GPU, at the real clip shape, from a
random diffusers directory: SFT, then optionally Stage1 and Stage2, each stage checkpointed,
resumed and validated (its clip decoded by a Wan VAE).

    python benchmarks/wan_finetune.py --root /tmp/wan-ft --json wan-finetune.json
        [--steps 100 --resume-steps 50] [--stage1-steps 40 --stage1-resume-steps 20]
        [--stage2-steps 20 --stage2-resume-steps 10] [--size 1.3b|tiny] [--prune]

What it does, as a user's run would:
1. writes the source: a randomly initialised WanTransformer3DModel of the size's architecture
   (Wan2.1-T2V-1.3B's at 1.3b), saved with `save_pretrained` in bfloat16 and 2 GB shards with
   their index, as `transformer/` of a diffusers directory; `--samples` clips of random latents
   at the size's shape ([16, 21, 60, 104] at 1.3b: 81 frames of 832x480 through Wan's 4x8x8
   VAE) with random caption embeddings of 20-120 tokens x 4096 in relay's shard layout
   (docs/data.md); a random AutoencoderKLWan (Wan2.1's VAE config) for the validation decode;
2. SFT: `trainer/train.py --config config/wan/t2v-1.3b-sft.yaml` loading the source (streamed
   into FSDP2 shards) for `--steps` steps, validating at the end; then the same command with
   `--steps + --resume-steps`, which must resume from the newest checkpoint and go on;
3. with `--stage1-steps`: Stage1 (TF-AnyFlow) from SFT's EMA (with `--steps 0` from the source
   directory), the same two runs;
4. with `--stage2-steps` too: Stage2 (DMD via SGF), the student from Stage1's EMA (with
   `--stage2-student source`, and then no Stage1 needed, from the source directory), the frozen
   teacher and the critic from the source directory, the same two runs.
`--prune` deletes a stage's checkpoints once no later run reads them (SFT's after Stage1's first
run, Stage1's after Stage2's first run): at 1.3B a checkpoint with its optimizer state holds
about 21 GB (SFT, Stage1) or 42 GB (Stage2: student, EMA, critic, teacher, two optimizers).
The report: per run its wall time, median step time after warm-up (Stage2's critic-only and
student steps apart), the counted TFLOP of a step (benchmarks/flops.py: stage_step_flops; Stage2's
critic-only and student steps apart) and the TFLOP/s the median step time achieves, peak memory,
first and last loss, checkpoints, validation clips and what it resumed from. The synthetic data are noise, so the loss says nothing about quality; the run
shows the path works at size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/wan_finetune.py`: make the repository importable
    sys.path.insert(0, str(ROOT))

from trainer.models.wan.config import WAN_DEFAULTS, RELAY_KEYS  # noqa: E402

TINY_ARCHITECTURE = {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64,
                     "num_layers": 2, "text_dim": 32, "freq_dim": 32}
SIZES = {
    # latent [C, T, H, W], caption width, architecture changes from Wan2.1-T2V-1.3B's
    "1.3b": dict(latent=(16, 21, 60, 104), text_dim=4096, architecture={}),
    "tiny": dict(latent=(16, 3, 8, 8), text_dim=32, architecture=TINY_ARCHITECTURE),
}
STAGE_CONFIGS = {"sft": "config/wan/t2v-1.3b-sft.yaml", "stage1": "config/wan/t2v-1.3b-stage1.yaml",
                 "stage2": "config/wan/t2v-1.3b-stage2.yaml"}
# What each stage's config adds to the architecture (the 1.3B configs repeat it; tiny overrides it)
STAGE_FORMS = {"sft": {}, "stage1": {"causal_chunk_size": 1, "two_time": True, "time_gate": 0.25},
               "stage2": {"causal_chunk_size": 1}}


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


def source_architecture(size: dict) -> dict:
    """diffusers' WanTransformer3DModel arguments of the size (relay's own keys left out)."""
    return {k: v for k, v in {**WAN_DEFAULTS, **size["architecture"]}.items()
            if k not in RELAY_KEYS}


def write_source(out: Path, size: dict) -> Path:
    """A random WanTransformer3DModel as `transformer/` of a diffusers directory, in bfloat16
    and 2 GB shards with their index (a 1.3B model makes two), as a Wan release stores it."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**source_architecture(size)).to(torch.bfloat16)
    model.save_pretrained(out / "transformer", max_shard_size="2GB")
    return out / "transformer"


def stage_argv(args, root: Path, stage: str, max_steps: int) -> list[str]:
    """train.py's command line for one run of a stage: SFT from the source directory, Stage1
    from SFT's EMA, Stage2's student from Stage1's EMA and its teacher and critic from the
    source directory."""
    size = SIZES[args.size]
    source = str(root / "source" / "transformer")
    argv = [sys.executable, "trainer/train.py", "--config", STAGE_CONFIGS[stage],
            "--data_path", str(root / "data"), "--output_dir", str(root / stage),
            "--vae_path", str(root / "vae"), "--text_encoder", "standin",
            "--text_max_tokens", "512", "--expected_latent_shape", json.dumps(list(size["latent"])),
            "--global_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--max_steps", str(max_steps), "--save_interval", str(args.save_interval),
            "--save_total_limit", "1", "--log_interval", "1",
            "--validation_interval", str(max_steps), "--validation_num_captions", "1",
            "--validation_steps", str(args.validation_steps), "--validation_weights", "ema",
            "--report_to", "none"]
    if stage == "sft":
        argv += ["--pretrained_transformer_path", source, "--warmup_steps", "10"]
    elif stage == "stage1":
        start = root / "sft" if args.steps else source  # SFT is optional, as in the pipeline
        argv += ["--pretrained_transformer_path", str(start), "--warmup_steps", "10"]
    else:
        student = root / "stage1" if args.stage2_student == "stage1" else source
        argv += ["--student_init_path", str(student), "--teacher_init_path", source,
                 "--critic_init_path", source]
    if size["architecture"]:  # the stage configs repeat the 1.3B architecture
        overrides = {**size["architecture"], **STAGE_FORMS[stage]}
        argv += ["--transformer_config_overrides", json.dumps(overrides),
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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(run: Path, first_step: int, last_step: int, warmup: int) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    steps = [r for r in records if "step_time_s" in r and first_step <= r.get("step", 0) <= last_step]
    timed = steps[warmup:]
    peaks = [r["peak_device_mem_gb"] for r in steps if r.get("peak_device_mem_gb") is not None]
    summary = {"logged_steps": [steps[0]["step"], steps[-1]["step"]] if steps else None,
               "first_loss": _loss(steps[0]) if steps else None,
               "last_loss": _loss(steps[-1]) if steps else None,
               "median_step_s": _median([r["step_time_s"] for r in timed]),
               "peak_device_mem_gib": max(peaks) if peaks else None,
               "checkpoints": sorted(p.name for p in run.glob("checkpoint-*")),
               "validation_files": sorted(str(p.relative_to(run)) for p in run.rglob("*.mp4"))}
    if any("student_updates" in r for r in timed):
        # Stage2: a student update rolls out with grad and scores with teacher and critic on top
        # of the critic's update, so its steps are timed apart from the critic-only ones. The
        # run's first student update compiles the student's graphs: never a warm figure.
        updates = {r["step"]: r["student_updates"] for r in records if "student_updates" in r}
        student_steps = [r["step"] for r in steps
                         if updates[r["step"]] > updates.get(r["step"] - 1, 0)]
        warm_students = set(student_steps[1:])
        summary["median_student_step_s"] = _median(
            [r["step_time_s"] for r in timed if r["step"] in warm_students])
        summary["median_critic_step_s"] = _median(
            [r["step_time_s"] for r in timed if r["step"] not in student_steps])
    return summary


def counted_work(argv: list[str], summary: dict) -> dict:
    """The counted TFLOP of a step of the run train.py's `argv` makes (its samples on this one
    GPU) and the TFLOP/s its median step time achieves; Stage2's critic-only and student
    steps apart."""
    from benchmarks.flops import stage_step_flops_of
    from trainer.resolve import resolve_config

    argv = list(argv[1:])  # past trainer/train.py (the report's argv)
    at = argv.index("--config")
    config, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    args = resolve_config(str(ROOT / config), rest, check_paths=False)
    work = stage_step_flops_of(args)
    samples = args.train_batch_size * args.gradient_accumulation_steps
    out = {}
    names = ({"critic": "median_critic_step_s", "student": "median_student_step_s"}
             if args.stage == "dmd_sgf" else {"step": "median_step_s"})
    for step, timed in names.items():
        prefix = "" if step == "step" else f"{step}_"
        tflop = work["steps"][step]["flops"] * samples / 1e12
        out[f"{prefix}step_tflop"] = tflop
        seconds = summary.get(timed)
        out[f"{prefix}achieved_tflops"] = tflop / seconds if seconds else None
    return out


def prune(run: Path) -> None:
    """Delete a finished stage's checkpoints (its metrics, logs and clips stay)."""
    for checkpoint in run.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)


def plan(args) -> list[tuple[str, str, int, int, str | None]]:
    """The runs in order: (name, stage, max_steps, first new step, stage to prune after it)."""
    runs = []
    stages = [("sft", args.steps, args.resume_steps)] if args.steps else []
    if args.stage1_steps:
        stages.append(("stage1", args.stage1_steps, args.stage1_resume_steps))
    if args.stage2_steps and (args.stage1_steps or args.stage2_student == "source"):
        stages.append(("stage2", args.stage2_steps, args.stage2_resume_steps))
    for index, (stage, steps, resume_steps) in enumerate(stages):
        # the stage before this one is read only by this stage's first run
        previous = stages[index - 1][0] if index and args.prune else None
        runs.append((stage, stage, steps, 1, previous))
        if resume_steps:
            runs.append((f"{stage}-resumed", stage, steps + resume_steps, steps + 1, None))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100,
                        help="SFT's first run (0: no SFT; Stage1 starts from the source)")
    parser.add_argument("--resume-steps", type=int, default=50, help="SFT's resumed run")
    parser.add_argument("--stage1-steps", type=int, default=0,
                        help="then Stage1 (TF-AnyFlow) from SFT's EMA for this many steps (0: none)")
    parser.add_argument("--stage1-resume-steps", type=int, default=0)
    parser.add_argument("--stage2-steps", type=int, default=0,
                        help="then Stage2 (DMD via SGF) for this many outer steps (0: none)")
    parser.add_argument("--stage2-resume-steps", type=int, default=0)
    parser.add_argument("--stage2-student", choices=("stage1", "source"), default="stage1",
                        help="Stage2's student: Stage1's EMA (the chain), or the source directory "
                             "to run Stage2 without Stage1 (to time it alone)")
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--validation-steps", type=int, default=8)
    parser.add_argument("--prune", action="store_true",
                        help="delete a stage's checkpoints once no later run reads them")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    report: dict = {"command": " ".join(["python", "benchmarks/wan_finetune.py",
                                         *(argv or sys.argv[1:])]), "size": args.size}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))

    start = time.perf_counter()
    write_source(args.root / "source", size)
    write_data(args.root / "data", args.samples, size["latent"], size["text_dim"])
    write_vae(args.root / "vae", tiny=args.size == "tiny")
    report["setup_s"] = time.perf_counter() - start
    save()
    for name, stage, max_steps, first, finished in plan(args):
        log = args.root / f"{name}.log"
        report[name] = train(stage_argv(args, args.root, stage, max_steps), log)
        if report[name]["returncode"] == 0:
            report[name].update(summarise(args.root / stage, first, max_steps, warmup=5))
            report[name].update(counted_work(report[name]["argv"], report[name]))
            report[name]["resumed_from"] = next(
                (line.split("resumed from ", 1)[1] for line in log.read_text().splitlines()
                 if "resumed from " in line), None)
            if finished:
                prune(args.root / finished)
        save()
        print(json.dumps({k: v for k, v in report[name].items() if k not in ("argv", "log_tail")}),
              flush=True)
        if report[name]["returncode"] != 0:
            print(report[name]["log_tail"], file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
