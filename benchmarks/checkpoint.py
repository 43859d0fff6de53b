"""Checkpoint throughput against the disk it writes to, and how long a save blocks training.

    python benchmarks/checkpoint.py [--size-mb 300] [--dir /path/on/the/checkpoint/disk]
                                    [--repeats 3] [--json benchmarks/results/checkpoint.json]
    python benchmarks/checkpoint.py --profile 15     # where one save and one cold load spend time
    python benchmarks/checkpoint.py --hash-thread on|off   # force where checksums are computed

What it measures, all in one run and on one directory (so on one disk):

1. raw disk: write a file as large as the checkpoint from a buffer as large, in 1 MiB calls,
   starting each 4 MiB's writeback once written, as relay's shard writer does, and fsync it
   (write MB/s; the same write without early writeback is recorded beside it); drop that
   file's pages from the page cache (posix_fadvise DONTNEED) and read it back into that
   buffer (cold read MB/s), then again (warm read: page cache). Measured before and after
   each repeat's saves and loads; the mean of the two is that repeat's reference.
2. save: `trainer.checkpoint.store.save_checkpoint` of a model + AdamW state of about --size-mb
   (weights are a third of it, the two moment tensors the rest), synchronous, everything
   fsynced and published (COMPLETE, rename). MB/s = bytes on disk / seconds.
3. load: `trainer.checkpoint.store.load_checkpoint` of that checkpoint into a fresh model and
   optimizer, cold (its files dropped from the page cache first) and warm. The checkpoint is
   read and loaded once, untimed, before the cold loads, so that both loads of a pair find the
   disk (and a VM host's cache of it) alike; the raw file is read once before its cold read.
4. checksums: the same save with hashing replaced by a no-op, and the same cold and warm
   loads of a checkpoint whose COMPLETE records no checksums (so nothing is verified), each
   right next to its counterpart; the cost is the median over repeats of the ratio of each
   pair. The warm pair reads from the page cache, so the disk's noise stays out of it. Also
   xxh3 alone over the checkpoint's bytes in memory.
5. blocking: `CheckpointManager` timings. Sync: `blocked_s` is the whole save. Async:
   `blocked_s` is the copy to host memory (the second save of a manager: the first also
   allocates the staging buffers); training steps then run while the background thread
   writes, and their step time is compared with steps run without a save in flight.

Each figure is the median over --repeats; a fraction of the disk's bandwidth (or a checksum
cost) is the median of each repeat's own ratio, since the disk's speed drifts between repeats.
Before each timed step the disk is left to settle (sync, half a second). A table goes to
stdout, everything to --json.
Dropping a file's cached pages needs no privileges and touches no other file. If cold and
warm reads come out alike, the kernel kept the pages (or the disk is as fast as memory): the
"cold" figures are then page-cache figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from trainer.checkpoint import checksums, dcp_files
from trainer.checkpoint.store import (
    COMPLETE_FILE,
    CheckpointManager,
    ModelMember,
    OptimizerMember,
    load_checkpoint,
    save_checkpoint,
)

# Raw I/O goes in 1 MiB calls: on the 2-core VM, 16 MiB calls wrote at less than half the
# speed (and read no faster), which made the disk look slower than it is.
CHUNK = 1 << 20
MB = 1e6


DEVICE = torch.device("cpu")  # --device: where the model and optimizer state live


def build_state(size_mb: float, width: int = 2048, seed: int = 0):
    """A stack of width x width linear layers and an AdamW that has stepped once, on DEVICE.

    Weights are 1/3 of the bytes, AdamW's exp_avg and exp_avg_sq the other 2/3.
    """
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(size_mb * MB / per_layer))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int = 16) -> None:
    x = torch.randn(batch, model[0].in_features, device=DEVICE)
    loss = model(x).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # step times are wall times


def members(model, optimizer) -> dict:
    return {"transformer": ModelMember(model), "optimizer": OptimizerMember(model, optimizer)}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_cache(path: Path) -> bool:
    """Ask the kernel to forget the cached pages of `path` (a file or every file below a dir)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def settle() -> None:
    """Let the disk finish earlier work before the next timed step.

    Deleting a checkpoint frees hundreds of MB; on a filesystem mounted with `discard` (this
    VM's root) the trims go out at the next journal commit and slow whatever is timed next.
    """
    os.sync()
    time.sleep(0.5)


def raw_write(path: Path, data: memoryview, *, early_writeback: bool) -> float:
    """Seconds to write `data` to a new file in CHUNK calls and fsync it.

    early_writeback: through relay's shard writer's `EarlyWriteback` (trainer.checkpoint.dcp_files), which
    starts each few MiB's writeback once written, so the disk works during the writes rather
    than only in the fsync. On the 2-core VM that write is the faster one: it is the reference.
    """
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        out = dcp_files.EarlyWriteback(handle) if early_writeback else handle
        for offset in range(0, len(data), CHUNK):
            out.write(data[offset:offset + CHUNK])
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def raw_read(path: Path, into: memoryview) -> float:
    """Seconds to read the file at `path` into `into` (as large as the file) in CHUNK calls."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        offset = 0
        while got := handle.readinto(into[offset:offset + CHUNK]):
            offset += got
    return time.perf_counter() - start


def raw_disk(file: Path, data: memoryview) -> tuple[float, float, float, float]:
    """(write + fsync, the same write without early writeback, cold read, warm read) seconds
    of a file holding `data`.

    The bytes come from and go to a buffer as large as a checkpoint, as a save's and a load's
    do: a small buffer reused for every call stays in the CPU cache and would make the disk
    look faster than a checkpoint can ever use it.
    """
    settle()
    plain = raw_write(file, data, early_writeback=False)
    file.unlink()
    settle()
    write = raw_write(file, data, early_writeback=True)
    read_once_cold(file)  # as before the cold loads: both find the disk alike
    drop_cache(file)
    cold = raw_read(file, data)
    warm = raw_read(file, data)
    file.unlink()
    return write, plain, cold, warm


def median(values: list[float]) -> float:
    return statistics.median(values)


class _NoHash:
    """Stands in for a hasher when measuring what checksums cost."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


@contextlib.contextmanager
def hashing_off():
    """Saves inside this block take no checksums (they record zeros: never load them), and
    start no hashing threads: the pair measures everything the checksums add."""
    saved = checksums.new_hasher, checksums.OVERLAP_MIN_BYTES
    checksums.new_hasher, checksums.OVERLAP_MIN_BYTES = _NoHash, sys.maxsize
    try:
        yield
    finally:
        checksums.new_hasher, checksums.OVERLAP_MIN_BYTES = saved


@contextlib.contextmanager
def unrecorded_checksums(path: Path):
    """The checkpoint at `path` as an older relay wrote it: COMPLETE without checksums."""
    marker = path / COMPLETE_FILE
    original = marker.read_text()
    info = json.loads(original)
    del info["checksum"], info["checksums"]
    marker.write_text(json.dumps(info))
    try:
        yield
    finally:
        marker.write_text(original)


def hash_seconds(path: Path) -> float:
    """xxh3 over every byte of the checkpoint at `path`, held in memory (no I/O timed)."""
    data = [p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()]
    start = time.perf_counter()
    for blob in data:
        checksums.digest_bytes(blob)
    return time.perf_counter() - start


def timed_sync_save(directory: Path, model, optimizer) -> tuple[Path, float]:
    with CheckpointManager(directory) as manager:
        path = manager.save(1, members=members(model, optimizer), training_state={"step": 1},
                            dataloader_state={})
        return path, manager.timings[-1].total_s


def read_once_cold(path: Path) -> None:
    """Read `path` (or every file below it) once, after dropping its pages (untimed)."""
    drop_cache(path)
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as handle:
            while handle.read(CHUNK):
                pass


def timed_load(path: Path, model, optimizer, *, cold: bool) -> float:
    if cold:
        drop_cache(path)
    settle()
    start = time.perf_counter()
    load_checkpoint(path, members(model, optimizer))
    return time.perf_counter() - start


def run(size_mb: float, work: Path, repeats: int, async_steps: int,
        baseline_steps: int = 5) -> dict:
    model, optimizer = build_state(size_mb)
    params = sum(p.numel() for p in model.parameters())
    results: dict = {"repeats": repeats, "parameters": params}

    # Warm up allocation and DCP's imports and planners (the first save is slower).
    save_checkpoint(work / "warmup", 0, members=members(model, optimizer),
                    training_state={"step": 0}, dataloader_state={})
    ckpt_bytes = dir_bytes(work / "warmup" / "checkpoint-0")
    shutil.rmtree(work / "warmup")
    results["checkpoint_bytes"] = ckpt_bytes

    # One repeat measures everything once, so load from other processes spreads evenly.
    raw = {key: [] for key in ("write_s", "write_plain_s", "read_cold_s", "read_warm_s")}
    raw.update({key.replace("_s", "_before_and_after_s"): [] for key in list(raw)})
    save = {"save_s": [], "load_cold_s": [], "load_warm_s": []}
    check = {"save_without_s": [], "load_cold_without_s": [], "load_warm_without_s": [],
             "hash_in_memory_s": []}
    blocking = {"sync_blocked_s": [], "async_blocked_s": [], "async_total_s": [],
                "async_wait_at_end_s": [], "steps_during_async_save": [],
                "step_s_during_async_save": [], "step_s_without_save": []}
    fresh_model, fresh_optimizer = build_state(size_mb, seed=1)
    data = memoryview(bytearray(os.urandom(ckpt_bytes)))  # incompressible, like weights
    for i in range(repeats):
        before = raw_disk(work / f"raw-{i}.bin", data)

        # Sync: the whole save (write, fsync, COMPLETE, rename) blocks the training thread.
        # With and without checksums, in turn first, so that drift hits both alike.
        for with_checksums in (i % 2 == 0, i % 2 != 0):
            directory = work / f"sync-{i}-{'with' if with_checksums else 'without'}"
            settle()
            with contextlib.nullcontext() if with_checksums else hashing_off():
                path, seconds = timed_sync_save(directory, model, optimizer)
            if with_checksums:
                kept = path
                save["save_s"].append(seconds)
                blocking["sync_blocked_s"].append(seconds)
            else:
                check["save_without_s"].append(seconds)
                shutil.rmtree(directory)
        path = kept
        # On the VM the first read of a checkpoint just written is about 3x slower than the next
        # ones (the host is still writing the disk image), and the first load after that still
        # about 1.6x: without this untimed read and load, the first load of each cold pair,
        # with or without checksums, paid for it.
        read_once_cold(path)
        timed_load(path, fresh_model, fresh_optimizer, cold=True)
        for cold, with_key, without_key in ((True, "load_cold_s", "load_cold_without_s"),
                                            (False, "load_warm_s", "load_warm_without_s")):
            for with_checksums in (i % 2 == 0, i % 2 != 0):
                with contextlib.nullcontext() if with_checksums else unrecorded_checksums(path):
                    seconds = timed_load(path, fresh_model, fresh_optimizer, cold=cold)
                (save[with_key] if with_checksums else check[without_key]).append(seconds)
        check["hash_in_memory_s"].append(hash_seconds(path))
        # The load really restored what was saved (the model has not stepped since).
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     fresh_model.state_dict().values()))
        shutil.rmtree(path.parent)
        # The disk is measured before and after the saves and loads, and the mean is the
        # reference: its speed drifts over seconds on a shared VM.
        after = raw_disk(work / f"raw-{i}.bin", data)
        for key, first, second in zip(("write_s", "write_plain_s", "read_cold_s", "read_warm_s"),
                                      before, after):
            raw[key].append((first + second) / 2)
            raw[key.replace("_s", "_before_and_after_s")].append([first, second])

        # Async: blocked while staging to host memory; steps overlap the background write.
        baseline = []
        for _ in range(2):  # untimed: the first steps after a load touch fresh memory
            train_step(model, optimizer)
        for _ in range(baseline_steps):
            start = time.perf_counter()
            train_step(model, optimizer)
            baseline.append(time.perf_counter() - start)
        blocking["step_s_without_save"].append(median(baseline))
        with CheckpointManager(work / f"async-{i}", async_save=True) as manager:
            # The first save allocates the host staging buffers; a run reuses them, so time the
            # second.
            manager.save(1, members=members(model, optimizer), training_state={"step": 1},
                         dataloader_state={})
            manager.wait()
            manager.save(2, members=members(model, optimizer), training_state={"step": 2},
                         dataloader_state={})
            steps = []
            future = manager._in_flight  # private: only to stop stepping once the write is done
            while len(steps) < async_steps and future is not None and not future.done():
                start = time.perf_counter()
                train_step(model, optimizer)
                steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.wait()
            blocking["async_wait_at_end_s"].append(time.perf_counter() - start)
            timing = manager.timings[-1]
        blocking["async_blocked_s"].append(timing.blocked_s)
        blocking["async_total_s"].append(timing.total_s)
        blocking["steps_during_async_save"].append(len(steps))
        blocking["step_s_during_async_save"].append(median(steps) if steps else float("nan"))
        shutil.rmtree(work / f"async-{i}")
        settle()
    results["cache_drop"] = "posix_fadvise(DONTNEED)" if hasattr(os, "posix_fadvise") else "unavailable"

    results["raw"] = raw
    results["checkpoint"] = save
    results["checksums"] = check
    results["blocking"] = blocking
    mb = ckpt_bytes / MB

    def pair_cost(with_s: list[float], without_s: list[float]) -> float:
        return median([a / b for a, b in zip(with_s, without_s)]) - 1
    results["summary"] = {
        "checkpoint_mb": mb,
        "disk_write_mb_s": mb / median(raw["write_s"]),
        "disk_write_plain_mb_s": mb / median(raw["write_plain_s"]),
        "disk_read_cold_mb_s": mb / median(raw["read_cold_s"]),
        "disk_read_warm_mb_s": mb / median(raw["read_warm_s"]),
        "save_mb_s": mb / median(save["save_s"]),
        "load_cold_mb_s": mb / median(save["load_cold_s"]),
        # Each repeat's own pair: the disk's speed drifts more between repeats than within one.
        "save_of_disk_write": median([d / c for d, c in zip(raw["write_s"], save["save_s"])]),
        "save_of_disk_write_plain": median([d / c for d, c in zip(raw["write_plain_s"],
                                                                  save["save_s"])]),
        "load_cold_of_disk_read": median([d / c for d, c in zip(raw["read_cold_s"],
                                                                save["load_cold_s"])]),
        "load_warm_mb_s": mb / median(save["load_warm_s"]),
        "checksum_cost_save": pair_cost(save["save_s"], check["save_without_s"]),
        "checksum_cost_load_cold": pair_cost(save["load_cold_s"], check["load_cold_without_s"]),
        # From the page cache: no disk noise, so the hashing's own cost shows most clearly.
        "checksum_cost_load_warm": pair_cost(save["load_warm_s"], check["load_warm_without_s"]),
        "save_without_checksums_mb_s": mb / median(check["save_without_s"]),
        "load_cold_without_checksums_mb_s": mb / median(check["load_cold_without_s"]),
        "hash_in_memory_mb_s": mb / median(check["hash_in_memory_s"]),
        "sync_blocked_s": median(blocking["sync_blocked_s"]),
        "async_blocked_s": median(blocking["async_blocked_s"]),
        "async_total_s": median(blocking["async_total_s"]),
        "step_s_without_save": median(blocking["step_s_without_save"]),
        "step_s_during_async_save": median(blocking["step_s_during_async_save"]),
        "steps_during_async_save": median(blocking["steps_during_async_save"]),
    }
    return results


def environment() -> dict:
    return {
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "hash_on_a_second_thread": checksums.HASH_BESIDE,
        "cpu_model": _cpu_model(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def print_table(summary: dict) -> None:
    s = summary
    rows = [
        ("checkpoint size", f"{s['checkpoint_mb']:.0f} MB (weights + AdamW moments)"),
        ("disk write + fsync", f"{s['disk_write_mb_s']:.0f} MB/s (without early writeback: "
                               f"{s['disk_write_plain_mb_s']:.0f} MB/s)"),
        ("disk read, cold / warm", f"{s['disk_read_cold_mb_s']:.0f} / {s['disk_read_warm_mb_s']:.0f} MB/s"),
        ("save (sync, published)", f"{s['save_mb_s']:.0f} MB/s = "
                                   f"{s['save_of_disk_write']:.0%} of disk write, "
                                   f"{s['save_of_disk_write_plain']:.0%} of the plain write"),
        ("load, cold / warm", f"{s['load_cold_mb_s']:.0f} / {s['load_warm_mb_s']:.0f} MB/s = "
                              f"{s['load_cold_of_disk_read']:.0%} of cold read"),
        ("checksums: save / cold / warm load", f"{s['checksum_cost_save']:+.1%} / "
                                               f"{s['checksum_cost_load_cold']:+.1%} / "
                                               f"{s['checksum_cost_load_warm']:+.1%} time "
                                               f"(without: {s['save_without_checksums_mb_s']:.0f}"
                                               f" / {s['load_cold_without_checksums_mb_s']:.0f}"
                                               f" MB/s)"),
        ("xxh3 alone, in memory", f"{s['hash_in_memory_mb_s']:.0f} MB/s"),
        ("training blocked, sync save", f"{s['sync_blocked_s']:.2f} s"),
        ("training blocked, async save", f"{s['async_blocked_s']:.2f} s (write in background: "
                                         f"{s['async_total_s']:.2f} s in all)"),
        ("step time, no save / during async write",
         f"{s['step_s_without_save'] * 1e3:.0f} / {s['step_s_during_async_save'] * 1e3:.0f} ms "
         f"({s['steps_during_async_save']:.0f} steps overlapped)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def profile(size_mb: float, work: Path, top: int) -> None:
    """Print the `top` functions by own time of one sync save and one cold load (cProfile)."""
    import cProfile
    import pstats

    model, optimizer = build_state(size_mb)
    fresh_model, fresh_optimizer = build_state(size_mb, seed=1)
    timed_sync_save(work / "warmup", model, optimizer)  # imports and planners, untimed
    for what in ("save", "load"):
        settle()
        profiler = cProfile.Profile()
        if what == "save":
            profiler.enable()
            path, _ = timed_sync_save(work / "profiled", model, optimizer)
        else:
            drop_cache(path)
            profiler.enable()
            load_checkpoint(path, members(fresh_model, fresh_optimizer))
        profiler.disable()
        print(f"== one {what} of {dir_bytes(path) / MB:.0f} MB, by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300.0,
                        help="model + optimizer state to save, in MB (default 300)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the disk to measure (default: a temp dir in /tmp)")
    parser.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    parser.add_argument("--async-steps", type=int, default=50,
                        help="at most this many training steps overlap an async save")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--device", default="cpu",
                        help="where the model and optimizer live: cpu (default) or cuda")
    parser.add_argument("--hash-thread", choices=("auto", "on", "off"), default="auto",
                        help="hash on a second thread beside writes and reads: auto (relay's "
                             "choice: where more than two cores are usable), on, off")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="instead: profile one save and one cold load, print the TOP functions")
    ns = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(ns.device)
    if ns.hash_thread != "auto":
        checksums.HASH_BESIDE = ns.hash_thread == "on"
    base = ns.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="relay-ckpt-bench-", dir=base))
    if ns.profile:
        try:
            profile(ns.size_mb, work, ns.profile)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    try:
        env = environment()
        started = time.time()
        results = run(ns.size_mb, work, ns.repeats, ns.async_steps)
        results["environment"] = env
        results["directory"] = str(base.resolve())
        results["command"] = " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])
        results["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"relay checkpoint benchmark: torch {env['torch']}, state on {env['device']}, "
          f"{env['cpus']} CPUs ({env['cpu_model']}), {results['directory']}, "
          f"median of {ns.repeats}, hashing "
          f"{'on a second thread' if checksums.HASH_BESIDE else 'inline'}")
    print_table(results["summary"])
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
