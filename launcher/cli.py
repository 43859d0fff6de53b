"""`relay`: the command line of the project.

Each subcommand is a small function here that hands off to the module doing the work; the
argument parsing of train.py itself lives in trainer/args.py and is reused, never copied.
"""

from __future__ import annotations

import argparse
import sys


def cmd_resolve(ns: argparse.Namespace) -> int:
    from trainer.args import ConfigError, resolve_config

    try:
        args = resolve_config(ns.config, ns.overrides)
    except ConfigError as exc:
        print(f"relay: config error: {exc}", file=sys.stderr)
        return 2
    print(args.to_json())
    return 0


def cmd_sample(ns: argparse.Namespace) -> int:
    from trainer.inference import InferenceError, sample_to_dir

    try:
        paths = sample_to_dir(ns.checkpoint, ns.prompt, out_dir=ns.out, steps=ns.steps,
                              guidance=ns.guidance, seed=ns.seed, weights=ns.weights,
                              first_frame=ns.first_frame)
    except InferenceError as exc:
        print(f"relay sample: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from trainer.inference import InferenceError, evaluate_checkpoint

    try:
        report = evaluate_checkpoint(ns.checkpoint, steps=ns.steps, guidance=ns.guidance,
                                     seed=ns.seed, weights=ns.weights, out=ns.out)
    except InferenceError as exc:
        print(f"relay eval: {exc}", file=sys.stderr)
        return 2
    print(f"colour accuracy {report['colour_accuracy']:.1%}, direction accuracy "
          f"{report['direction_accuracy']:.1%} over {len(report['per_caption'])} clips "
          f"-> {report['path']}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from trainer.checkpoint import CheckpointError
    from trainer.inference import export_checkpoint

    try:
        out = export_checkpoint(ns.path, ns.out, weights=ns.weights)
    except CheckpointError as exc:
        print(f"relay export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {out.with_name('model_config.json')}")
    return 0


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
        p.add_argument("--steps", type=int, default=steps, help="sampling steps")
        p.add_argument("--guidance", type=float, default=4.0,
                       help="classifier-free guidance w: u + w (c - u); 1 = conditional only")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--weights", choices=("auto", "ema", "live"), default="auto",
                       help="auto: EMA when the checkpoint has one, else live")

    p = sub.add_parser("sample", help="generate a clip for a prompt")
    add_model_args(p, steps=30)
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="directory for sample.mp4/.gif, frames.png, frames.npy")
    p.add_argument("--first-frame", dest="first_frame", default=None,
                   help="an image to continue (resized to the model's frame size)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("eval", help="colour and direction accuracy of samples, from the pixels")
    add_model_args(p, steps=30)
    p.add_argument("--out", default=None, help="eval.json path (default: beside the checkpoint)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write the weights a user ships as safetensors")
    p.add_argument("path", help="a checkpoint-N/ directory or an output_dir")
    p.add_argument("--out", required=True, help="model.safetensors path")
    p.add_argument("--weights", choices=("auto", "ema", "live"), default="auto")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
