"""`relay`: the command line of the project.

Each subcommand is a small function here that hands off to the module doing the work; the
argument parsing of train.py itself lives in trainer/config/args.py and trainer/resolve.py and is reused, never copied.
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_resolve(ns: argparse.Namespace) -> int:
    from trainer.resolve import resolve_config
    from trainer.config.schema import ConfigError

    try:
        args = resolve_config(ns.config, ns.overrides)
    except ConfigError as exc:
        print(f"relay: config error: {exc}", file=sys.stderr)
        return 2
    print(args.to_json())
    return 0


def cmd_sample(ns: argparse.Namespace) -> int:
    from trainer.evaluation.inference import InferenceError, sample_to_dir

    try:
        paths = sample_to_dir(ns.checkpoint, ns.prompt, out_dir=ns.out, steps=ns.steps,
                              guidance=ns.guidance, seed=ns.seed, weights=ns.weights,
                              first_frame=ns.first_frame, attention=ns.attention)
    except InferenceError as exc:
        print(f"relay sample: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from trainer.evaluation.inference import InferenceError, evaluate_checkpoint

    try:
        report = evaluate_checkpoint(ns.checkpoint, steps=ns.steps, guidance=ns.guidance,
                                     seed=ns.seed, weights=ns.weights, out=ns.out,
                                     attention=ns.attention)
    except InferenceError as exc:
        print(f"relay eval: {exc}", file=sys.stderr)
        return 2
    scores = ", ".join(f"{k.replace('_', ' ')} {v:.1%}" for k, v in report.items()
                       if k.endswith("_accuracy") and k != "both_accuracy")
    extra = "".join(f", {k} {report[k]:.3f}" for k in ("fidelity", "temporal_consistency")
                    if k in report)
    print(f"{scores}{extra} over {len(report['per_caption'])} clips, {report['attention']} "
          f"attention -> {report['path']}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from trainer.checkpoint.store import CheckpointError
    from trainer.evaluation.export import ExportError, export_checkpoint
    from trainer.evaluation.inference import InferenceError

    try:
        lines = export_checkpoint(ns.path, ns.out, format=ns.format, weights=ns.weights,
                                  overwrite=ns.force, components=ns.components,
                                  merge_lora=ns.merge_lora or None,
                                  max_shard_size=ns.max_shard_size,
                                  other_expert=ns.other_expert)
    except (CheckpointError, InferenceError, ExportError) as exc:
        print(f"relay export: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


# ---------------------------------------------------------------------------------------------
# Pipelines: submit | run | render | status | cancel
# ---------------------------------------------------------------------------------------------

def _load_pipeline(ns: argparse.Namespace, verb: str, *, check_paths: bool = True):
    """The validated pipeline, or None after printing why (nothing was launched)."""
    from launcher.pipeline import PipelineError, validate_pipeline

    try:
        return validate_pipeline(ns.pipeline, root=ns.root, from_stage=ns.from_stage,
                                 only=ns.only, check_paths=check_paths)
    except PipelineError as exc:
        done = {"submit": "submitted", "run": "run", "render": "rendered"}[verb]
        print(f"relay {verb}: {ns.pipeline}: nothing was {done}, because:\n{exc}", file=sys.stderr)
        return None


def _print_plan(pipeline) -> None:
    print(f"pipeline {pipeline.name} ({pipeline.path}) -> {pipeline.root}")
    warmup = pipeline.warmup
    if warmup is not None:
        r = warmup.resources
        device = "1 GPU" if r.gpus_per_node else "1 CPU task"
        print(f"  warmup: 1 node x {device}, time {r.time_min} min: kernel-cache warm-up of "
              f"{', '.join(warmup.stages)} -> {warmup.directory}")
    for stage in pipeline.stages:
        r = stage.resources
        waits = list(stage.depends_on) or (["warmup"] if warmup is not None else [])
        after = f", after {', '.join(waits)}" if waits else ""
        gpus = f" x {r.gpus_per_node} GPUs" if r.gpus_per_node else f" x {r.tasks_per_node} CPU ranks"
        print(f"  {stage.name}: {r.nodes} node(s){gpus} = world {r.world_size}, "
              f"{stage.args.max_steps} {stage.work}, time {r.time_min} min{after} -> "
              f"{stage.output_dir}")
        for line in stage.plan.splitlines():
            print(f"    {line}")
    for note in pipeline.notes:
        print(f"  note: {note}")


def _dependency_placeholder(pipeline, stage) -> str | None:
    if stage.depends_on:
        return f"{stage.depends_on[0]}_JOB_ID"
    return "warmup_JOB_ID" if pipeline.warmup is not None else None


def _print_scripts(pipeline, separator: str = "") -> None:
    """The sbatch script of the warm-up (when on) and of every stage, as submit would render."""
    from launcher.slurm import SBATCH_FILE, render_sbatch, render_warmup_sbatch

    if pipeline.warmup is not None:
        print(f"{separator}# ===== warmup: {pipeline.warmup.directory}/{SBATCH_FILE}")
        print(render_warmup_sbatch(pipeline.warmup))
    for stage in pipeline.stages:
        print(f"{separator}# ===== stage {stage.name}: {stage.output_dir}/{SBATCH_FILE}")
        print(render_sbatch(stage, dependency=_dependency_placeholder(pipeline, stage)))


def _secrets_refused(pipeline, verb: str) -> bool:
    """Print why and return True when a job script would hold a credential's value, or
    cannot be rendered (no slurm/env.sh)."""
    from launcher.slurm import SlurmError, refuse_pipeline_secrets

    try:
        refuse_pipeline_secrets(pipeline)
    except SlurmError as exc:  # a credential's value (SecretValueError), or no slurm/env.sh
        done = {"submit": "submitted", "render": "rendered"}[verb]
        print(f"relay {verb}: nothing was {done}, because: {exc}", file=sys.stderr)
        return True
    return False


def cmd_render(ns: argparse.Namespace) -> int:
    pipeline = _load_pipeline(ns, "render", check_paths=ns.check_paths)
    if pipeline is None or _secrets_refused(pipeline, "render"):
        return 2
    _print_scripts(pipeline)
    return 0


def cmd_submit(ns: argparse.Namespace) -> int:
    from launcher import slurm
    from launcher.pipeline import WARMUP_NAME
    from launcher.record import build_record, now_iso, read_record_if_any, write_record
    from launcher.status import active_jobs, collect_status

    pipeline = _load_pipeline(ns, "submit")
    if pipeline is None or _secrets_refused(pipeline, "submit"):
        return 2
    _print_plan(pipeline)
    if ns.dry_run:
        _print_scripts(pipeline, separator="\n")
        print("\nrelay submit: --dry-run, nothing was submitted.")
        return 0
    try:
        slurm.require_slurm()
    except slurm.SlurmError as exc:
        print(f"relay submit: {exc}", file=sys.stderr)
        return 2
    previous = read_record_if_any(pipeline.root)
    if previous is not None:
        names = {s.name for s in pipeline.stages} | {WARMUP_NAME}
        busy = [r for r in active_jobs(collect_status(pipeline.root)) if r.name in names]
        if busy:
            print("relay submit: nothing was submitted: "
                  + "; ".join(f"{'' if r.name == WARMUP_NAME else 'stage '}{r.name} still has "
                              f"job {r.job_id} {r.state}" for r in busy)
                  + f". Wait for it, or `relay cancel {pipeline.root}` first.", file=sys.stderr)
            return 2
    launched: dict[str, dict] = {}
    warmup: dict = {}

    def record(submitted) -> None:
        info = {"job_id": submitted.job_id, "sbatch": submitted.sbatch, "launched_at": now_iso()}
        if submitted.warmup:
            warmup.update(info)
        else:
            launched[submitted.name] = info
        write_record(pipeline.root, build_record(pipeline, launched, mode="slurm",
                                                 previous=previous, warmup=warmup or None))
        after = list(submitted.depends_on)
        if not after and not submitted.warmup and warmup:
            after = [WARMUP_NAME]
        print(f"  submitted {submitted.name}: job {submitted.job_id}"
              + (f" (afterok {', '.join(after)})" if after else ""))

    try:
        slurm.submit_pipeline(pipeline, on_submit=record)
    except slurm.SlurmError as exc:
        # pipeline.json keeps the jobs that were submitted (now cancelled): status shows them.
        before = ([WARMUP_NAME] if warmup else []) + list(launched)
        cancelled = f" Cancelled the jobs submitted before it: {', '.join(before)}." if before else ""
        print(f"relay submit: {exc}.{cancelled}", file=sys.stderr)
        return 1
    print(f"watch it: relay status {pipeline.root}")
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    from launcher.local import run_pipeline_locally

    pipeline = _load_pipeline(ns, "run")
    if pipeline is None:
        return 2
    _print_plan(pipeline)
    code = run_pipeline_locally(pipeline)
    _write_plot(pipeline.root, "relay run")
    return code


def _write_plot(root: str, verb: str) -> None:
    """The run's picture at the end of `relay run`; a plot that cannot be drawn is a note only."""
    from launcher.plot import PlotError, plot

    try:
        print(f"{verb}: plot of every stage: {plot(root)}")
    except (PlotError, ImportError, OSError) as exc:
        print(f"{verb}: no plot ({exc})")


def cmd_plot(ns: argparse.Namespace) -> int:
    from launcher.plot import PlotError, plot

    try:
        path = plot(ns.path, ns.out)
    except PlotError as exc:
        print(f"relay plot: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from launcher.record import RecordError
    from launcher.status import collect_status, render_status_table

    try:
        rows = collect_status(ns.root)
    except RecordError as exc:
        print(f"relay status: {exc}", file=sys.stderr)
        return 2
    print(render_status_table(rows))
    return 0


def cmd_cancel(ns: argparse.Namespace) -> int:
    from launcher.record import RecordError
    from launcher.slurm import SlurmError, cancel_jobs
    from launcher.status import active_jobs, collect_status

    try:
        rows = collect_status(ns.root)
    except RecordError as exc:
        print(f"relay cancel: {exc}", file=sys.stderr)
        return 2
    active = active_jobs(rows)
    if not active:
        print(f"relay cancel: no queued or running job in {ns.root}.")
        return 0
    try:
        cancel_jobs([r.job_id for r in active])
    except SlurmError as exc:
        print(f"relay cancel: {exc}", file=sys.stderr)
        return 1
    for r in active:
        print(f"cancelled {r.name}: job {r.job_id} (was {r.state})")
    return 0


def cmd_env_probe(ns: argparse.Namespace) -> int:
    from trainer.runtime.environment import print_probe

    return print_probe(as_json=ns.json, import_kernels=ns.import_kernels)


def _data_path(entries: list[str]):
    """DIR or DIR:REPEAT arguments as a data_path (a directory, or a {directory: repeat} map)."""
    if len(entries) == 1 and ":" not in entries[0]:
        return entries[0]
    mapping = {}
    for entry in entries:
        directory, _, repeat = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        mapping[directory] = int(repeat)
    return mapping


def _patch_size(ns: argparse.Namespace) -> tuple[int, int, int]:
    """--patch-size, or the patch of the default model family's default config."""
    if ns.patch_size is not None:
        return tuple(ns.patch_size)
    from trainer.config.schema import ARGS
    from trainer.models.registry import get_family

    family = get_family(ARGS["model_family"].default)
    return family.geometry(family.config({})).patch_size


def cmd_data_inspect(ns: argparse.Namespace) -> int:
    from trainer.data.report import format_inspect, inspect_data

    try:
        report = inspect_data(_data_path(ns.data), patch_size=_patch_size(ns), verify=ns.verify)
    except (OSError, ValueError, TypeError) as exc:
        print(f"relay data inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if ns.json else format_inspect(report))
    return 1 if report["bad_rows"] else 0


def cmd_data_plan(ns: argparse.Namespace) -> int:
    from trainer.data.report import format_plan, plan_rank

    try:
        report = plan_rank(_data_path(ns.data), world_size=ns.world_size, cp_size=ns.cp_size,
                           seed=ns.seed, rank=ns.rank, batch_size=ns.batch_size,
                           token_budget=ns.token_budget, patch_size=_patch_size(ns),
                           image_sample_prob=ns.image_sample_prob, batches=ns.batches)
    except (OSError, ValueError, TypeError) as exc:
        print(f"relay data plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if ns.json else format_plan(report))
    return 0


def _encoder_dirs(ns: argparse.Namespace) -> tuple[str, str]:
    """--vae and --text-encoder, each defaulting to the folder of --pipeline. Raises ValueError
    naming what is missing."""
    from trainer.encoders.directories import encoder_dirs

    return encoder_dirs(ns.pipeline, ns.vae, ns.text_encoder,
                        names={"pipeline": "--pipeline", "vae_path": "--vae",
                               "text_encoder": "--text-encoder"})


def cmd_data_encode(ns: argparse.Namespace) -> int:
    from trainer.data.encode import EncodeError, encode_manifest

    try:
        vae, text = _encoder_dirs(ns)
    except ValueError as exc:
        print(f"relay data encode: {exc}", file=sys.stderr)
        return 2
    try:
        summary = encode_manifest(ns.manifest, vae_dir=vae, text_encoder_dir=text,
                                  out_dir=ns.out, rank=ns.rank, world_size=ns.world_size,
                                  skip_layer=ns.skip_layer, rows_per_shard=ns.rows_per_shard,
                                  device=ns.device)
    except EncodeError as exc:
        print(f"relay data encode: {exc}", file=sys.stderr)
        return 2
    print(f"encoded {summary['encoded']} (already done {summary['skipped']}), bad "
          f"{len(summary['bad'])} -> {summary['out']}")
    for bad in summary["bad"]:
        print(f"  bad: {bad['path']}: {bad['reason']}")
    return 1 if summary["bad"] else 0


def _add_data_verbs(sub) -> None:
    p = sub.add_parser("data", help="inspect, plan and encode training data")
    data_sub = p.add_subparsers(dest="data_command", required=True)

    def add_source(p: argparse.ArgumentParser) -> None:
        p.add_argument("data", nargs="+", metavar="DIR[:REPEAT]",
                       help="dataset directories (relay or FastVideo layout), each with an "
                            "optional repeat count, as data_path")
        p.add_argument("--patch-size", type=int, nargs=3, default=None,
                       metavar=("PT", "PH", "PW"),
                       help="patch size for token counts (default: the default model's)")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = data_sub.add_parser("inspect", help="rows, shards, shapes, token lengths, dtypes, bad rows")
    add_source(p)
    p.add_argument("--verify", action="store_true",
                   help="also read the tensor bytes and check their lengths (reads everything)")
    p.set_defaults(func=cmd_data_inspect)

    p = data_sub.add_parser("plan", help="which samples a rank reads first, packing efficiency")
    add_source(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--cp-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=0, help="global rank (dp rank = rank // cp_size)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per batch without packing")
    p.add_argument("--token-budget", type=int, default=None, help="packing_token_budget")
    p.add_argument("--image-sample-prob", type=float, default=None)
    p.add_argument("--batches", type=int, default=8, help="how many batches to list")
    p.set_defaults(func=cmd_data_plan)

    p = data_sub.add_parser("encode", help="encode videos/images and captions into shards "
                                           "(needs the encode extra)")
    p.add_argument("manifest", help="CSV or JSON list of {path, caption}")
    p.add_argument("--pipeline", default=None,
                   help="a diffusers pipeline directory (e.g. Wan's): its vae/ and text_encoder/ "
                        "+ tokenizer/ are the defaults of --vae and --text-encoder")
    p.add_argument("--vae", default=None, help="a diffusers AutoencoderKLWan directory")
    p.add_argument("--text-encoder", dest="text_encoder", default=None,
                   help="a transformers text encoder directory (its tokenizer in it or in "
                        "tokenizer/ beside it)")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--rank", type=int, default=None,
                   help="this process's share of the manifest (default: RANK or SLURM_PROCID, else 0)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes sharing the manifest (default: WORLD_SIZE or SLURM_NTASKS, else 1)")
    p.add_argument("--skip-layer", type=int, default=0,
                   help="text_encoder_hidden_state_skip_layer: final layers to drop")
    p.add_argument("--rows-per-shard", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_data_encode)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("resolve", help="print a stage config's resolved train.py arguments")
    p.add_argument("config")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value ... as for train.py")
    p.set_defaults(func=cmd_resolve)

    def add_model_args(p: argparse.ArgumentParser, steps: int) -> None:
        p.add_argument("--checkpoint", required=True,
                       help="a checkpoint-N/ directory or an output_dir (its newest checkpoint)")
        p.add_argument("--steps", type=int, default=None,
                       help="sampling steps (default: the stage's own: 30 Euler steps for FM, "
                            "flowmap_sampling_steps for Stage1, the rollout steps for Stage2)")
        p.add_argument("--guidance", type=float, default=None,
                       help="classifier-free guidance w: u + w (c - u); 1 = conditional only "
                            "(default: the stage's own, as validation uses)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--weights", choices=("auto", "ema", "live"), default="auto",
                       help="auto: EMA when the checkpoint has one, else live")
        p.add_argument("--attention", choices=("dense", "trained"), default="dense",
                       help="dense: full video self-attention, as diffusers runs the weights; "
                            "trained: the sparse video attention the run trained with "
                            "(video_attention_sparsity and _tile of its config; dense for a "
                            "run trained dense)")

    p = sub.add_parser("sample", help="generate a clip for a prompt")
    add_model_args(p, steps=30)
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="directory for sample.mp4/.gif, frames.png, frames.npy")
    p.add_argument("--first-frame", dest="first_frame", default=None,
                   help="an image to continue (resized to the model's frame size)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("eval", help="accuracy of samples from the pixels: colour and direction (the "
                       "benchmark: every attribute, fidelity)")
    add_model_args(p, steps=30)
    p.add_argument("--out", default=None, help="eval.json path (default: beside the checkpoint)")
    p.set_defaults(func=cmd_eval)

    from trainer.evaluation.export import DEFAULT_MAX_SHARD_SIZE, EXPORT_FORMATS

    p = sub.add_parser("export", help="write a checkpoint's weights for shipping: relay's "
                       "safetensors file, or a diffusers directory")
    p.add_argument("path", help="a checkpoint-N/ directory or an output_dir")
    p.add_argument("--format", choices=tuple(EXPORT_FORMATS), default="relay",
                   help="; ".join(f"{name}: --out is {spec.out}"
                                  for name, spec in EXPORT_FORMATS.items()))
    p.add_argument("--out", required=True, help="what to write (see --format)")
    p.add_argument("--weights", choices=("auto", "ema", "live"), default="auto",
                   help="auto: EMA when the checkpoint has one, else live")
    p.add_argument("--components", default=None, metavar="PIPELINE_DIR",
                   help="diffusers: the pipeline directory whose model_index.json, vae/, "
                        "text_encoder/, tokenizer/ and scheduler/ join the transformer (default: "
                        "the one the run started from; 'none': transformer/ only)")
    p.add_argument("--other-expert", dest="other_expert", default=None, metavar="RUN",
                   help="diffusers, Wan2.2 A14B: the other expert, a checkpoint-N/ or output_dir "
                        "of a run started from the pipeline's other expert folder, written into "
                        "that folder (transformer/: high noise, transformer_2/: low noise; "
                        "default: the source pipeline's folder as it is). peft: the other "
                        "expert's LoRA run; the two adapters go to high_noise/ and low_noise/")
    p.add_argument("--max-shard-size", dest="max_shard_size", default=None,
                   help=f"diffusers: the largest safetensors file before sharding with an "
                        f"index (default {DEFAULT_MAX_SHARD_SIZE})")
    p.add_argument("--merge-lora", dest="merge_lora", action="store_true",
                   help="relay, diffusers: a LoRA run's base with its adapters merged in (a LoRA "
                        "checkpoint holds the adapters only; --format peft writes those)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing export (relay: the file and its model_config.json; "
                        "diffusers: a previous export directory)")
    p.set_defaults(func=cmd_export)

    def add_pipeline_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("pipeline", help="pipeline YAML (e.g. config/pipeline/tiny.yaml)")
        p.add_argument("--root", default=None,
                       help="pipeline directory (default: the YAML's root); stage output_dirs "
                            "default to ROOT/<stage>")
        which = p.add_mutually_exclusive_group()
        which.add_argument("--from", dest="from_stage", metavar="STAGE", default=None,
                           help="launch STAGE and the stages after it; earlier stages' "
                                "output_dirs must already hold their checkpoints")
        which.add_argument("--only", metavar="STAGE", default=None, help="launch STAGE alone")

    p = sub.add_parser("submit", help="validate a pipeline, then submit its stages as chained "
                                      "Slurm jobs")
    add_pipeline_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the plan and the sbatch scripts; submit nothing")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("run", help="run a pipeline on this machine, stage after stage, no Slurm")
    add_pipeline_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("render", help="print the sbatch script of every stage")
    add_pipeline_args(p)
    p.add_argument("--check-paths", action="store_true",
                   help="also check that data and warm-start paths exist (as submit does)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("status", help="stage, job, Slurm state, step, loss, checkpoint, requeues")
    p.add_argument("root", help="pipeline directory (holds pipeline.json)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("plot", help="losses, LR, grad norm, step time and validation scores "
                                    "against step, as PNG")
    p.add_argument("path", help="a pipeline directory (every stage side by side) or one run's "
                                "output_dir")
    p.add_argument("--out", help="PNG to write (default: <path>/plot.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("cancel", help="scancel every queued or running job of a pipeline")
    p.add_argument("root", help="pipeline directory (holds pipeline.json)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("env", help="what a job sees: versions, GPUs, kernel caches, network")
    env_sub = p.add_subparsers(dest="env_command", required=True)
    p = env_sub.add_parser("probe", help="print the environment probe (also in launch-manifest.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--import-kernels", action="store_true",
                   help="also import flash_attn, FA4, quack and triton to prove they load (slower)")
    p.set_defaults(func=cmd_env_probe)
    _add_data_verbs(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
