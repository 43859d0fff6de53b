"""launcher/job.py: what a rank does after train.py returns, without Slurm (train.main faked)."""

from __future__ import annotations

import os
import signal
import time

import pytest

import launcher.job as job
from launcher.job import PREEMPTED, StageFailed, StageJob, decide_after_exit


class Requeued(Exception):
    pass


@pytest.fixture
def fake_train(monkeypatch, tmp_path):
    """Replace trainer.train.main; record requeues instead of calling scontrol."""
    from trainer import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no rank export from Slurm
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")

    def fake_requeue(stage, restarts, max_requeues):
        raise Requeued((stage, restarts, max_requeues))

    monkeypatch.setattr(job, "requeue_this_job", fake_requeue)

    def use(main):
        monkeypatch.setattr(train, "main", main)
        return StageJob(stage="pretrain", train_argv=["--config", "x.yaml"], workdir=str(tmp_path),
                        output_dir=str(tmp_path / "out"), max_requeues=3)

    return use


def test_completed_training_returns_and_passes_the_argv(fake_train):
    seen = []
    stage_job = fake_train(lambda argv: seen.append(argv) or 0)
    assert stage_job()["status"] == "completed"
    assert seen == [["--config", "x.yaml"]]


def test_preempted_rank_zero_requeues_with_the_restart_count(fake_train, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Requeued) as info:
        fake_train(lambda argv: PREEMPTED)()
    assert info.value.args[0] == ("pretrain", 1, 3)


def test_preempted_other_ranks_leave_the_requeue_to_rank_zero(fake_train, monkeypatch):
    monkeypatch.setattr(job, "export_rank_environment", lambda: 1)
    assert fake_train(lambda argv: PREEMPTED)()["status"] == "preempted"


def test_preempted_past_max_requeues_fails_and_says_how_to_resume(fake_train, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    with pytest.raises(StageFailed, match="--from pretrain"):
        fake_train(lambda argv: PREEMPTED)()


def test_failed_training_fails_the_job_naming_its_result_file(fake_train):
    with pytest.raises(StageFailed, match="code 1.*run-result.json"):
        fake_train(lambda argv: 1)()


def test_signal_before_the_trainer_installs_its_handler_counts_as_preempted(fake_train,
                                                                              monkeypatch):
    monkeypatch.setenv("RANK", "0")

    def main_interrupted_while_starting(argv):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(5)  # the startup handler interrupts this
        return 0

    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(Requeued):
        fake_train(main_interrupted_while_starting)()
    assert signal.getsignal(signal.SIGUSR2) is before  # our startup handler is gone again


@pytest.mark.parametrize("code, rank, restarts, expected", [
    (0, 0, 0, "done"), (0, 3, 5, "done"),
    (PREEMPTED, 0, 0, "requeue"), (PREEMPTED, 0, 2, "requeue"), (PREEMPTED, 0, 3, "fail"),
    (PREEMPTED, 1, 0, "leave"), (PREEMPTED, 1, 9, "leave"),
    (1, 0, 0, "fail"), (2, 1, 0, "fail"), (-9, 0, 0, "fail"),
])
def test_job_requeues_only_a_preempted_rank_zero_under_the_cap(code, rank, restarts, expected):
    assert decide_after_exit(code, rank=rank, restart_count=restarts, max_requeues=3) == expected
