"""Where a run reports: metrics.jsonl (the contract), an optional W&B run, and the console.

metrics.jsonl holds one JSON object per logged step. After a resume, records past the resumed
step (written after the checkpoint, before the crash) are dropped, so the file never shows a
step twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
from pathlib import Path

log = logging.getLogger("relay")


class MetricsWriter:
    def __init__(self, output_dir: str | os.PathLike, *, enabled: bool):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records with step > `step` (they belong to work the resume repeats)."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write
            if record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(_finite(record)) + "\n")


RUN_ID_FILE = "wandb-run-id"


def output_dir_run_id(output_dir: Path, resumed: bool) -> str:
    """The W&B run id of this output_dir's run: when it resumed, the one kept in RUN_ID_FILE;
    else (or if none is kept) a new one, kept there. A fresh start never reuses an id: W&B
    would drop its steps as already logged."""
    path = output_dir / RUN_ID_FILE
    if resumed and path.is_file() and (kept := path.read_text().strip()):
        return kept
    run_id = secrets.token_hex(6)
    path.write_text(run_id + "\n")
    return run_id


def _finite(record: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}


class WandbReporter:
    """W&B logging; the API key comes from WANDB_API_KEY in the environment, never a file.

    One W&B run per training trajectory: its id is kept in `wandb-run-id` in the output_dir,
    so a resumed or requeued job logs on into the same run, and a run that starts fresh (no
    checkpoint to resume) starts a new one (WANDB_RUN_ID, when set, wins).
    """

    def __init__(self, args, *, enabled: bool, resumed: bool):
        self.run = None
        if not enabled or args.report_to != "wandb":
            return
        import wandb

        config = {k: v for k, v in args.items()}
        self.run = wandb.init(
            project=args.wandb_project,
            name=args.wandb_run_name or Path(args.output_dir).name,
            id=os.environ.get("WANDB_RUN_ID") or output_dir_run_id(Path(args.output_dir), resumed),
            resume="allow",
            dir=args.output_dir,
            config=config,
        )

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise (Slurm logs stay readable)."""

    def __init__(self, total: int, initial: int, *, enabled: bool):
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")

    def update(self, step: int, record: dict | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if record:
                self.bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}",
                                     lr=f"{record.get('lr', 0):.2e}")
        elif record:
            parts = [f"step {step}"] + [
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in record.items() if k != "step"]
            log.info(" | ".join(parts))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
