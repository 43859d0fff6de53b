"""Where one stage's training step spends its time: train.py's own stage, timed, then profiled.

    python benchmarks/stage_profile.py --out DIR [--warmup 20] [--steps 60] [--profile-steps 3] \
        -- --config config/bench/pretrain.yaml [--key value ...]

Everything after `--` is train.py's command line (the config and its overrides). The stage is
built as train.py builds it (data, model, optimizer, compile settings; random weights, no
checkpoint is read or written), then it runs `--warmup` steps (compilation, the data loader's
first batches), `--steps` timed steps (wall clock between device synchronisations: median and
minimum), and `--profile-steps` steps under torch.profiler. Writes DIR/report.json (step
times, kernel time per step, the share of the step the GPU was busy, peak memory) and the
profiler's tables by host time (DIR/host.txt) and by device time (DIR/device.txt).
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


def _synchronize(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_stage(train_argv: list[str], *, warmup: int, steps: int,
                  profile_steps: int) -> tuple[dict, str, str]:
    """(report, host-time table, device-time table) of train.py's stage for `train_argv`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.build import build_stage
    from trainer.config.args import resolve_args
    from trainer.parallel.distributed import init_distributed
    from trainer.runtime.cuda_memory import configure_cuda_allocator

    args, _ = resolve_args(train_argv, world_size=1)
    configure_cuda_allocator()
    topo = init_distributed(args.cp_size, args.dist_backend, hybrid_shard=args.hybrid_shard,
                            shard_group_size=args.shard_group_size)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    stage = build_stage(args, topo)
    build_s = time.perf_counter() - started
    step = 0
    started = time.perf_counter()
    for step in range(1, warmup + 1):
        stage.train_step(step)
    _synchronize(torch)
    warmup_s = time.perf_counter() - started
    times = []
    for step in range(step + 1, step + 1 + steps):
        started = time.perf_counter()
        stage.train_step(step)
        _synchronize(torch)
        times.append(time.perf_counter() - started)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for step in range(step + 1, step + 1 + profile_steps):
            stage.train_step(step)
        _synchronize(torch)
        profiled_s = (time.perf_counter() - started) / max(profile_steps, 1)
    events = prof.key_averages()
    kernel_s = sum(e.self_device_time_total for e in events
                   if e.device_type.name == "CUDA") / 1e6 / max(profile_steps, 1)
    report = {"argv": train_argv, "stage": args.stage, "build_s": build_s, "warmup_s": warmup_s,
              "median_step_s": statistics.median(times) if times else None,
              "min_step_s": min(times) if times else None,
              # the profiler slows the host: the busy share is of the profiled step
              "profiled_step_s": profiled_s, "kernel_s_per_step": kernel_s,
              "gpu_busy": kernel_s / profiled_s if torch.cuda.is_available() else None,
              "peak_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30
                                     if torch.cuda.is_available() else None)}
    host = events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    device = (events.table(sort_by="self_device_time_total", row_limit=30,
                           max_name_column_width=70) if torch.cuda.is_available() else "")
    return report, host, device


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
    report, host, device = profile_stage(train_argv, warmup=ns.warmup, steps=ns.steps,
                                         profile_steps=ns.profile_steps)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (ns.out / "host.txt").write_text(host)
    (ns.out / "device.txt").write_text(device)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
