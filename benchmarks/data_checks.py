"""How long the data check before a job takes (trainer.data.checks) on many shards.

    python benchmarks/data_checks.py [--shards 10000] [--rows 8] [--dir DIR] [--repeats 3]
                                     [--json benchmarks/results/data-checks.json]

Writes --shards parquet files in FastVideo's layout (worker_<k>/ folders of 1,000 files), each
of --rows rows in row groups of 4: a bfloat16 latent [16, 3, 8, 8] (6 KB) and a caption
[16, 64] (2 KB) per row, so the dataset holds more tensor bytes than the check reads (64 MB).
Then times, --repeats times each: `scan_data` (every footer and shape column, plus the tensor
bytes of the row groups the byte budget covers) with the default budget and with none, and
`relay resolve` on a config pointing at the data (a new process: imports, the config, every
preflight check). The files are in the page cache (written just before): on a shared
filesystem the first read of each footer adds its latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LATENT, TEXT = (16, 3, 8, 8), (16, 64)
PER_FOLDER = 1000


def write_dataset(directory: Path, shards: int, rows: int) -> Path:
    """--shards files of --rows rows (kept between runs when the count matches)."""
    marker = directory / "written.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"shards": shards, "rows": rows}:
        return directory
    rng = np.random.default_rng(0)
    latent = rng.integers(0, 2**16, size=(rows, int(np.prod(LATENT))), dtype=np.uint16)
    text = rng.integers(0, 2**16, size=(rows, int(np.prod(TEXT))), dtype=np.uint16)
    for shard in range(shards):
        folder = directory / f"worker_{shard // PER_FOLDER}"
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.table({
            "id": [f"s{shard}-{r}" for r in range(rows)],
            "caption": ["a benchmark clip"] * rows,
            "media_type": ["video"] * rows,
            "vae_latent_bytes": [latent[r].tobytes() for r in range(rows)],
            "vae_latent_shape": [list(LATENT)] * rows,
            "vae_latent_dtype": ["bfloat16"] * rows,
            "text_embedding_bytes": [text[r].tobytes() for r in range(rows)],
            "text_embedding_shape": [list(TEXT)] * rows,
            "text_embedding_dtype": ["bfloat16"] * rows,
        })
        pq.write_table(table, folder / f"data_chunk_{shard % PER_FOLDER}.parquet", row_group_size=4)
    marker.write_text(json.dumps({"shards": shards, "rows": rows}))
    return directory


def _times(function, repeats: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return times, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "relay-bench-checks"))
    parser.add_argument("--json", default=None)
    ns = parser.parse_args(argv)
    from trainer.data.checks import BYTE_BUDGET, scan_data

    load_at_start = os.getloadavg()
    start = time.perf_counter()
    directory = write_dataset(Path(ns.dir), ns.shards, ns.rows)
    print(f"data: {ns.shards} shards x {ns.rows} rows in {directory} "
          f"({time.perf_counter() - start:.0f} s to write or find)")
    full, scan = _times(lambda: scan_data(str(directory)), ns.repeats)
    footers, _ = _times(lambda: scan_data(str(directory), byte_budget=0), ns.repeats)
    config = Path(ns.dir) / "check.yaml"
    config.write_text(json.dumps({
        "transformer_config_overrides": {"in_channels": 16, "text_dim": 64, "hidden_size": 32,
                                         "num_attention_heads": 2, "num_layers": 1,
                                         "patch_size": [1, 2, 2], "rope_axes_dim": [4, 6, 6]},
        "data_path": str(directory), "output_dir": str(Path(ns.dir) / "out"),
        "validation_interval": -1}))
    resolve, _ = _times(lambda: subprocess.run(
        [sys.executable, "-m", "launcher.cli", "resolve", str(config)], cwd=ROOT, check=True,
        capture_output=True), ns.repeats)
    stored = sum(pq.ParquetFile(s.path).metadata.row_group(g).column(c).total_compressed_size
                 for s in scan.shards[:1] for g in range(pq.ParquetFile(s.path).metadata.num_row_groups)
                 for c in (3, 6)) * ns.shards
    report = {
        "shards": ns.shards, "rows": scan.rows, "rows_verified": scan.rows_verified,
        "tensor_bytes_stored_mb": stored / 2**20, "byte_budget_mb": BYTE_BUDGET / 2**20,
        "scan_s": full, "scan_footers_and_shapes_only_s": footers, "relay_resolve_s": resolve,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                    "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
        "versions": {"python": platform.python_version(), "pyarrow": pa.__version__,
                     "numpy": np.__version__}}
    print(f"rows {scan.rows}, bytes verified for {scan.rows_verified} rows "
          f"(budget {BYTE_BUDGET / 2**20:.0f} MB of {stored / 2**20:.0f} MB stored)")
    for name in ("scan_s", "scan_footers_and_shapes_only_s", "relay_resolve_s"):
        print(f"{name}: median {statistics.median(report[name]):.2f} s, runs "
              f"{', '.join(f'{t:.2f}' for t in report[name])}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
