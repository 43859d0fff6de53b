"""One rank of a pipeline's encode stage: `python -m trainer.encode ...` (trainer.data.encode
does the encoding).

Each rank encodes its share of the manifest (RANK/WORLD_SIZE, or Slurm's SLURM_PROCID/
SLURM_NTASKS), writes what the stage may be asked to make first (a tiny Wan pipeline, demo
clips), reports how it ended under <out>/.ranks/<attempt>/, and rank 0 waits for the others so
the job's exit code is the verdict of the whole stage (75: stopped, requeue me).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from trainer.data.encode import env_rank, encode_manifest, write_demo_clips
from trainer.data.manifest import PLAN_FILE, SUMMARY_FILE, EncodeError, parts_expected
from trainer.runtime.files import write_json


PREEMPTED_EXIT_CODE = 75  # as trainer.runtime.preemption: saved what was done, requeue me


def _finish_if_complete(out: Path, split: dict) -> dict | None:
    """When every rank's parts are published, the summary of the whole encode (files encoded,
    every bad file) in encode-summary.json and run-result.json; None while parts are missing.
    Whichever rank finishes last writes them (the same content, written atomically)."""
    records = sorted(out.glob("part-r*.json"))
    if len(records) < parts_expected(split):
        return None
    parts = [json.loads(r.read_text()) for r in records]
    summary = {"encoded": sum(p["rows"] for p in parts), "entries": split["entries"],
               "bad": [b for p in parts for b in p["bad"]]}
    write_json(out / SUMMARY_FILE, summary)
    write_json(out / "run-result.json", {"status": "completed", "step": split["entries"],
                                         "encoded": summary["encoded"],
                                         "bad": len(summary["bad"]), "error": None})
    return summary


def _make_missing_inputs(ns, rank: int) -> None:
    """--make-tiny-wan / --demo-clips: rank 0 writes what is missing, the others wait for it."""
    wanted = []
    if ns.make_tiny_wan and ns.pipeline and not (Path(ns.pipeline) / "model_index.json").is_file():
        wanted.append(Path(ns.pipeline) / "model_index.json")
        if rank == 0:
            from trainer.models.registry import get_family

            print(f"relay encode: writing a tiny random Wan pipeline at {ns.pipeline}",
                  file=sys.stderr, flush=True)
            get_family("wan").write_tiny_pipeline(ns.pipeline)
    if ns.demo_clips and not Path(ns.manifest).is_file():
        wanted.append(Path(ns.manifest))
        if rank == 0:
            print(f"relay encode: writing {ns.demo_clips} moving-shapes clips and {ns.manifest}",
                  file=sys.stderr, flush=True)
            write_demo_clips(ns.manifest, ns.demo_clips)
    deadline = time.monotonic() + 600
    while not all(path.is_file() for path in wanted) and time.monotonic() < deadline:
        time.sleep(1.0)


RANKS_DIR = ".ranks"  # <out>/.ranks/<attempt>/r<rank>.json: how each rank of an attempt ended
STALL_S = 600.0  # rank 0 gives up on ranks that neither report nor publish a part this long


def _attempt() -> str:
    """This run of the job: its Slurm job and restart count (a requeue is a new attempt), or
    the id `relay run` gives its ranks."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return os.environ.get("RELAY_ENCODE_ATTEMPT", "local")


def _report_rank(out: Path, rank: int, status: str) -> None:
    write_json(out / RANKS_DIR / _attempt() / f"r{rank}.json", {"status": status})


def _wait_for_ranks(out: Path, split: dict, stop: dict) -> int:
    """Rank 0, its share done: 0 once every rank of this attempt completed; 75 when one was
    stopped (the requeued job redoes its unfinished parts), or rank 0 itself is signalled; 1
    when one failed, or none of the missing ranks reported or published a part for STALL_S."""
    folder = out / RANKS_DIR / _attempt()
    world = split["world_size"]
    progress, moved = -1, time.monotonic()
    while True:
        reports = {}
        for rank in range(world):
            try:
                reports[rank] = json.loads((folder / f"r{rank}.json").read_text())["status"]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        failed = [r for r, status in reports.items() if status == "failed"]
        if failed:
            print(f"relay encode: rank(s) {failed} failed (see the job's log); their parts are "
                  f"not all encoded", file=sys.stderr)
            return 1
        if len(reports) == world:
            stopped = [r for r, status in reports.items() if status == "stopped"]
            if stopped:
                print(f"relay encode: rank(s) {stopped} stopped before their share was done: "
                      f"the job is requeued and redoes only their unfinished parts",
                      file=sys.stderr, flush=True)
                return PREEMPTED_EXIT_CODE
            return 0
        if stop["signal"] is not None:
            return PREEMPTED_EXIT_CODE
        parts = len(list(out.glob("part-r*.json")))
        if parts != progress:
            progress, moved = parts, time.monotonic()
        elif time.monotonic() - moved > STALL_S:
            missing = sorted(set(range(world)) - set(reports))
            print(f"relay encode: rank(s) {missing} neither finished nor published a part for "
                  f"{STALL_S:.0f} s (killed?); failing so the stage can be resubmitted",
                  file=sys.stderr)
            return 1
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    """One rank of an encode stage: its share of the manifest (RANK/WORLD_SIZE, or Slurm's
    SLURM_PROCID/SLURM_NTASKS), on its GPU (LOCAL_RANK) when there is one. Exit codes: 0 done
    (bad files are listed, not fatal), 2 cannot start, 75 stopped by SIGUSR2/SIGTERM with every
    finished part published (a requeued job redoes only the unfinished ones)."""
    parser = argparse.ArgumentParser(prog="python -m trainer.encode")
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--pipeline", default=None,
                        help="a diffusers pipeline directory: the default of --vae/--text-encoder")
    parser.add_argument("--vae", default=None)
    parser.add_argument("--text-encoder", dest="text_encoder", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows-per-shard", type=int, default=64)
    parser.add_argument("--text-max-tokens", type=int, default=512)
    parser.add_argument("--skip-layer", type=int, default=0)
    parser.add_argument("--make-tiny-wan", action="store_true",
                        help="write trainer.models.wan.tiny's pipeline at --pipeline when missing")
    parser.add_argument("--demo-clips", type=int, default=0,
                        help="write this many moving-shapes mp4 clips and the manifest when the "
                             "manifest is missing")
    ns = parser.parse_args(argv)
    rank, _ = env_rank(None, None)
    _make_missing_inputs(ns, rank)
    try:
        from trainer.encoders.directories import encoder_dirs

        vae, text = encoder_dirs(ns.pipeline, ns.vae, ns.text_encoder)
    except ValueError as exc:
        print(f"relay encode: {exc}", file=sys.stderr)
        return 2
    stop = {"signal": None}

    def request_stop(number, _frame):
        stop["signal"] = signal.Signals(number).name

    for name in ("SIGUSR2", "SIGTERM"):
        signal.signal(getattr(signal, name), request_stop)
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    device = f"cuda:{local % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    out = Path(ns.out)
    try:
        summary = encode_manifest(ns.manifest, vae_dir=vae, text_encoder_dir=text,
                                  out_dir=out, skip_layer=ns.skip_layer,
                                  rows_per_shard=ns.rows_per_shard, device=device,
                                  max_text_tokens=ns.text_max_tokens, progress="lines",
                                  stop=lambda: stop["signal"] is not None)
    except EncodeError as exc:
        _report_rank(out, rank, "failed")
        print(f"relay encode: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        _report_rank(out, rank, "failed")
        raise
    if summary["stopped"]:
        _report_rank(out, rank, "stopped")
        print(f"relay encode: {stop['signal']}: stopped with every finished part published in "
              f"{out}; a restart redoes only the rest", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    _report_rank(out, rank, "completed")
    split = json.loads((out / PLAN_FILE).read_text())
    if rank == 0 and split["world_size"] > 1:
        # Rank 0's exit code is the job's verdict (it alone requeues a stopped job): it waits
        # for every rank of this attempt, so no share is left unencoded under a completed job.
        code = _wait_for_ranks(out, split, stop)
        if code:
            return code
    whole = _finish_if_complete(out, split)
    if whole is not None:
        print(f"relay encode: {whole['encoded']} of {whole['entries']} files encoded into {out}, "
              f"{len(whole['bad'])} bad (listed in {out / SUMMARY_FILE})", file=sys.stderr)
        for bad in whole["bad"][:20]:
            print(f"  bad: {bad['path']}: {bad['reason']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

