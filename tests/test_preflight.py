"""Issue 16: every bad run is refused before it starts, and every failure ends in a sentence.

Each test reproduces one case a hostile user found, through train.py itself (a real process),
`relay resolve` or `relay submit --dry-run`, and checks the one-paragraph error (no traceback)
or the run-result.json a user reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny" / "pretrain.yaml")


def dry_run(tmp_path: Path, *extra: str, config: str = TINY) -> subprocess.CompletedProcess:
    argv = [sys.executable, "trainer/train.py", "--config", config, "--output_dir",
            str(tmp_path / "out"), "--data_path", str(tmp_path / "data"), *extra, "--dry-run"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("relay: config error:"), proc.stderr[-2000:]
    for word in words:
        assert word in proc.stderr, proc.stderr[-2000:]


def test_an_output_dir_that_is_a_file_is_refused_at_dry_run(tmp_path):
    (tmp_path / "out").write_text("not a directory")
    refused(dry_run(tmp_path), "exists and is not a directory")


def test_an_output_dir_on_a_read_only_filesystem_is_refused_at_dry_run(tmp_path):
    target = Path("/sys/fs/relay-test-out")  # sysfs refuses writes even to root
    if not Path("/sys/fs").is_dir():
        pytest.skip("no /sys/fs on this machine to stand for a read-only filesystem")
    refused(dry_run(tmp_path, "--output_dir", str(target)), "cannot be written")


@pytest.mark.parametrize("overrides, words", [
    ('{hidden_size: 100, num_attention_heads: 3}', ("divisible by num_attention_heads",)),
    ('{rope_axes_dim: [8, 8, 4]}', ("rope_axes_dim", "head dim")),
])
def test_a_model_that_cannot_be_built_is_refused_at_dry_run(tmp_path, overrides, words):
    refused(dry_run(tmp_path, "--transformer_config_overrides", overrides),
            "cannot build a model", *words)


def test_a_missing_warm_start_path_is_refused_at_dry_run(tmp_path):
    refused(dry_run(tmp_path, "--load_transformer_weights", "true",
                    "--pretrained_transformer_path", str(tmp_path / "nowhere")),
            "pretrained_transformer_path", "does not exist")


def test_a_missing_warm_start_path_is_fine_when_the_run_resumes_its_own_checkpoint(
        tmp_path, tiny_trainer):
    out = tmp_path / "run"
    assert tiny_trainer.run(out, "--max_steps", "2").returncode == 0
    proc = subprocess.run(tiny_trainer.command(out, "--load_transformer_weights", "true",
                                               "--pretrained_transformer_path",
                                               str(tmp_path / "gone"), "--dry-run"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_context_parallel_split_that_does_not_divide_is_refused_with_its_arithmetic(tmp_path):
    # heads: 4 do not split over 3 ranks
    refused(dry_run(tmp_path, "--cp_size", "3"), "attention heads (4)", "4 / 3 = 1.33333")
    # the world: one process cannot hold a cp group of 2
    refused(dry_run(tmp_path, "--cp_size", "2"), "world size 1 is not divisible by cp_size 2")
    # the frames: 12 x 12 pixels in 4 x 4 patches are 9 tokens a frame, which 2 ranks cannot share
    two_ranks = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    argv = [sys.executable, "trainer/train.py", "--config", TINY, "--output_dir",
            str(tmp_path / "out"), "--data_path", str(tmp_path / "data"), "--cp_size", "2",
            "--synthetic_height", "12", "--synthetic_width", "12", "--dry-run"]
    refused(subprocess.run(argv, cwd=ROOT, env=two_ranks, capture_output=True, text=True,
                           timeout=120), "3 x 3 = 9 patches a frame", "divides 9")
    resolve = subprocess.run([sys.executable, "-m", "launcher.cli", "resolve", TINY,
                              "--output_dir", str(tmp_path / "o"), "--cp_size", "3"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resolve.returncode == 2 and "4 / 3 = 1.33333" in resolve.stderr, resolve.stderr


def test_a_context_parallel_split_that_divides_passes_the_dry_run(tmp_path):
    two_ranks = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    argv = [sys.executable, "trainer/train.py", "--config", TINY, "--output_dir",
            str(tmp_path / "out"), "--data_path", str(tmp_path / "data"), "--cp_size", "2",
            "--dry-run"]
    proc = subprocess.run(argv, cwd=ROOT, env=two_ranks, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world 2 = dp_replicate 1 x dp_shard 1 x cp 2" in proc.stderr


def test_a_context_parallel_split_that_does_not_divide_is_refused_by_relay_submit(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"""name: cp
root: {tmp_path / 'root'}
stages:
  pretrain:
    config: {TINY}
    overrides: {{cp_size: 2}}
""")
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(pipeline),
                           "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # the tiny pipeline asks for one GPU: no room for a cp group of 2
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "is not divisible by cp_size 2" in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_section_holding_a_scalar_is_named_as_a_section(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training: 5\n")
    refused(dry_run(tmp_path, config=str(cfg)), "`training` is a section", "holds 5")


def test_the_seed_legacy_eager_mode_key_loads_true_and_refuses_false(tmp_path):
    ok = dry_run(tmp_path, "--legacy_eager_mode", "true")
    assert ok.returncode == 0, ok.stderr[-2000:]
    refused(dry_run(tmp_path, "--legacy_eager_mode", "false"), "CUDA-graph", "eager")


@pytest.mark.parametrize("value", ["/path/to/your/data", "<PATH_TO_DATA>", "/data/changeme"])
def test_an_example_placeholder_in_a_used_path_is_refused(tmp_path, value):
    refused(dry_run(tmp_path, "--data_path", value), "`data_path`", "placeholder")


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "train.py ended before the step was reached"
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(line)["step"] >= step
                                     for line in metrics.read_text().splitlines() if line):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def test_ctrl_c_ends_interrupted_without_a_traceback(tmp_path, tiny_trainer):
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = tiny_trainer.start(out, "--max_steps", "100000", "--save_interval", "3", log=log)
    try:
        _wait_for_step(out, 4, proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "interrupted" and "Ctrl-C" in result["error"]
    assert result["last_checkpoint"] and Path(result["last_checkpoint"]).name.startswith("checkpoint-")
    assert not list(out.glob("*.tmp")), "an unfinished save was left behind"


def test_max_steps_below_the_checkpoint_says_there_is_nothing_to_do(tmp_path, tiny_trainer):
    out = tmp_path / "run"
    assert tiny_trainer.run(out, "--max_steps", "4").returncode == 0
    proc = tiny_trainer.run(out, "--max_steps", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing to train" in proc.stderr and "checkpoint-4" in proc.stderr
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "completed"
    assert result["last_checkpoint"] == str(out / "checkpoint-4")


def test_resuming_with_another_optimizer_names_the_key_and_keeps_the_runs_files(
        tmp_path, tiny_trainer):
    out = tmp_path / "run"
    assert tiny_trainer.run(out, "--max_steps", "2", "--use_muon", "true").returncode == 0
    config_before = (out / "resolved-config.json").read_text()
    manifest_before = (out / "launch-manifest.json").read_text()
    proc = tiny_trainer.run(out, "--max_steps", "4", "--use_muon", "false")
    assert proc.returncode == 2  # a configuration refusal, before anything starts
    assert "use_muon: true" in proc.stderr and "use_muon: false" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model configuration" not in proc.stderr
    # Refused before training: the intact checkpoint stays, unquarantined, and the files of the
    # run that is there are not overwritten by the one that failed to start.
    assert (out / "checkpoint-2" / "COMPLETE").is_file() and not list(out.glob("*.bad"))
    assert (out / "resolved-config.json").read_text() == config_before
    assert (out / "launch-manifest.json").read_text() == manifest_before


def test_a_training_state_that_would_run_code_is_quarantined_with_a_safe_reason(
        tmp_path, tiny_trainer):
    import torch

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    out = tmp_path / "run"
    assert tiny_trainer.run(out, "--max_steps", "4").returncode == 0
    torch.save({"format": 1, "state": RunsCode()}, out / "checkpoint-4" / "training_state.pt")
    _refresh_checksums(out / "checkpoint-4")
    proc = tiny_trainer.run(out, "--max_steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reason = (out / "checkpoint-4.bad" / "QUARANTINE_REASON").read_text()
    assert "system" in reason and "never runs it" in reason
    assert "weights_only` set to `False`" not in reason and "Re-running" not in reason
    assert "pwned" not in proc.stdout + proc.stderr


def _refresh_checksums(checkpoint: Path) -> None:
    """Record the replaced file's size and checksum in COMPLETE as relay would have, so the
    checkpoint passes validation and the load itself must refuse the file."""
    from trainer.checkpoint.checksums import digest_bytes

    complete = json.loads((checkpoint / "COMPLETE").read_text())
    name = "training_state.pt"
    data = (checkpoint / name).read_bytes()
    complete["files"][name] = len(data)
    if name in complete.get("checksums", {}):
        complete["checksums"][name] = digest_bytes(data)
    (checkpoint / "COMPLETE").write_text(json.dumps(complete))
