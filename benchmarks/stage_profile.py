"""Where one stage's training step spends its time: train.py's own stage, timed, then profiled.

    python benchmarks/stage_profile.py --out DIR [--warmup 20] [--steps 60] [--profile-steps 3] \
        -- --config config/bench/pretrain.yaml [--key value ...]

Everything after `--` is train.py's command line (the config and its overrides). The stage is
built as train.py builds it (data, model, optimizer, compile settings; random weights, no
checkpoint is read or written), then it runs `--warmup` steps (compilation, the data loader's
first batches), `--steps` timed steps (wall clock between device synchronisations: median and
minimum), and `--profile-steps` steps, each under torch.profiler as benchmarks/step.py
profiles one (`profile_step`). Writes DIR/report.json (step times, the share of the profiled
steps the GPU was busy, peak memory, each profiled step's top kernels and host operators) and
the last profiled step's operators by host time (DIR/host.txt) and kernels by device time
(DIR/device.txt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/stage_profile.py`: make the repository importable
    sys.path.insert(0, str(REPO))


def profile_stage(train_argv: list[str], *, warmup: int, steps: int,
                  profile_steps: int) -> dict:
    """The report of train.py's stage for `train_argv`: build and warm-up times, step times,
    and per profiled step (benchmarks.step.profile_step) its kernels and host operators."""
    from benchmarks.step import profile_step, synchronize
    from trainer.stages.registry import build_stage
    from trainer.resolve import resolve_args
    from trainer.parallel.distributed import init_distributed

    import torch

    args, _ = resolve_args(train_argv, world_size=1)
    topo = init_distributed(args.cp_size, args.dist_backend, hybrid_shard=args.hybrid_shard,
                            shard_group_size=args.shard_group_size)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    stage = build_stage(args, topo)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(1, warmup + 1):
        stage.train_step(step)
    synchronize(topo.device)
    warmup_s = time.perf_counter() - started
    times = []
    for step in range(warmup + 1, warmup + steps + 1):
        started = time.perf_counter()
        stage.train_step(step)
        synchronize(topo.device)
        times.append(time.perf_counter() - started)
    profiled = [profile_step(stage.train_step, step, topo.device)
                for step in range(warmup + steps + 1, warmup + steps + profile_steps + 1)]
    cuda = topo.device.type == "cuda"
    return {"argv": train_argv, "stage": args.stage, "build_s": build_s, "warmup_s": warmup_s,
            "median_step_s": statistics.median(times) if times else None,
            "min_step_s": min(times) if times else None,
            # the profiler slows the host: the busy share is of the profiled steps
            "gpu_busy": (sum(p["kernel_s"] for p in profiled) / sum(p["wall_s"] for p in profiled)
                         if cuda and profiled else None),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "profiled_steps": profiled}


def _table(rows: list[dict], time_key: str) -> str:
    return "\n".join(f"{r[time_key] * 1e3:12.3f} ms {r['calls']:8d}  {r['name']}"
                     for r in rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--profile-steps", type=int, default=3)
    ns = parser.parse_args(ours)
    if not train_argv:
        parser.error("give train.py's command line after `--` (at least --config FILE)")
    report = profile_stage(train_argv, warmup=ns.warmup, steps=ns.steps,
                           profile_steps=ns.profile_steps)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if report["profiled_steps"]:  # the last profiled step's tables
        last = report["profiled_steps"][-1]
        (ns.out / "host.txt").write_text(_table(last["top_host_ops"], "self_cpu_s"))
        (ns.out / "device.txt").write_text(_table(last["top_kernels"], "s"))
    summary = {k: v for k, v in report.items() if k != "profiled_steps"}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
