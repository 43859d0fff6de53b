"""Loader throughput and host memory on Wan-1.3B-sized samples, with 0, 2 and 4 workers.

    python benchmarks/data.py [--samples 48] [--workers 0 2 4] [--batches 24] [--dir DIR]
                              [--json benchmarks/results/data.json]

The data: --samples rows in FastVideo's T2V layout (bfloat16, as its preprocessing writes
them), each a Wan2.1 latent of 81 frames at 480x832 ([16, 21, 60, 104], 4.2 MB) and a UMT5
caption of --text-tokens x 4096 (1.6 MB at 200 tokens), 4 rows per row group, written once
into --dir. Each worker count reads --batches packs of one sample (packing_token_budget =
32,760 video tokens + the caption: one Wan-1.3B step on one GPU) through
DistributedBatchIterator, after 2 warm-up packs (worker start-up and first reads), and
reports samples/s, MB/s of stored tensor bytes delivered as float32 tensors, and the peak
resident memory of the loader process plus its workers above the process's baseline.
The page cache holds the files after the first pass: these are decode-and-deliver figures, not
disk figures (checkpoint.py measures the disk).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LATENT = (16, 21, 60, 104)       # Wan2.1 VAE latent of 81 frames at 480x832
TEXT_DIM = 4096                  # UMT5-XXL
VIDEO_TOKENS = 21 * 30 * 52      # patch (1, 2, 2): 32,760


def _bf16_bytes(rng: np.random.Generator, shape) -> bytes:
    # bfloat16 = the top 16 bits of a float32.
    values = rng.standard_normal(shape, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def write_dataset(directory: Path, samples: int, text_tokens: int) -> Path:
    """samples rows of Wan-sized bf16 tensors in FastVideo's layout (kept between runs)."""
    shard = directory / "worker_0" / "data_chunk_0.parquet"
    if shard.is_file() and pq.ParquetFile(shard).metadata.num_rows == samples:
        return directory
    shard.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = None
    for start in range(0, samples, 4):
        rows = [{"id": f"bench-{n:05d}", "vae_latent_bytes": _bf16_bytes(rng, LATENT),
                 "vae_latent_shape": list(LATENT), "vae_latent_dtype": "bfloat16",
                 "text_embedding_bytes": _bf16_bytes(rng, (text_tokens, TEXT_DIM)),
                 "text_embedding_shape": [text_tokens, TEXT_DIM], "text_embedding_dtype": "bfloat16",
                 "file_name": f"clip_{n}.mp4", "caption": "a benchmark clip", "media_type": "video",
                 "width": 832, "height": 480, "num_frames": 81, "duration_sec": 5.06, "fps": 16.0}
                for n in range(start, min(start + 4, samples))]
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(shard, table.schema)
        writer.write_table(table, row_group_size=4)
    writer.close()
    return directory


class PeakMemory:
    """Samples the resident memory of this process and its children every 20 ms."""

    def __init__(self):
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def _total(self) -> int:
        procs = [self.process, *self.process.children(recursive=True)]
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def __enter__(self):
        self.baseline = self._total()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._total())
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure(directory: Path, workers: int, batches: int, text_tokens: int, prefetch: int) -> dict:
    import torch

    from trainer.data import DistributedBatchIterator, ParquetLatentDataset

    torch.set_num_threads(1)
    dataset = ParquetLatentDataset(str(directory), pad_text=False)
    iterator = DistributedBatchIterator(
        dataset, batch_size=1, dp_rank=0, dp_world=1, seed=0, drop_last=False,
        token_budget=VIDEO_TOKENS + text_tokens, patch_size=(1, 2, 2), num_workers=workers,
        prefetch_factor=prefetch)
    with PeakMemory() as memory:
        for _ in range(2):
            iterator.next_batch()
        start, stored = time.perf_counter(), 0
        for _ in range(batches):
            batch = iterator.next_batch()
            stored += sum(x.numel() * 2 for x in batch["latents"]) + sum(t.numel() * 2 for t in batch["text"])
        seconds = time.perf_counter() - start
    del iterator
    return {"workers": workers, "samples_per_s": batches / seconds,
            "stored_mb_per_s": stored / seconds / 1e6, "seconds": seconds,
            "peak_rss_mb": memory.peak / 1e6, "rss_above_baseline_mb": (memory.peak - memory.baseline) / 1e6}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--text-tokens", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "relay-bench-data"))
    parser.add_argument("--json", default=None)
    ns = parser.parse_args(argv)
    import pyarrow
    import torch

    directory = write_dataset(Path(ns.dir), ns.samples, ns.text_tokens)
    sample_mb = (np.prod(LATENT) + ns.text_tokens * TEXT_DIM) * 2 / 1e6
    results = [measure(directory, w, ns.batches, ns.text_tokens, ns.prefetch) for w in ns.workers]
    print(f"{'workers':>7} {'samples/s':>10} {'MB/s':>8} {'peak RSS MB':>12} {'above base MB':>14}")
    for r in results:
        print(f"{r['workers']:>7} {r['samples_per_s']:>10.2f} {r['stored_mb_per_s']:>8.0f} "
              f"{r['peak_rss_mb']:>12.0f} {r['rss_above_baseline_mb']:>14.0f}")
    report = {"sample_mb": sample_mb, "samples": ns.samples, "batches": ns.batches,
              "prefetch_factor": ns.prefetch, "results": results,
              "machine": {"host": platform.node(), "cpus": psutil.cpu_count(),
                          "memory_gb": psutil.virtual_memory().total / 1e9},
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "pyarrow": pyarrow.__version__, "numpy": np.__version__}}
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
