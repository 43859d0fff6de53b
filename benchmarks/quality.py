"""The quality benchmark: does distillation keep the teacher's quality at a few steps?

    python benchmarks/quality.py plan [--pipeline config/pipeline/bench.yaml]
    python benchmarks/quality.py run --root runs/bench [--train] [--toy] [--captions 64] \
        [--pipeline config/pipeline/bench.yaml] [--seed-shift 20]
    python benchmarks/quality.py goals runs/bench runs/bench-s20 [--stage1 NAMES] [--stage2 NAMES]

`plan` sizes the pipeline by arithmetic (no GPU, no torch): per stage the video tokens, the
forward passes and counted FLOPs of one step (benchmarks/flops.py), and the step time they
imply at a throughput and a per-pass floor, plus each stage's start-up, data generation and
validations, then the minutes of each stage and in all with the evaluation. The constants
were measured on one H200 (see TFLOPS and STAGE_START_S below); the two step constants are
options, printed with the table.

`run` evaluates the trained stages of a pipeline root (with --train it first trains them with
`relay run PIPELINE --root ROOT`) on the benchmark's fixed captions with the pixel checker of
`relay eval` (trainer.evaluation.scene_checker): the SFT teacher at 1, 2, 4, 8 and 50 Euler steps with
its CFG, Stage1 (flow map, guidance fused) and Stage2 (causal rollout) at 1, 2 and 4 steps.
For each: every attribute score, mean score, fidelity, temporal consistency, function
evaluations per clip (measured: video tokens through the first block over the clip's tokens,
so a CFG pair counts 2 and a cached causal chunk its share) and wall time per clip. Writes
ROOT/quality/results.json (with versions, machine, command) and results.md (the table for
docs/stages.md).

`goals` checks the benchmark's goals (benchmarks/quality_goals.py) on one results.json per
seed: each run's gap to its own teacher and their mean. `run` appends the same table to
results.md when it scored a student.

--seed-shift N trains on other draws: every stage's training and data seed moved by N (the
derived pipeline is written to ROOT/pipeline.yaml). --toy swaps in a CPU-sized copy of the
pipeline written there (each stage's model shrunk by its family, 8 frames of 16x16, two steps
a stage): the same code path, numbers that mean nothing, minutes on a laptop.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/quality.py`: make the repository importable
    sys.path.insert(0, str(REPO))

from benchmarks.flops import stage_step_flops_of  # noqa: E402
from benchmarks.quality_goals import check, goals_markdown, load, unknown_stages  # noqa: E402

TEACHER_STEPS = (1, 2, 4, 8, 50)
STUDENT_STEPS = (1, 2, 4)
STAGES = ("sft", "stage1", "stage2")  # the rows of the table, in order; "sft" is the teacher
ATTRIBUTES = ("colour", "shape", "direction", "speed", "count")


# ---- plan: sizing by arithmetic ------------------------------------------------------------

def stage_work(args) -> dict:
    """Per step of a stage, per sample: video tokens, counted FLOPs of one forward over the
    clip, counted FLOPs and forward passes of a step (kernel launches scale with passes, not
    tokens), Stage2's averaged over its outer steps: benchmarks.flops.stage_step_flops."""
    work = stage_step_flops_of(args)
    return {"video_tokens": work["video_tokens"], "forward_flops": work["forward_flops"],
            "flops_per_sample": work["flops_per_sample"], "passes": work["passes"]}


# Measured on one H200 (torch 2.11, FA4; the bench configs: compiled blocks, four data-loader
# workers, patch 2x4x4) in a full run of the benchmark, wall time between logged steps, and used
# as the plan's defaults: FM steps reach ~43 TFLOP/s of counted work (0.102 s a step at batch
# 64), Stage1 about the same (0.22-0.25 s at batch 32), and Stage2's many small rollout passes
# cost ~1.8 ms each per layer (0.37 s an outer step at batch 16).
TFLOPS = 43.0
PASS_FLOOR_S = 1.8e-3
# What a stage costs besides its steps, measured in the same run: start-up (process start,
# model build, compiling the blocks; Stage2 compiles three roles and the chunked attention) with
# the final checkpoint; generating a synthetic clip on the host; one validation during training.
STAGE_START_S = {"fm": 35.0, "tf_anyflow": 105.0, "dmd_sgf": 125.0}
DATA_S_PER_CLIP = 1.2e-3  # 16,384 clips in ~20 s by 8 worker processes on 16 cores
VALIDATION_S = 3.0
# The evaluation scores every stage after the first on 64 captions: per stage a load and a
# warm-up, then its rows, whose cost follows the video tokens through the model (NFE per caption
# x video tokens x 64). Fitted to two runs: the benchmark's three stages at 512 tokens, 31 s
# (H200, FA4) and bench-sparse's two fine-tunes at 1,024 tokens, 77 s (H100, flex).
EVAL_STAGE_S = 3.6
EVAL_S_PER_MTOKEN = 4.1
EVAL_CAPTIONS = 64


def evaluation_nfe(args) -> int:
    """Function evaluations per caption of a stage's rows in the evaluation: a bidirectional
    (FM) model at TEACHER_STEPS with CFG (2 a step), scored twice when trained sparse; a causal
    student at STUDENT_STEPS (n + 1 each: the commit pass per chunk)."""
    if args.stage != "fm":
        return sum(n + 1 for n in STUDENT_STEPS)
    return 2 * sum(TEACHER_STEPS) * (2 if args.video_attention_sparsity > 0 else 1)


def _validations(args) -> int:
    """Validations a run of max_steps makes (trainer.evaluation.validation.ValidationSettings.due)."""
    if args.validation_interval < 0:
        return 0
    if args.validation_interval == 0:
        return 1
    periodic = args.max_steps // args.validation_interval
    return periodic + (args.max_steps % args.validation_interval != 0)


def plan(pipeline_path: str, tflops: float = TFLOPS, pass_floor_s: float = PASS_FLOOR_S) -> dict:
    """Minutes of every stage of a pipeline: its steps at `tflops` TFLOP/s achieved, a step taking
    at least `pass_floor_s` per forward pass per layer, plus its start-up, the synthetic data it
    generates first (a data_path no earlier stage wrote), its validations, and in all the
    evaluation of every stage after the first. Torch-free."""
    from launcher.pipeline import load_pipeline_yaml
    from trainer.resolve import resolve_config

    spec = load_pipeline_yaml(pipeline_path)
    stages, total, generated, evaluation_s = [], 0.0, set(), 0.0
    for index, (name, stage) in enumerate(spec["stages"].items()):
        overrides = {k: v for k, v in (stage.get("overrides") or {}).items()}
        args = resolve_config(str(REPO / stage["config"]), overrides, check_paths=False)
        work = stage_work(args)
        batch = args.train_batch_size * args.gradient_accumulation_steps
        step_flops = work["flops_per_sample"] * batch
        layers = args.transformer_config_overrides["num_layers"]
        step_s = max(step_flops / (tflops * 1e12), work["passes"] * layers * pass_floor_s)
        clips = 0
        if args.synthetic_data and args.data_path not in generated:
            generated.add(args.data_path)
            clips = args.synthetic_num_samples
        other_s = (STAGE_START_S[args.stage] + clips * DATA_S_PER_CLIP
                   + _validations(args) * VALIDATION_S)
        minutes = (step_s * args.max_steps + other_s) / 60
        total += minutes
        if index:  # scored
            evaluation_s += EVAL_STAGE_S + EVAL_S_PER_MTOKEN * 1e-6 * (
                evaluation_nfe(args) * work["video_tokens"] * EVAL_CAPTIONS)
        stages.append({"stage": name, "objective": args.stage, "max_steps": args.max_steps,
                       "batch": batch, **work, "step_tflop": step_flops / 1e12,
                       "step_s": step_s, "validations": _validations(args),
                       "other_s": other_s, "minutes": minutes})
    return {"pipeline": pipeline_path, "tflops": tflops, "pass_floor_s": pass_floor_s,
            "stages": stages, "evaluation_s": evaluation_s,
            "total_minutes": total + evaluation_s / 60}


def plan_markdown(found: dict) -> str:
    lines = [f"Plan of {found['pipeline']}: {found['tflops']:g} TFLOP/s achieved, at least "
             f"{found['pass_floor_s'] * 1e3:g} ms per forward pass per layer.", "",
             "| stage | objective | steps | batch | video tokens | fwd GFLOP/clip | passes/step "
             "| TFLOP/step | s/step | start, data, validation (s) | minutes |",
             "|" + " --- |" * 11]
    for s in found["stages"]:
        lines.append(f"| {s['stage']} | {s['objective']} | {s['max_steps']} | {s['batch']} | "
                     f"{s['video_tokens']} | {s['forward_flops'] / 1e9:.1f} | {s['passes']:.1f} | "
                     f"{s['step_tflop']:.2f} | {s['step_s']:.3f} | {s['other_s']:.0f} | "
                     f"{s['minutes']:.1f} |")
    lines.append(f"| evaluation | | | | | | | | | {found['evaluation_s']:.0f} | "
                 f"{found['evaluation_s'] / 60:.1f} |")
    lines.append(f"| all | | | | | | | | | | {found['total_minutes']:.1f} |")
    return "\n".join(lines) + "\n"


# ---- run: train, then evaluate -----------------------------------------------------------

# What --toy sets in every stage: CPU-sized data and runs (compiling and worker processes pay
# off on a GPU, not for two CPU steps); and per stage name, what a two-step run needs besides.
TOY_RUN = {"synthetic_num_samples": 32, "synthetic_num_frames": 8, "synthetic_height": 16,
           "synthetic_width": 16, "train_batch_size": 4, "max_steps": 2, "save_interval": 2,
           "warmup_steps": 0, "log_interval": 1, "validation_interval": -1,
           "compile_transformer": False, "packed_dataloader_num_workers": 0}
TOY_STAGE = {"stage2": {"generator_update_interval": 1}}


SEED_KEYS = ("seed", "synthetic_seed")  # what --seed-shift moves: training and data draws


def derive_pipeline(root: Path, pipeline: Path, *, toy: bool = False, seed_shift: int = 0) -> Path:
    """`pipeline` rewritten into root/pipeline.yaml: its stages, configs and wiring as they are,
    with `toy` each stage's model shrunk by its family's `toy_size` (width and depth; patch,
    channels and causality kept) and its data and steps by TOY_RUN, and with `seed_shift` every
    stage's training and data seeds (SEED_KEYS) moved by that much: the same benchmark on
    other draws."""
    import yaml
    from omegaconf import OmegaConf

    from trainer.config.args import load_yaml_config
    from trainer.models.registry import get_family

    spec = OmegaConf.to_container(OmegaConf.load(pipeline), resolve=False)
    stages = {}
    for name, stage in spec["stages"].items():
        config = str(REPO / stage["config"])
        overrides = dict(stage.get("overrides") or {})
        settings = {**load_yaml_config(config), **overrides}
        if toy:
            family = get_family(settings.get("model_family", "dit"))
            shape = settings.get("transformer_config_overrides") or {}
            overrides.update(transformer_config_overrides={**shape, **family.toy_size},
                             **TOY_RUN, **TOY_STAGE.get(name, {}))
        if seed_shift:
            overrides.update({key: int(settings[key]) + seed_shift for key in SEED_KEYS
                              if settings.get(key) is not None})
        stages[name] = {**stage, "config": config, "overrides": overrides}
    derived = {**spec, "root": str(root), "stages": stages}
    what = [f"{pipeline}"] + (["at CPU size"] if toy else []) + (
        [f"seeds moved by {seed_shift}"] if seed_shift else [])
    if toy:
        derived.update(name=f"{spec.get('name', pipeline.stem)}-toy",
                       cluster={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1,
                                "cpus_per_task": 2, "mem": "4G", "time": 30, "network": "none",
                                "warmup": False})
    root.mkdir(parents=True, exist_ok=True)
    path = root / "pipeline.yaml"
    path.write_text(f"# Written by benchmarks/quality.py: {', '.join(what)}.\n"
                    + yaml.safe_dump(derived, sort_keys=False))
    return path


def train(pipeline: Path, root: Path) -> None:
    """`relay run PIPELINE --root ROOT`; raises SystemExit with its code when a stage fails."""
    code = subprocess.call([sys.executable, "-m", "launcher.cli", "run", str(pipeline),
                            "--root", str(root)], cwd=REPO)
    if code:
        raise SystemExit(f"quality: relay run failed (exit {code}); see {root}")


class ForwardCounter:
    """Counts video tokens through the model's first block: function evaluations per clip =
    counted tokens / (clips x video tokens of a clip)."""

    def __init__(self, model, video_arg: int):
        self.tokens, self.video_arg = 0, video_arg
        self.handle = model.blocks[0].register_forward_hook(self._count)

    def _count(self, module, args, output):
        # the family's video argument (ModelFamily.block_video_arg); None on text-only calls
        vid = args[self.video_arg] if len(args) > self.video_arg else None
        if vid is not None:
            self.tokens += vid.shape[0] * vid.shape[1]

    def close(self):
        self.handle.remove()


def evaluate_stage(stage_dir: Path, *, captions: int, seed: int, device: str):
    """One row per step count: scores, function evaluations and wall time per clip. A
    bidirectional model (a teacher) at TEACHER_STEPS with its CFG, a causal one (a student)
    at STUDENT_STEPS. A run trained with sparse video attention is scored twice: densely (as
    diffusers runs the exported weights) and with the sparse attention it trained with."""
    from trainer.evaluation.evaluate import evaluation_suite
    from trainer.evaluation.inference import apply_attention, load_model_for_inference
    from trainer.models.registry import family_of, model_config
    from trainer.stages.registry import sampling_plan

    loaded = load_model_for_inference(stage_dir, "auto", device=device)
    prompts, score = evaluation_suite(loaded.args.get("synthetic_generator", "shapes"))
    prompts = list(prompts[:captions])
    guidance = sampling_plan(loaded.args).guidance
    family = family_of(loaded.args)
    geometry = family.geometry(model_config(loaded.args))
    steps_list = TEACHER_STEPS if geometry.causal_chunk_frames is None else STUDENT_STEPS
    pt, ph, pw = geometry.patch_size
    _, t, h, w = loaded.latent_shape
    clip_tokens = (t // pt) * (h // ph) * (w // pw)
    rows = []
    for attention in ("dense", "trained"):
        loaded.attention = apply_attention(loaded.model, loaded.args, attention)
        if attention == "trained" and loaded.attention == "dense":
            break  # trained dense: the dense rows are its rows
        rows += _score_step_counts(loaded, family, prompts, score, steps_list, guidance,
                                   seed=seed, device=device, clip_tokens=clip_tokens,
                                   stage=stage_dir.name)
    return rows


def _score_step_counts(loaded, family, prompts, score, steps_list, guidance, *, seed: int,
                       device: str, clip_tokens: int, stage: str) -> list[dict]:
    """The rows of one loaded model, one per step count."""
    import torch

    from trainer.encoders.vae import latents_to_frames
    from trainer.evaluation.evaluate import summary_scores
    from trainer.evaluation.inference import generate

    # First touch of memory and kernels is slow (docs/performance.md): not part of a clip.
    generate(loaded, prompts[:1], steps=1, guidance=guidance, seed=seed)
    rows = []
    for steps in steps_list:
        counter = ForwardCounter(loaded.model, family.block_video_arg)
        _synchronize(torch, device)
        started = time.perf_counter()
        latents = generate(loaded, prompts, steps=steps, guidance=guidance, seed=seed)
        _synchronize(torch, device)
        seconds = time.perf_counter() - started
        counter.close()
        report = score([latents_to_frames(x) for x in latents], prompts)
        rows.append({"stage": stage, "checkpoint": str(loaded.checkpoint),
                     "weights": loaded.weights, "attention": loaded.attention, "steps": steps,
                     "guidance": guidance,
                     "nfe": counter.tokens / (len(prompts) * clip_tokens),
                     "seconds_per_clip": seconds / len(prompts), **summary_scores(report)})
    return rows


def _synchronize(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def results_markdown(rows: list[dict]) -> str:
    """The results table: one row per stage and step count, and each one's gap to the
    teacher at its most steps."""
    reference = max((r for r in rows if r["stage"] == "sft" and r["attention"] == "dense"),
                    key=lambda r: r["steps"], default=None)
    head = ["stage", "steps", "CFG", *ATTRIBUTES, "mean", "fidelity", "temporal", "NFE/clip",
            "ms/clip", "mean vs teacher@max"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        gap = (r["mean_score"] - reference["mean_score"]) * 100 if reference else float("nan")
        label = r["stage"] if r["attention"] == "dense" else f"{r['stage']} ({r['attention']})"
        cells = [label, str(r["steps"]), f"{r['guidance']:g}",
                 *(f"{r[f'{a}_accuracy']:.0%}" for a in ATTRIBUTES), f"{r['mean_score']:.1%}",
                 f"{r['fidelity']:.3f}", f"{r['temporal_consistency']:.3f}", f"{r['nfe']:.1f}",
                 f"{r['seconds_per_clip'] * 1e3:.1f}", f"{gap:+.1f} pt"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def versions(device: str) -> dict:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "machine": platform.node(), "device": device}
    if device.startswith("cuda"):
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def run(ns: argparse.Namespace) -> dict:
    root = Path(ns.root).resolve()
    pipeline = Path(ns.pipeline)
    if ns.toy or ns.seed_shift:
        pipeline = derive_pipeline(root, pipeline, toy=ns.toy, seed_shift=ns.seed_shift)
    if ns.train:
        train(pipeline, root)
    import torch

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    missing = [stage for stage in ns.stages if not (root / stage).is_dir()]
    if missing:
        raise SystemExit(f"quality: no stage directory {', '.join(str(root / s) for s in missing)}"
                         f" (--stages names directories of --root {root}; train them first, or "
                         f"leave them out of --stages)")
    _check_checkpoints(root, ns.stages)
    out = Path(ns.out) if ns.out else root / "quality"
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              # what trained the root; scoring alone reads only the stage directories
              "pipeline": str(pipeline) if ns.train else None, "root": str(root),
              "captions": ns.captions, "seed": ns.seed, "seed_shift": ns.seed_shift,
              "versions": versions(device), "rows": [], "not_yet_scored": list(ns.stages)}
    # Written after every stage: an evaluation cut short (a time limit, a lost machine) keeps
    # the stages it scored, and not_yet_scored says which are missing.
    table = ""
    for stage in ns.stages:
        result["rows"] += evaluate_stage(root / stage, captions=ns.captions, seed=ns.seed,
                                         device=device)
        result["not_yet_scored"].remove(stage)
        table = _write_results(out, result, root)
    print(table)
    return result


def _check_checkpoints(root: Path, stages: list[str]) -> None:
    """Every stage to score holds a complete checkpoint, checked before any is scored."""
    from trainer.evaluation.inference import InferenceError, resolve_checkpoint_dir

    for stage in stages:
        try:
            resolve_checkpoint_dir(root / stage)
        except InferenceError as error:
            raise SystemExit(f"quality: {error}") from None


def _write_results(out: Path, result: dict, root: Path) -> str:
    """results.json and results.md (the table, and the goals once a student is scored)."""
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = result["rows"]
    table = results_markdown(rows)
    if any(r["stage"] in ("stage1", "stage2") for r in rows):  # the goals need a student
        table += "\n" + goals_markdown(check([(str(root), result)],
                                              {"stage1": ["stage1"], "stage2": ["stage2"]}))
    pending = (f"\nNot yet scored: {', '.join(result['not_yet_scored'])}.\n"
               if result["not_yet_scored"] else "")
    (out / "results.md").write_text(f"`{result['command']}` on {result['versions']}\n\n"
                                    f"{table}{pending}")
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="size the pipeline by arithmetic (no GPU)")
    p.add_argument("--pipeline", default="config/pipeline/bench.yaml")
    p.add_argument("--tflops", type=float, default=TFLOPS,
                   help="TFLOP/s a step achieves (the bench model on an H200: ~50; "
                        "Wan-1.3B reaches ~400)")
    p.add_argument("--pass-floor-ms", type=float, default=PASS_FLOOR_S * 1e3,
                   help="least time of one forward pass of one layer (launch-bound small models)")
    p = sub.add_parser("run", help="evaluate (and with --train first train) a pipeline root")
    p.add_argument("--root", required=True, help="the pipeline root holding sft/, stage1/, stage2/")
    p.add_argument("--pipeline", default="config/pipeline/bench.yaml",
                   help="the pipeline --train trains (recorded in results.json when it does)")
    p.add_argument("--train", action="store_true", help="train the pipeline into ROOT first")
    p.add_argument("--toy", action="store_true", help="a CPU-sized pipeline (smoke test)")
    p.add_argument("--captions", type=int, default=64, help="evaluation captions (at most 64)")
    p.add_argument("--stages", type=lambda text: text.split(","), default=list(STAGES),
                   help="comma-separated stage directories of ROOT to evaluate (default "
                        "sft,stage1,stage2): the teacher can be scored before the students are "
                        "trained; a bidirectional model is sampled at 1, 2, 4, 8 and 50 steps "
                        "with its CFG, a causal student at 1, 2 and 4")
    p.add_argument("--seed", type=int, default=0, help="the evaluation's seed")
    p.add_argument("--seed-shift", type=int, default=0,
                   help="move every stage's training and data seed by this much (with "
                        "--train: the benchmark on other draws; ROOT/pipeline.yaml says which)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="default: ROOT/quality")
    p = sub.add_parser("goals", help="check the benchmark's goals on results of `run` "
                                     "(per run and the mean over runs)")
    p.add_argument("results", nargs="+",
                   help="results.json files of `run` (or the roots they scored), one per seed")
    p.add_argument("--stage1", type=lambda text: text.split(","), default=["stage1"],
                   help="the stage directories scored as Stage1 (comma-separated; default stage1)")
    p.add_argument("--stage2", type=lambda text: text.split(","), default=["stage2"],
                   help="the stage directories scored as Stage2 (comma-separated; default stage2)")
    ns = parser.parse_args(argv)
    if getattr(ns, "seed_shift", 0) < 0:
        parser.error(f"--seed-shift must be >= 0 (it is added to every stage's seed, and seeds "
                     f"are not negative), got {ns.seed_shift}; pick e.g. 20")
    if ns.command == "plan":
        print(plan_markdown(plan(ns.pipeline, ns.tflops, ns.pass_floor_ms / 1e3)), end="")
    elif ns.command == "goals":
        results = load(ns.results)
        # The defaults name the standard layout (absent: `not scored`); a name given is expected.
        given = [n for n in ns.stage1 + ns.stage2 if n not in ("stage1", "stage2")]
        if missing := unknown_stages(results, given):
            scored = sorted({r["stage"] for _, result in results for r in result["rows"]})
            parser.error(f"no results file scored {', '.join(missing)}; the files hold "
                         f"{', '.join(scored)} (--stage1 / --stage2 take those names)")
        print(goals_markdown(check(results, {"stage1": ns.stage1, "stage2": ns.stage2})), end="")
    else:
        run(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
