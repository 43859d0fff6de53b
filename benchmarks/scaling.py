"""What splitting a run over processes costs: step time of one global batch at 1, 2 and 4 ranks.

    python benchmarks/scaling.py [--steps 20] [--global-batch 8]
                                 [--json benchmarks/results/scaling.json]

CPU part (this file): the tiny pretrain (config/tiny/pretrain.yaml, a smaller model as in the
integration tests) run by train.py itself, with the same global batch split as one process,
FSDP2 over 2 ranks, hybrid shard 2 x 2 (4 ranks, gloo), Ulysses cp 2 and dp 2 x cp 2
(trainer.parallel.context_parallel: the cp ranks of a group share its samples). The figure is the median
step_time_s of metrics.jsonl after the first 5 steps (warm-up, first touch of memory), and
the losses of the runs are compared (they must agree: the split does not change the
step). On a machine with fewer cores than ranks the ranks share cores, so the figure is an
upper bound of the overhead, not a scaling curve.

GPU part (not written yet; needs the device tool): memory and step time at the Wan-1.3B size
with no / selective / full checkpointing, compiled and not, beside
trainer.checks.memory's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ("{hidden_size: 64, num_attention_heads: 4, num_layers: 4, rope_axes_dim: [4, 6, 6], "
         "text_dim: 32, patch_size: [1, 4, 4], in_channels: 3}")


def _pythonpath() -> str:
    """This checkout first, then whatever the caller's environment already had."""
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_split(out: Path, data: Path, ranks: int, batch: int, steps: int, *extra: str) -> list[dict]:
    """train.py on `ranks` processes; its metrics.jsonl records."""
    args = ["--config", str(REPO / "config" / "tiny" / "pretrain.yaml"),
            "--transformer_config_overrides", MODEL, "--synthetic_num_samples", "256",
            "--data_path", str(data), "--output_dir", str(out), "--max_steps", str(steps),
            "--train_batch_size", str(batch), "--log_interval", "1",
            "--save_interval", str(steps * 10), "--validation_interval", "-1", *extra]
    script = str(REPO / "trainer" / "train.py")
    launcher = [sys.executable, script] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
        str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(launcher + args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    import torch

    # name: (ranks, cp_size, extra keys); the cp ranks of a group share its samples
    splits = {"1 process": (1, 1, ()), "FSDP2 dp 2": (2, 1, ()),
              "hybrid 2 x 2": (4, 1, ("--hybrid_shard", "true", "--shard_group_size", "2")),
              "cp 2": (2, 2, ("--cp_size", "2")), "dp 2 x cp 2": (4, 2, ("--cp_size", "2"))}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (ranks, cp, extra) in splits.items():
            records = run_split(root / name.replace(" ", "-"), root / "data", ranks,
                                ns.global_batch * cp // ranks, ns.steps, *extra)
            times = [r["step_time_s"] for r in records[5:]]
            results[name] = {"ranks": ranks, "median_step_s": statistics.median(times),
                             "losses": [r["loss"] for r in records]}
    base = results["1 process"]
    print(f"global batch {ns.global_batch}, {ns.steps} steps, {os.cpu_count()} CPU cores")
    print(f"{'split':<14} {'ranks':>5} {'step s':>8} {'vs 1':>6} {'max loss diff':>14}")
    for name, r in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        r["max_relative_loss_difference"] = diff
        print(f"{name:<14} {r['ranks']:>5} {r['median_step_s']:>8.3f} "
              f"{r['median_step_s'] / base['median_step_s']:>5.2f}x {diff:>14.2e}")
    if ns.json:
        meta = {"host": socket.gethostname(), "cpus": os.cpu_count(),
                "python": platform.python_version(), "torch": torch.__version__,
                "command": " ".join(sys.argv)}
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
