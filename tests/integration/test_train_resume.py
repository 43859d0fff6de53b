"""The trainer survives being killed, preempted and corrupted: real train.py processes.

Every run here uses the tiny deterministic configuration of the `tiny_trainer` fixture
(tests/conftest.py), so a run that was interrupted and restarted must log exactly the loss
trajectory (step -> loss, bit for bit) of the uninterrupted reference run, with no step
missing or repeated. Processes are real, signals are real (SIGKILL, SIGUSR2), and nothing in
the trainer is mocked.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.ports import free_port

from trainer.checkpoint.layout import (
    COMPLETE_FILE,
    QUARANTINE_REASON_FILE,
    list_checkpoints,
    read_complete,
    validate_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
PREEMPTED = 75  # trainer.runtime.preemption.PREEMPTED_EXIT_CODE (imported there with torch)
STEPS = list(range(1, 13))  # the tiny configuration's max_steps is 12


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} unreadable)"


def _logged_steps(out: Path) -> list[int]:
    """Steps of the complete records in metrics.jsonl (a line cut by a kill is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def _wait_until(condition, proc: subprocess.Popen, log: Path, timeout: float = 120,
                poll: float = 0.02) -> bool:
    """Poll `condition()` until it is true (True) or `proc` exits first (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    proc.kill()
    pytest.fail(f"timed out after {timeout} s waiting for the run; log:\n{_tail(log)}")


def _unfinished(out: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(out) if n.endswith(".tmp") and n.startswith("checkpoint-"))
    except FileNotFoundError:
        return []


def _published_steps(out: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_checkpoints(out)]


def _sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _assert_same_trajectory(tiny_trainer, out: Path, log: Path) -> None:
    reference = tiny_trainer.losses(tiny_trainer.reference())
    got = tiny_trainer.losses(out)
    assert [s for s, _ in got] == STEPS, f"steps logged: {[s for s, _ in got]}\n{_tail(log)}"
    # Exact equality of the floats: a resumed run must be bit-identical, not merely close.
    assert got == reference, f"loss trajectory differs from the uninterrupted run:\n{got}\n{reference}"


def _assert_all_checkpoints_valid(out: Path) -> None:
    assert not _unfinished(out), _unfinished(out)
    for path in list_checkpoints(out):
        validate_checkpoint(path)
    assert json.loads((out / "run-result.json").read_text())["status"] == "completed"


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments
# ---------------------------------------------------------------------------------------------

# Per trial: the kills before the run may finish, and whether saves are asynchronous. "save"
# kills as soon as checkpoint-N.tmp appears for a random N (mid-save; with async saves the
# background thread is writing it while steps go on); "step" kills as soon as a random step N
# of this attempt is logged: before that step's save when N is even, between steps when it is
# odd. Kills follow their condition at once (1 ms polls), never a sleep, and at least two
# steps remain after every target, so a fast machine cannot finish first.
KILL_TRIALS = [(("save", "step"), False), (("step",), False), (("save",), True)]


def _last_logged_step(out: Path) -> int:
    steps = _logged_steps(out)
    return steps[-1] if steps else 0


def test_sigkill_during_steps_and_sync_or_async_saves_then_restart_gives_the_same_losses(
        tiny_trainer, tmp_path):
    tiny_trainer.reference()
    rng = random.Random(20240611)
    mid_save_kills, kills = 0, []
    for trial, (plan, async_save) in enumerate(KILL_TRIALS):
        out, log = tmp_path / f"trial-{trial}", tmp_path / f"trial-{trial}.log"
        extra = ("--async_checkpoint", "true") if async_save else ()
        for kind in plan:
            offset = log.stat().st_size if log.exists() else 0
            resumes_at = max(_published_steps(out), default=0)
            proc = tiny_trainer.start(out, *extra, log=log)
            # Kill only once a checkpoint is published: a kill during the very first save leaves
            # only checkpoint-N.tmp, and resume refuses to start fresh over it (by design).
            first = max(resumes_at, 2)
            if kind == "save":
                target = min(first + 2 * rng.randint(1, 2), 10)
                _wait_until(lambda: f"checkpoint-{target}.tmp" in _unfinished(out), proc, log,
                            poll=0.001)
            else:
                target = rng.randint(first + 1, min(first + 4, 10))

                def training_past_target() -> bool:
                    if _last_logged_step(out) < target or not _published_steps(out):
                        return False  # the cheap checks first: this runs every millisecond
                    text = log.read_text(errors="replace")[offset:]
                    return "resumed from" in text or "starting fresh" in text

                _wait_until(training_past_target, proc, log, poll=0.001)
            assert proc.poll() is None, f"trial {trial}: the run ended before its {kind} kill"
            _sigkill(proc)
            kills.append((trial, kind, target))
            mid_save_kills += kind == "save" and f"checkpoint-{target}.tmp" in _unfinished(out)
        proc = tiny_trainer.start(out, *extra, log=log)
        assert proc.wait(timeout=180) == 0, f"trial {trial}:\n{_tail(log)}"
        _assert_same_trajectory(tiny_trainer, out, log)
        # Complete checkpoints only, the last one the final step's, and no failed background save.
        _assert_all_checkpoints_valid(out)
        assert _published_steps(out)[-1] == STEPS[-1]
        result = json.loads((out / "run-result.json").read_text())
        assert result["last_checkpoint"] == str(out / f"checkpoint-{STEPS[-1]}")
        assert "background save" not in log.read_text()
    # A kill that the restart survived without ever meeting a half-written checkpoint would
    # prove little: at least one must have left its checkpoint-N.tmp behind.
    assert mid_save_kills >= 1, f"no kill landed while a checkpoint-N.tmp was being written: {kills}"


# ---------------------------------------------------------------------------------------------
# Preemption: SIGUSR2
# ---------------------------------------------------------------------------------------------

def test_sigusr2_saves_at_the_next_step_boundary_exits_75_and_the_restart_completes_identically(
        tiny_trainer, tmp_path):
    tiny_trainer.reference()
    out, log = tmp_path / "preempt", tmp_path / "preempt.log"
    proc = tiny_trainer.start(out, log=log)
    assert _wait_until(lambda: max(_logged_steps(out), default=0) >= 3, proc, log), _tail(log)
    seen = max(_logged_steps(out))
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=120) == PREEMPTED, _tail(log)

    result = json.loads((out / "run-result.json").read_text())
    stopped = result["step"]
    assert result["status"] == "preempted" and result["error"] is None
    assert seen <= stopped < STEPS[-1], (seen, stopped)
    assert result["last_checkpoint"] == str(out / f"checkpoint-{stopped}")
    assert read_complete(out / f"checkpoint-{stopped}")["step"] == stopped
    validate_checkpoint(out / f"checkpoint-{stopped}")
    # It stopped at the boundary of the step it saved: nothing ran past it.
    assert max(_logged_steps(out)) == stopped
    assert f"preemption signal SIGUSR2: saved checkpoint-{stopped}, exiting with code 75" in \
        log.read_text()

    proc = tiny_trainer.start(out, log=log)
    assert proc.wait(timeout=180) == 0, _tail(log)
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in log.read_text()
    _assert_same_trajectory(tiny_trainer, out, log)
    _assert_all_checkpoints_valid(out)


# ---------------------------------------------------------------------------------------------
# Corrupt checkpoints
# ---------------------------------------------------------------------------------------------

def _garble_same_size(path: Path) -> None:
    """Overwrite a file with garbage of the same length (so only loading can notice)."""
    path.write_bytes(bytes((i * 37 + 11) % 256 for i in range(path.stat().st_size)))


def _copy_run(src: Path, dst: Path, keep: list[int] | None = None) -> Path:
    shutil.copytree(src, dst)
    for path in list_checkpoints(dst):
        if keep is not None and int(path.name.split("-")[1]) not in keep:
            shutil.rmtree(path)
    return dst


def test_restart_falls_back_past_each_kind_of_corrupt_checkpoint_and_quarantines_them(
        tiny_trainer, tmp_path):
    out = _copy_run(tiny_trainer.reference(), tmp_path / "corrupt")
    log = tmp_path / "corrupt.log"
    assert _published_steps(out) == [2, 4, 6, 8, 10, 12]
    shard = out / "checkpoint-12" / "transformer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])   # truncated shard
    _garble_same_size(out / "checkpoint-10" / "transformer" / ".metadata")  # unreadable DCP metadata
    _garble_same_size(out / "checkpoint-8" / "training_state.pt")        # unreadable training state
    (out / "checkpoint-6" / COMPLETE_FILE).unlink()                        # no completion marker
    for child in (out / "checkpoint-4").iterdir():                         # emptied directory
        shutil.rmtree(child) if child.is_dir() else child.unlink()

    proc = tiny_trainer.start(out, "--save_total_limit", "0", log=log)
    assert proc.wait(timeout=180) == 0, _tail(log)
    text = log.read_text()

    # The newest three were tried, failed for their own reason, and were set aside.
    reasons = {step: (out / f"checkpoint-{step}.bad" / QUARANTINE_REASON_FILE).read_text()
               for step in (12, 10, 8)}
    assert "validation failed" in reasons[12] and "bytes" in reasons[12], reasons[12]
    assert "load failed" in reasons[10] and ".metadata" in reasons[10], reasons[10]
    assert "load failed" in reasons[8] and "training_state.pt" in reasons[8], reasons[8]
    for step in (12, 10, 8):
        assert f"quarantined checkpoint-{step} as checkpoint-{step}.bad" in text
    # Directories without COMPLETE are reported and never loaded.
    for step in (6, 4):
        assert f"checkpoint-{step} has no COMPLETE marker" in text
    assert f"resumed from {out / 'checkpoint-2'}" in text

    # Training went on from step 2 exactly as the uninterrupted run did, and saved afresh.
    _assert_same_trajectory(tiny_trainer, out, log)
    _assert_all_checkpoints_valid(out)
    assert _published_steps(out) == [2, 4, 6, 8, 10, 12]
    # The unmarked directories were kept for inspection when their step was saved again.
    for step in (6, 4):
        assert "replaced by a new save" in \
            (out / f"checkpoint-{step}.bad" / QUARANTINE_REASON_FILE).read_text()


def test_restart_quarantines_a_model_shard_with_8_flipped_bytes_and_resumes_from_the_previous(
        tiny_trainer, tmp_path):
    # Bit rot keeps the size: only the checksum in COMPLETE can tell the shard changed.
    out = _copy_run(tiny_trainer.reference(), tmp_path / "bitrot", keep=[10, 12])
    log = tmp_path / "bitrot.log"
    shard = out / "checkpoint-12" / "transformer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    shard.write_bytes(bytes(data))
    validate_checkpoint(out / "checkpoint-12")  # sizes alone pass

    proc = tiny_trainer.start(out, "--save_total_limit", "0", log=log)
    assert proc.wait(timeout=180) == 0, _tail(log)
    reason = (out / "checkpoint-12.bad" / QUARANTINE_REASON_FILE).read_text()
    assert "checksum mismatch" in reason and "__0_0.distcp" in reason, reason
    assert f"resumed from {out / 'checkpoint-10'}" in log.read_text()
    # Steps 11 and 12 ran again from intact weights: the same losses as the uninterrupted run.
    reference = dict(tiny_trainer.losses(tiny_trainer.reference()))
    assert [(s, l) for s, l in tiny_trainer.losses(out) if s > 10] == [(11, reference[11]),
                                                                       (12, reference[12])]
    _assert_all_checkpoints_valid(out)


def test_restart_with_its_only_checkpoint_corrupt_fails_clearly_and_does_not_start_fresh(
        tiny_trainer, tmp_path):
    out = _copy_run(tiny_trainer.reference(), tmp_path / "only", keep=[2])
    log = tmp_path / "only.log"
    shard = out / "checkpoint-2" / "optimizer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    metrics_before = (out / "metrics.jsonl").read_bytes()

    proc = tiny_trainer.start(out, log=log)
    assert proc.wait(timeout=180) == 1, _tail(log)
    text = log.read_text()
    assert "holds checkpoints but none can be loaded" in text and "Refusing to start fresh" in text
    assert "Traceback" not in text
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "failed" and "none can be loaded" in result["error"]
    assert result["last_checkpoint"] is None
    # Nothing was trained or saved: no fresh start over the old run.
    assert list_checkpoints(out) == []
    assert (out / "checkpoint-2.bad").is_dir()
    assert (out / "metrics.jsonl").read_bytes() == metrics_before
    assert "starting fresh" not in text


def test_restart_with_a_lower_learning_rate_trains_on_at_it_and_says_so(tiny_trainer, tmp_path):
    out = _copy_run(tiny_trainer.reference(), tmp_path / "lower-lr", keep=[6])
    proc = tiny_trainer.run(out, "--learning_rate", "2.5e-4", "--save_total_limit", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-6'}" in proc.stderr
    assert "peak learning rate(s) changed since checkpoint-6 was saved (0.0015 -> 0.00025)" in \
        proc.stderr
    # Key by key (the copied run also has another output_dir), and nothing else.
    changes = proc.stderr.split("checkpoint-6 was saved with other arguments; this run uses: ")[1]
    changed = changes.splitlines()[0].split("; ")
    assert changed[0] == "learning_rate 0.0015 -> 0.00025" and len(changed) == 2, changed
    assert changed[1].startswith('output_dir "/'), changed
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # The tiny schedule is constant after 4 warm-up steps: the new peak from step 7 on, for
    # AdamW's groups; Muon's own LR did not change.
    assert [records[step]["lr"] for step in (7, 12)] == [2.5e-4, 2.5e-4]
    assert records[7]["muon_lr"] == 0.03  # config/tiny/pretrain.yaml


# ---------------------------------------------------------------------------------------------
# Two processes (torchrun, gloo)
# ---------------------------------------------------------------------------------------------

def _torchrun(tiny_trainer, out: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(REPO / "trainer" / "train.py"),
               *tiny_trainer.args(out)]
    with open(log, "ab") as handle:
        return subprocess.Popen(command, cwd=REPO, env=tiny_trainer.env(), stdout=handle,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _worker_with_rank(agent: subprocess.Popen, rank: int) -> int:
    import psutil

    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun {agent.pid}")


def test_two_process_run_preempted_on_one_rank_resumes_and_continues_on_one_process(
        tiny_trainer, tmp_path):
    out, log = tmp_path / "ddp", tmp_path / "ddp.log"
    agent = _torchrun(tiny_trainer, out, log)
    assert _wait_until(lambda: max(_logged_steps(out), default=0) >= 3, agent, log,
                       timeout=240), _tail(log)
    # torchrun's agent dies on SIGUSR2, so the signal goes to a worker: rank 1 alone. Both
    # ranks must still agree to stop, save together and exit 75.
    os.kill(_worker_with_rank(agent, 1), signal.SIGUSR2)
    # torchrun turns its workers' 75 into a failure of its own (exit 1): run-result.json and
    # the worker exit codes in its log are what say "preempted".
    assert agent.wait(timeout=180) != 0, _tail(log)
    assert "exitcode  : 75" in log.read_text()
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "preempted", _tail(log)
    stopped = result["step"]
    info = validate_checkpoint(out / f"checkpoint-{stopped}")
    assert (info["world_size"], info["dp_world"]) == (2, 2)
    assert {"dataloader/0.json", "dataloader/1.json"} <= set(info["files"])
    assert max(_logged_steps(out)) == stopped

    agent = _torchrun(tiny_trainer, out, log)
    assert agent.wait(timeout=240) == 0, _tail(log)
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in log.read_text()
    assert _logged_steps(out) == STEPS
    _assert_all_checkpoints_valid(out)
    final = out / "checkpoint-12"
    cursors = [json.loads((final / "dataloader" / f"{r}.json").read_text()) for r in (0, 1)]
    # 64 samples / (4 per rank x 2 ranks) = 8 steps an epoch: 12 steps end at epoch 1, batch 4
    # (16 samples in). A data stream restarted at the resume would be elsewhere.
    assert [(c["dp_rank"], c["cursor"]["streams"]["all"]) for c in cursors] == [
        (0, {"epoch": 1, "position": 16}), (1, {"epoch": 1, "position": 16})]

    # One process takes over both ranks' global data stream (8 samples a step, as before).
    single = tiny_trainer.run(out, "--max_steps", "14", "--train_batch_size", "8")
    assert single.returncode == 0, single.stdout + single.stderr
    assert "resharding the weights and optimizer state" in single.stderr
    assert f"resumed from {final}" in single.stderr
    assert "Traceback" not in single.stderr
    assert _logged_steps(out) == list(range(1, 15))
    info = validate_checkpoint(out / "checkpoint-14")
    assert (info["world_size"], info["dp_world"]) == (1, 1)
    cursor = json.loads((out / "checkpoint-14" / "dataloader" / "0.json").read_text())
    # 14 steps of 8 over 64 samples: epoch 1, 6 batches (48 samples) in.
    assert cursor["cursor"]["streams"]["all"] == {"epoch": 1, "position": 48}


# ---------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------

def test_warm_started_run_starts_fresh_from_the_source_and_resumes_itself_after_a_restart(
        tiny_trainer, tmp_path):
    source = tiny_trainer.reference()
    out, log = tmp_path / "sft", tmp_path / "sft.log"
    extra = ("--load_transformer_weights", "true", "--pretrained_transformer_path", str(source),
             "--data_path", str(tmp_path / "data-sft"),
             # Keep every checkpoint: on a fast machine the preemption can land after step 6,
             # and the tiny SFT config's save_total_limit 2 would prune checkpoint-2.
             "--save_total_limit", "0")
    proc = tiny_trainer.start(out, *extra, config="sft", log=log)
    assert _wait_until(lambda: max(_logged_steps(out), default=0) >= 3, proc, log), _tail(log)
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=120) == PREEMPTED, _tail(log)
    stopped = json.loads((out / "run-result.json").read_text())["step"]
    first_run = log.read_text()

    warm = json.loads((out / "warm-start.json").read_text())
    assert warm["source"] == str(source / "checkpoint-12" / "transformer")
    assert warm["member"] == "transformer" and warm["weights"] == "live"
    assert warm["loaded"] and warm["missing"] == [] and warm["unexpected"] == []
    assert "warm start from" in first_run
    # Step 0 with a fresh schedule: step 1 trains at the first warm-up LR (a quarter of the
    # peak, with warmup_steps 4), not where the source run's schedule ended.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1
    resolved = json.loads((out / "resolved-config.json").read_text())
    assert records[0]["lr"] == pytest.approx(resolved["learning_rate"] / 4, rel=1e-12)
    # A fresh optimizer: AdamW's step count in checkpoint-2 is 2, not the source's 12 + 2.
    from trainer.checkpoint.dcp_io import read_dcp_state_dict

    optimizer = read_dcp_state_dict(out / "checkpoint-2" / "optimizer")
    counts = {float(v) for k, v in optimizer.items() if k.endswith(".step")}
    assert counts == {2.0}
    warm_bytes = (out / "warm-start.json").read_bytes()

    proc = tiny_trainer.start(out, *extra, config="sft", log=log)
    assert proc.wait(timeout=180) == 0, _tail(log)
    second_run = log.read_text()[len(first_run):]
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in second_run
    assert "warm start from" not in second_run
    assert (out / "warm-start.json").read_bytes() == warm_bytes
    assert _logged_steps(out) == STEPS
    _assert_all_checkpoints_valid(out)
