"""Kernel-cache warm-up: one forward and backward of a stage at its real shapes.

    python -m trainer.warmup --config config/tiny/pretrain.yaml [--key value ...]

Triton, Inductor, FlashAttention-4 (CuTe DSL) and quack compile and autotune a kernel the first
time they meet a shape, and keep the result in the caches slurm/env.sh points at. On a cold
cache that takes minutes per shape; at production sizes the first training step can take over
half an hour, while every node of a large allocation waits (and looks hung). Running the
stage's model once on one GPU beforehand fills the shared caches (FA4, quack) for every node
that comes later, and tells whether the shapes fit in memory at all.

What it runs is what the first training step runs: the stage's model from its config, batch
train_batch_size, the latent shape of the data (the synthetic_* settings, or the first row of
the first parquet shard), text_max_tokens caption tokens, the attention backend the model
config names, the run's dtype/autocast, and torch.compile when compile_transformer is set.
No optimizer step, nothing saved, the stage's output_dir untouched: the report goes to stdout
and, when RELAY_WARMUP_REPORT names a file, there too.

Exit codes: 0 warmed up, 1 the forward/backward failed (the report says why), 2 bad config.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python trainer/warmup.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.resolve import resolve_args
from trainer.build import build_model, prepare_for_training, sample_latent_shape
from trainer.runtime.files import write_json
from trainer.config.schema import ConfigError, ResolvedArgs
from trainer.models.registry import family_of, model_config
from trainer.stages.registry import stage_of

log = logging.getLogger("relay")

REPORT_ENV = "RELAY_WARMUP_REPORT"
# Counting a cache is a directory walk; a warm Inductor cache holds thousands of files, and a
# cap keeps a runaway one from stalling the job (the count is then marked truncated).
MAX_CACHE_FILES = 500_000
HEARTBEAT_S = 60.0

__all__ = ["warmup_shapes", "warm_up_kernels", "main"]


def warmup_shapes(args: ResolvedArgs) -> dict[str, Any]:
    """The shapes of the first training step: {"batch", "latent" [C, T, H, W], "text_tokens",
    "text_dim", "video_tokens"}. Reads one clip or one parquet shard; generates nothing.

    Raises FileNotFoundError / ValueError when the data cannot be read (as training would).
    """
    geometry = family_of(args).geometry(model_config(args))
    latent = sample_latent_shape(args)
    pt, ph, pw = geometry.patch_size
    _, t, h, w = latent
    return {"batch": int(args.train_batch_size), "latent": list(latent),
            "text_tokens": int(args.text_max_tokens), "text_dim": int(geometry.text_dim),
            "video_tokens": (t // pt) * (h // ph) * (w // pw)}


def _random_batch(shapes: dict, device: torch.device) -> dict:
    """A batch like DistributedBatchIterator's: values are random, shapes and dtypes real."""
    b, length = shapes["batch"], shapes["text_tokens"]
    return {
        "latents": torch.randn(b, *shapes["latent"], device=device),
        "text": torch.randn(b, length, shapes["text_dim"], device=device),
        # Captions are padded to text_max_tokens, so training attends over per-sample caption
        # lengths (the padded attention plan, not the full one): the warm-up does the same.
        "text_mask": torch.arange(length, device=device)[None, :].expand(b, -1)
        < max(1, (length + 1) // 2),
    }


def _cache_counts() -> dict[str, dict[str, Any]]:
    from trainer.runtime.environment import inspect_caches

    return inspect_caches(max_files=MAX_CACHE_FILES, check_writable=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Heartbeat:
    """Logs every `every` seconds while a long step runs, so a cold cache never looks hung."""

    def __init__(self, what: str, every: float):
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-warmup-heartbeat",
                                        daemon=True)
        self._start = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            log.info("kernel warm-up: still %s after %.0f s (autotuning; not a hang)", self.what,
                     time.perf_counter() - self._start)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def warm_up_kernels(args: ResolvedArgs, device: torch.device | str,
                    heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
    """One forward + backward of args' stage at its real shapes; returns the report.

    Builds the model (trainer.build.build_model), compiles its blocks when
    compile_transformer is set, and runs the stage's loss on a random batch of the training
    shapes under the run's autocast. No optimizer step; nothing is written (not even
    output_dir). Report keys: status "ok", stage, config, device, dtype, attention_backend,
    compile_transformer, shapes (warmup_shapes), loss, timings_s (build, forward, backward,
    total), peak_device_mem_gb (None on CPU), caches ({VAR: path, files_before, files_after,
    added}), torch, cuda.
    The loss is the one the stage's declaration names (`warmup_loss`): one micro-batch (Stage2:
    one outer step) through the same code the stage trains with.
    Raises ValueError for a stage without a warm-up loss, FileNotFoundError / ValueError when
    the data cannot be read, and whatever the forward/backward raises (an out-of-memory error
    here is one the training run would have hit too).
    """
    from trainer.stages.base import autocast_context

    device = torch.device(device)
    stage_loss = stage_of(args).load_warmup_loss()
    if stage_loss is None:
        raise ValueError(f"no kernel warm-up for stage {args.stage!r}: its declaration names no "
                         f"warmup_loss")
    config = model_config(args)
    shapes = warmup_shapes(args)
    before = _cache_counts()
    log.info("kernel warm-up: autotuning may take minutes on a cold cache (stage %s, batch %d, "
             "latent %s, %d text tokens, %d video tokens, attention %s, compile %s, dtype %s, %s)",
             args.stage, shapes["batch"], shapes["latent"], shapes["text_tokens"],
             shapes["video_tokens"], config.get("attention_backend", "auto"), args.compile_transformer,
             args.dtype, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model = prepare_for_training(build_model(args, device), args)
    model.train()
    if args.video_attention_sparsity > 0:  # the sparse kernels, at the target (one compile for any)
        from trainer.models.sparse_attention import set_video_attention_sparsity

        set_video_attention_sparsity(model, args.video_attention_sparsity, args.video_attention_tile,
                                     args.video_attention_own_tile)
    batch = _random_batch(shapes, device)
    built = time.perf_counter()
    with _Heartbeat("in the forward pass", heartbeat_s):
        with autocast_context(device, args.dtype):
            loss = stage_loss(model, batch, args, shapes)
        _sync(device)
    forward_done = time.perf_counter()
    with _Heartbeat("in the backward pass", heartbeat_s):
        loss.backward()
        _sync(device)
    end = time.perf_counter()
    after = _cache_counts()

    caches = {}
    for var, now in after.items():
        was = before[var]
        caches[var] = {"path": now["path"], "files_before": was["files"],
                       "files_after": now["files"], "added": now["files"] - was["files"],
                       "truncated": was["files_truncated"] or now["files_truncated"]}
    timings = {"build": built - start, "forward": forward_done - built,
               "backward": end - forward_done, "total": end - start}
    report = {
        "status": "ok",
        "stage": args.stage,
        "config": args.get("config"),
        "device": str(device),
        "dtype": args.dtype,
        "attention_backend": config["attention_backend"],
        "compile_transformer": bool(args.compile_transformer),
        "shapes": shapes,
        "loss": float(loss.detach()),
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "peak_device_mem_gb": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                               if device.type == "cuda" else None),
        "caches": caches,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    log.info("kernel warm-up: done in %.1f s (forward %.1f s, backward %.1f s); cache files "
             "added: %s", timings["total"], timings["forward"], timings["backward"],
             ", ".join(f"{var} +{c['added']}" for var, c in caches.items() if c["path"])
             or "no cache directories set")
    return report


def _pick_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0)
    torch.cuda.set_device(local % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.warmup --config X [--key value ...]`: warm up, print the report as
    JSON on stdout (logs go to stderr), also write it to $RELAY_WARMUP_REPORT when set.
    The arguments are train.py's (same parser, same precedence); --dry-run is accepted and
    ignored. Returns the exit code: 0 ok, 1 the warm-up failed, 2 bad configuration."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                            format="%(asctime)s %(levelname)s %(message)s")
    try:
        # world_size None: the warm-up is one process, so the global-batch arithmetic of the
        # real topology is not checked here (train.py checks it).
        args, _ = resolve_args(argv, world_size=None, check_weights=False)
    except ConfigError as exc:
        print(f"relay: config error: {exc}", file=sys.stderr)
        return 2
    code = 0
    try:
        report = warm_up_kernels(args, _pick_device())
    except Exception as exc:
        log.exception("kernel warm-up failed")
        report = {"status": "failed", "stage": args.stage, "config": args.get("config"),
                  "error": f"{type(exc).__name__}: {exc}"}
        code = 1
    print(json.dumps(report, indent=2, sort_keys=True))
    path = os.environ.get(REPORT_ENV)
    if path:
        try:
            write_json(path, report)
        except OSError as exc:
            log.error("cannot write %s=%s: %s", REPORT_ENV, path, exc)
            code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
