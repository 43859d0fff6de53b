"""Where the time of a pipeline run went, stage by stage, from the files the run left.

    python benchmarks/pipeline_breakdown.py ROOT [--json FILE]

ROOT is a pipeline root written by `relay run` or `relay submit` (pipeline.json and one
output_dir per stage). Per stage:

- wall: from its launch (pipeline.json `launched_at`, 1 s resolution) to the next stage's launch,
  or to its run-result.json for the last one;
- start-up: launch to the trainer's first train.log line (interpreter and torch import, data
  generation on a first run, model build, warm start);
- training: the trainer's first to last train.log line, less validation (the steps, and the
  checkpoint saves between them);
- validation: the sum of the validation steps' `val/seconds`;
- exit: the last train.log line to the end (final save's tail, process exit);
- median step: of the logged `step_time_s` (every log_interval-th step).

It also says when each stage's last validation samples were on disk, counted from the first
launch. It reads only; nothing is run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path


def parse_time(text: str) -> float:
    """Seconds since the epoch of an ISO time with offset ('2026-12-01T09:32:02+0000')."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").timestamp()


def log_times(train_log: Path) -> tuple[float, float] | None:
    """The times of train.log's first and last lines ('2026-12-01 09:32:16,199 INFO ...',
    local time); None without a readable log."""
    try:
        stamps = [line[:23] for line in train_log.read_text().splitlines() if line[:2] == "20"]
        first, last = (datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                       for t in (stamps[0], stamps[-1]))
    except (OSError, ValueError, IndexError):
        return None
    return first, last


def stage_breakdown(entry: dict, end: float | None) -> dict:
    """The figures of one stage; None where its files do not say."""
    out = Path(entry["output_dir"])
    launched = parse_time(entry["launched_at"]) if entry.get("launched_at") else None
    records = []
    if (out / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    validation = sum(r.get("val/seconds", 0.0) for r in records)
    logged = log_times(out / "train.log")
    known = launched is not None and logged is not None
    manifests = sorted(out.glob("samples/step-*/manifest.json"),
                       key=lambda p: int(p.parent.name.split("-")[1]))
    return {"steps": records[-1]["step"] if records else 0,
            "median_step_s": statistics.median(times) if times else None,
            "wall_s": end - launched if end is not None and launched is not None else None,
            "startup_s": logged[0] - launched if known else None,
            "training_s": logged[1] - logged[0] - validation if logged else None,
            "validation_s": validation,
            "validations": sum(1 for r in records if "val/seconds" in r),
            "exit_s": end - logged[1] if logged and end is not None else None,
            "last_samples_at": manifests[-1].stat().st_mtime if manifests else None,
            "launched": launched}


def breakdown(root: Path) -> dict:
    """Every stage of root's pipeline.json, in order, plus the first launch and the end."""
    record = json.loads((root / "pipeline.json").read_text())
    entries = [(n, e) for n, e in record["stages"].items() if e.get("launched_at")]
    stages = {}
    for i, (name, entry) in enumerate(entries):
        if i + 1 < len(entries):
            end = parse_time(entries[i + 1][1]["launched_at"])
        else:
            result = Path(entry["output_dir"]) / "run-result.json"
            end = result.stat().st_mtime if result.is_file() else None
        stages[name] = stage_breakdown(entry, end)
    first = min(s["launched"] for s in stages.values())
    for figures in stages.values():
        if figures["last_samples_at"] is not None:
            figures["last_samples_at"] -= first
        figures.pop("launched")
    return {"root": str(root), "stages": stages}


def render(report: dict) -> str:
    def cell(value, unit="s"):
        return "-" if value is None else f"{value:.0f} {unit}" if unit else str(value)

    header = ["stage", "steps", "median step", "wall", "start-up", "training", "validation",
              "exit", "samples at"]
    rows = [header]
    for name, s in report["stages"].items():
        rows.append([name, str(s["steps"]), "-" if s["median_step_s"] is None else
                     f"{s['median_step_s']:.3f} s", cell(s["wall_s"]), cell(s["startup_s"]),
                     cell(s["training_s"]), f"{s['validation_s']:.0f} s ({s['validations']})",
                     cell(s["exit_s"]), cell(s["last_samples_at"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--json", help="also write the figures here")
    ns = parser.parse_args(argv)
    report = breakdown(Path(ns.root))
    print(render(report))
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
