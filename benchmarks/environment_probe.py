"""How long the environment probe takes, as a job's start pays it.

    python benchmarks/environment_probe.py [--repeats 5] [--json benchmarks/results/environment_probe.json]

Every train.py run probes its environment once (launch-manifest.json) and `relay env probe`
prints the same report. Each repeat runs `relay env probe --json` in a fresh process, as a job
would, and reads the probe's own `probe_seconds` (versions, caches, network, Slurm; without
importing the kernel packages). Prints the median and the range; --json keeps them with the
machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def probe_once() -> dict:
    """One `relay env probe --json` in a new process: its report."""
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "env", "probe", "--json"],
                          cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    ns = parser.parse_args(argv)
    reports = [probe_once() for _ in range(ns.repeats)]
    seconds = [r["probe_seconds"] for r in reports]
    result = {
        "command": " ".join(["python", "benchmarks/environment_probe.py", *(argv or sys.argv[1:])]),
        "probe_seconds": {"median": statistics.median(seconds), "min": min(seconds),
                          "max": max(seconds), "all": seconds},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average": os.getloadavg()},
        "python": platform.python_version(),
        "torch": reports[0]["torch"]["version"],
    }
    print(f"environment probe: median {result['probe_seconds']['median']:.2f} s "
          f"[{min(seconds):.2f}-{max(seconds):.2f}] over {ns.repeats} runs "
          f"(torch {result['torch']}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
