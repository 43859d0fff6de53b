"""`relay submit|status|cancel` and scripts/<stage>.sh against the real local Slurm cluster.

Tiny runs only: 64 synthetic clips, batch 4, a handful of steps. Each test gives its jobs a
unique name prefix so that other jobs on the cluster never confuse it. One test submits the
whole four-stage chain (pretrain -> SFT -> Stage1 -> Stage2) and preempts Stage2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.pipeline import validate_pipeline
from launcher.slurm import render_sbatch

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TINY = {"train_batch_size": 4, "synthetic_num_samples": 64, "log_interval": 1, "warmup_steps": 1,
        "save_total_limit": 0, "validation_interval": -1}
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}


def relay(*args: str, env: dict | None = None, cwd: Path = ROOT, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def write_pipeline(tmp_path: Path, name: str, stages: dict, **cluster) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "root": str(tmp_path / "runs"),
        "cluster": {"cpus_per_task": 1, "mem": "2G", "time": 10, "network": "none",
                    "signal_lead_s": 60, **cluster},
        "stages": stages,
    }, sort_keys=False))
    return path


def stage(kind: str, tmp_path: Path, **overrides) -> dict:
    return {"config": str(ROOT / f"config/tiny/{kind}.yaml"),
            "overrides": {**TINY, "data_path": str(tmp_path / f"data-{kind}"), **overrides}}


def sacct(job_ids: list[str], *fields: str) -> dict[str, list[str]]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o",
                          ",".join(("JobIDRaw",) + fields)], capture_output=True, text=True,
                         timeout=60).stdout
    return {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line}


def wait_final(job_ids: list[str], timeout: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {j: (v[0].split() or [""])[0] for j, v in sacct(job_ids, "State").items()}
        if all(states.get(j) in FINAL for j in job_ids):
            return states
        time.sleep(1)
    raise AssertionError(f"jobs not final after {timeout} s: {states}")


def wait_for_step(output_dir: Path, step: int, timeout: float = 180) -> int:
    """Poll (every 10 ms) until metrics.jsonl holds `step`; returns the last step logged."""
    deadline = time.monotonic() + timeout
    metrics = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
                     if line.strip().endswith("}")]
            if steps and max(steps) >= step:
                return max(steps)
        time.sleep(0.01)
    raise AssertionError(f"{metrics} did not reach step {step} within {timeout} s")


def rank_processes(job: str, count: int, timeout: float = 60) -> list[psutil.Process]:
    """The `count` rank processes (srun tasks running python) of `job`: the local cluster
    runs them on this machine."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                env, cmdline = proc.environ(), proc.info["cmdline"] or []
            except psutil.Error:
                continue
            if env.get("SLURM_JOB_ID") == job and env.get("SLURM_STEP_ID", "").isdigit() and \
                    cmdline and "python" in Path(cmdline[0]).name:
                found.append(proc)
        if len(found) == count:
            return found
        assert time.monotonic() < deadline, f"job {job}: {len(found)} rank processes, not {count}"
        time.sleep(0.05)


def usr2_pending(pid: int) -> bool:
    """Whether SIGUSR2 is pending for process `pid` (its thread or process-wide mask)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGUSR2 - 1)) for mask in masks)


def usr2_to_frozen_ranks(job: str, ranks: int, output_dir: Path, steps: int,
                         send: list[str]) -> None:
    """Stop the job's ranks, run `send` (an scancel that signals them, directly or through
    the batch shell), and let them go once each holds the USR2 pending.

    Slurm delivers a signal asynchronously; frozen, the ranks cannot finish meanwhile, however
    fast the machine: the signal meets a run that still has steps to go.
    """
    procs = rank_processes(job, ranks)
    for proc in procs:
        proc.suspend()
    try:
        assert wait_for_step(output_dir, 1) < steps - 1, "the run ended before the signal"
        subprocess.run(send, check=True, timeout=60)
        deadline = time.monotonic() + 60
        while not all(usr2_pending(proc.pid) for proc in procs):
            assert time.monotonic() < deadline, "USR2 never reached the ranks"
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.resume()


def logged_steps(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def jobs_named(prefix: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%j"], capture_output=True,
                         text=True, timeout=60).stdout
    queued = [line for line in out.splitlines() if line.split("|", 1)[-1].startswith(prefix)]
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-S", "now-2hours", "-o", "JobIDRaw,JobName"],
                          capture_output=True, text=True, timeout=60).stdout
    return queued + [line for line in acct.splitlines() if line.split("|", 1)[-1].startswith(prefix)]


def test_submit_chains_pretrain_into_sft_with_weights_secrets_and_hostile_names_inert(
        slurm_cluster, tmp_path):
    name = unique("relay-it-chain-")
    marker = tmp_path / "pwned"
    hostile = f"x; touch {marker}; $(touch {marker}) `touch {marker}`"
    pretrain = stage("pretrain", tmp_path, max_steps=4, save_interval=2, wandb_run_name=hostile)
    pretrain["job_name"] = f"{name}-pretrain {hostile}"
    sft = stage("sft", tmp_path, max_steps=3,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    path = write_pipeline(tmp_path, name, {"pretrain": pretrain, "sft": sft},
                          env={"RELAY_TEST_HOSTILE": hostile})
    secret = "relay-it-secret-" + uuid.uuid4().hex
    env = {**os.environ, "WANDB_API_KEY": secret}

    proc = relay("submit", str(path), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    record = json.loads((root / "pipeline.json").read_text())
    assert list(record["stages"]) == ["pretrain", "sft"]
    ids = [record["stages"][s]["job_id"] for s in ("pretrain", "sft")]
    assert all(ids) and record["stages"]["sft"]["depends_on"] == ["pretrain"]
    assert wait_final(ids) == {ids[0]: "COMPLETED", ids[1]: "COMPLETED"}

    # The kept script is the one Slurm ran; the chain and the weights are wired.
    sft_script = Path(record["stages"]["sft"]["sbatch"])
    assert f"#SBATCH --dependency=afterok:{ids[0]}" in sft_script.read_text().splitlines()
    spec = validate_pipeline(path, cwd=tmp_path).stage("sft")
    assert sft_script.read_text() == render_sbatch(spec, dependency=ids[0])
    warm = json.loads((root / "sft" / "warm-start.json").read_text())
    assert str(root / "pretrain" / "checkpoint-4") in json.dumps(warm["source"])
    result = json.loads((root / "sft" / "run-result.json").read_text())
    assert (result["status"], result["step"]) == ("completed", 3)

    status = relay("status", str(root))
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:3]}
    assert rows["pretrain"][2] == "COMPLETED" and rows["pretrain"][3] == "4/4"
    assert rows["sft"][2] == "COMPLETED" and rows["sft"][3] == "3/3"

    # Hostile names were data, never code; the secret reached the jobs only through the
    # environment and was written nowhere.
    assert not marker.exists()
    assert json.loads((root / "pretrain" / "resolved-config.json").read_text())["wandb_run_name"] == hostile
    log = (root / "pretrain" / "slurm" / f"{ids[0]}_0_log.out").read_text()
    assert "WANDB_API_KEY: set (hidden)" in log
    leaked = subprocess.run(["grep", "-rl", secret, str(tmp_path)], capture_output=True, text=True)
    assert leaked.stdout == "", f"secret written to {leaked.stdout}"

    # Now that pretrain has a checkpoint, `--from sft` validates without running pretrain.
    again = relay("submit", str(path), "--from", "sft", "--dry-run", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "RESUMES" in again.stdout  # sft's own output_dir already holds checkpoints


def test_all_four_stages_chain_each_from_its_predecessor_and_stage2_survives_a_requeue(
        slurm_cluster, tmp_path):
    name = unique("relay-it-four-")
    keep = {"save_total_limit": 0}  # every checkpoint stays: "the newest" must be chosen
    pretrain = stage("pretrain", tmp_path, max_steps=4, save_interval=2, **keep)
    sft = stage("sft", tmp_path, max_steps=3, save_interval=2, **keep,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    stage1 = stage("stage1", tmp_path, max_steps=4, save_interval=2, **keep,
                   data_path=str(tmp_path / "data-sft"),
                   pretrained_transformer_path="${stages.sft.output_dir}")
    steps = 40
    stage2 = stage("stage2", tmp_path, max_steps=steps, save_interval=1000, **keep,
                   data_path=str(tmp_path / "data-sft"),
                   student_init_path="${stages.stage1.output_dir}",
                   teacher_init_path="${stages.sft.output_dir}",
                   critic_init_path="${stages.sft.output_dir}")
    path = write_pipeline(tmp_path, name, {"pretrain": pretrain, "sft": sft, "stage1": stage1,
                                           "stage2": stage2}, max_requeues=2)
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    record = json.loads((root / "pipeline.json").read_text())["stages"]
    order = ["pretrain", "sft", "stage1", "stage2"]
    ids = [record[s]["job_id"] for s in order]
    assert [record[s]["depends_on"] for s in order] == [[], ["pretrain"], ["sft"], ["stage1"]]

    # Preempt the distilling stage as Slurm would before its time limit: USR2 to its ranks.
    wait_for_step(root / "stage2", 3, timeout=600)
    subprocess.run(["scancel", "--signal=USR2", ids[3]], check=True, timeout=60)
    assert wait_final(ids, timeout=600) == {i: "COMPLETED" for i in ids}

    # Each stage started from the newest checkpoint of the right predecessor, and the right
    # weights of it (EMA for the distillation stages).
    def source(stage_name: str) -> str:
        return json.loads((root / stage_name / "warm-start.json").read_text())["source"]

    assert source("sft") == str(root / "pretrain" / "checkpoint-4" / "transformer")
    assert source("stage1") == str(root / "sft" / "checkpoint-3" / "ema")
    assert source("stage2") == (f"student {root / 'stage1' / 'checkpoint-4' / 'ema'}; "
                                f"teacher {root / 'sft' / 'checkpoint-3' / 'ema'}; "
                                f"critic {root / 'sft' / 'checkpoint-3' / 'ema'}")
    # Stage2 saved at the signal, requeued, and went on from its own checkpoint (not from the
    # three sources again): every step once.
    out = root / "stage2"
    assert logged_steps(out) == list(range(1, steps + 1))
    log = (out / "slurm" / f"{ids[3]}_0_log.out").read_text()
    assert "requeueing job" in log
    assert f"resumed from {out / 'checkpoint-'}" in log
    status = relay("status", str(root)).stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in status[1:5]}
    assert [rows[s][2] for s in order] == ["COMPLETED"] * 4, status
    assert rows["stage2"][3] == f"{steps}/{steps}" and rows["stage2"][6] == "1"


def test_usr2_to_every_rank_saves_requeues_and_resumes_without_losing_or_repeating_a_step(
        slurm_cluster, tmp_path):
    name = unique("relay-it-requeue-")
    steps = 50
    # Two ranks (srun tasks, gloo): each gets the signal itself; rank 0 requeues.
    path = write_pipeline(tmp_path, name, {"pretrain": stage(
        "pretrain", tmp_path, max_steps=steps, save_interval=1000)}, max_requeues=2,
        tasks_per_node=2)
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    job = json.loads((root / "pipeline.json").read_text())["stages"]["pretrain"]["job_id"]
    out = root / "pretrain"
    wait_for_step(out, 3)
    # What Slurm does signal_lead_s before the time limit: USR2 to every task of the step.
    usr2_to_frozen_ranks(job, 2, out, steps, ["scancel", "--signal=USR2", job])
    assert wait_final([job], timeout=400) == {job: "COMPLETED"}

    assert logged_steps(out) == list(range(1, steps + 1))
    assert json.loads((out / "launch-manifest.json").read_text())["world_size"] == 2
    log = (out / "slurm" / f"{job}_0_log.out").read_text()
    assert "requeueing job" in log
    assert "preemption signal SIGUSR2" in (out / "slurm" / f"{job}_1_log.out").read_text()
    saved = [p.name for p in out.glob("checkpoint-*")]
    assert f"checkpoint-{steps}" in saved and len(saved) == 2, saved  # the preemption save + the last
    status = relay("status", str(root)).stdout.splitlines()
    assert status[1].split()[2:4] == ["COMPLETED", f"{steps}/{steps}"]
    assert status[1].split()[6] == "1"  # one requeue


def test_failed_stage_leaves_the_next_unrun_and_status_says_why(slurm_cluster, tmp_path):
    name = unique("relay-it-fail-")
    from trainer.data.synthetic import ensure_dataset

    # Readable data that passes every check before the job, too small for one batch: the
    # stage fails on the compute node when its loader starts.
    bad_data = ensure_dataset(tmp_path / "bad-data", 2, seed=0)
    pretrain = stage("pretrain", tmp_path, max_steps=4, synthetic_data=False,
                     data_path=str(bad_data))
    sft = stage("sft", tmp_path, max_steps=3,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    path = write_pipeline(tmp_path, name, {"pretrain": pretrain, "sft": sft})
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    record = json.loads((root / "pipeline.json").read_text())
    ids = [record["stages"][s]["job_id"] for s in ("pretrain", "sft")]
    assert wait_final(ids) == {ids[0]: "FAILED", ids[1]: "CANCELLED"}
    assert not (root / "sft" / "metrics.jsonl").exists()

    status = relay("status", str(root)).stdout
    assert "pretrain: train.py:" in status
    assert f"pretrain: log {root / 'pretrain' / 'slurm' / (ids[0] + '_0_log.out')}" in status
    assert "sft: not run: pretrain did not complete" in status


def test_invalid_pipeline_submits_nothing(slurm_cluster, tmp_path):
    name = unique("relay-it-invalid-")
    good = stage("pretrain", tmp_path, max_steps=4)
    bad = stage("sft", tmp_path, max_steps=3, learning_rat=1e-4,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    path = write_pipeline(tmp_path, name, {"pretrain": good, "sft": bad})
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "stage sft:" in proc.stderr and "learning_rate" in proc.stderr
    assert not (tmp_path / "runs" / "pipeline.json").exists()
    assert jobs_named(name) == []


def test_a_refused_submission_cancels_the_stages_already_submitted(slurm_cluster, tmp_path):
    name = unique("relay-it-refused-")
    sft = stage("sft", tmp_path, max_steps=3,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    sft["resources"] = {"partition": "no-such-partition"}
    path = write_pipeline(tmp_path, name, {"pretrain": stage("pretrain", tmp_path, max_steps=500),
                                           "sft": sft})
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 1
    assert "sbatch refused stage sft" in proc.stderr and "partition" in proc.stderr.lower()
    record = json.loads((tmp_path / "runs" / "pipeline.json").read_text())
    first = record["stages"]["pretrain"]["job_id"]
    assert record["stages"]["sft"]["job_id"] is None
    assert wait_final([first], timeout=120) == {first: "CANCELLED"}


def test_cancel_stops_every_queued_or_running_stage(slurm_cluster, tmp_path):
    name = unique("relay-it-cancel-")
    path = write_pipeline(tmp_path, name, {
        "pretrain": stage("pretrain", tmp_path, max_steps=1000),
        "sft": stage("sft", tmp_path, max_steps=3,
                     pretrained_transformer_path="${stages.pretrain.output_dir}")})
    assert relay("submit", str(path), cwd=tmp_path).returncode == 0
    root = tmp_path / "runs"
    ids = [v["job_id"] for v in json.loads((root / "pipeline.json").read_text())["stages"].values()]
    busy = relay("submit", str(path), cwd=tmp_path)
    assert busy.returncode == 2 and "still has job" in busy.stderr
    proc = relay("cancel", str(root))
    assert proc.returncode == 0 and proc.stdout.count("cancelled") == 2, proc.stdout
    assert wait_final(ids, timeout=120) == {ids[0]: "CANCELLED", ids[1]: "CANCELLED"}


def test_sbatch_script_applies_overrides_and_requeues_after_usr2_to_the_batch_shell(
        slurm_cluster, tmp_path):
    name = unique("relay-it-script-")
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    cmd = ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks-per-node=1",
           "--gpus-per-node=0", "--cpus-per-task=1", "--mem=2G", "--time=10",
           "--signal=B:USR2@60", f"--output={log}",
           "scripts/pretrain.sh", "config/tiny/pretrain.yaml",
           "--max_steps", "40", "--train_batch_size", "4", "--synthetic_num_samples", "64",
           "--log_interval", "1", "--warmup_steps", "1", "--save_interval", "1000",
           "--validation_interval", "-1",
           "--data_path", str(tmp_path / "data"), "--output_dir", str(out)]
    env = {**os.environ, "RELAY_NETWORK": "none", "RELAY_PYTHON": sys.executable}
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip().split(";")[0]
    wait_for_step(out, 3)
    # What --signal=B:USR2@lead does: the batch shell only; it must forward to the ranks.
    usr2_to_frozen_ranks(job, 1, out, 40, ["scancel", "--batch", "--signal=USR2", job])
    assert wait_final([job], timeout=400) == {job: "COMPLETED"}, log.read_text()

    text = log.read_text()
    assert "batch shell got SIGUSR2: forwarding it to the ranks" in text
    assert "requeueing job" in text
    config = json.loads((out / "resolved-config.json").read_text())
    assert (config["max_steps"], config["train_batch_size"], config["synthetic_num_samples"]) == \
        (40, 4, 64)
    assert logged_steps(out) == list(range(1, 41))
    assert (out / f"slurm-{job}.out").resolve() == log.resolve()


@pytest.mark.slow
def test_time_limit_signal_saves_and_requeues_until_max_requeues(slurm_cluster, tmp_path):
    # The production path, nothing simulated: a 2-minute limit with signal_lead_s 60 makes
    # Slurm send USR2 30-60 s into each run (its timer ticks every ~30 s). The first run is
    # requeued; the second is preempted again and, with max_requeues 1, fails and says so.
    name = unique("relay-it-timelimit-")
    path = write_pipeline(tmp_path, name, {"pretrain": stage(
        "pretrain", tmp_path, max_steps=100000, save_interval=100000)},
        time=2, signal_lead_s=60, max_requeues=1)
    assert relay("submit", str(path), cwd=tmp_path).returncode == 0
    root = tmp_path / "runs"
    job = json.loads((root / "pipeline.json").read_text())["stages"]["pretrain"]["job_id"]
    assert wait_final([job], timeout=420) == {job: "FAILED"}

    out = root / "pretrain"
    log = (out / "slurm" / f"{job}_0_log.out").read_text()
    assert log.count("requeueing job") == 1
    assert "was preempted again after 1 requeues (max_requeues 1)" in log
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1))
    assert (out / f"checkpoint-{steps[-1]}" / "COMPLETE").exists()
    result = json.loads((out / "run-result.json").read_text())
    assert (result["status"], result["step"]) == ("preempted", steps[-1])
    status = relay("status", str(root)).stdout
    assert status.splitlines()[1].split()[2] == "FAILED"
    assert status.splitlines()[1].split()[6] == "1"
    assert "pretrain: Slurm FAILED after a preemption save" in status


def test_warmup_job_runs_first_and_the_chain_waits_for_it(slurm_cluster, tmp_path):
    name = unique("relay-it-warmup-")
    pretrain = stage("pretrain", tmp_path, max_steps=2)
    sft = stage("sft", tmp_path, max_steps=2,
                pretrained_transformer_path="${stages.pretrain.output_dir}")
    path = write_pipeline(tmp_path, name, {"pretrain": pretrain, "sft": sft}, warmup=True,
                          warmup_time=5)
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    record = json.loads((root / "pipeline.json").read_text())
    warm = record["warmup"]
    ids = [warm["job_id"]] + [record["stages"][s]["job_id"] for s in ("pretrain", "sft")]
    assert list(record["stages"]) == ["pretrain", "sft"]
    assert wait_final(ids) == {i: "COMPLETED" for i in ids}

    # pretrain waited for the warm-up: afterok in its script, and it started after the end.
    script = Path(record["stages"]["pretrain"]["sbatch"]).read_text().splitlines()
    assert f"#SBATCH --dependency=afterok:{ids[0]}" in script
    times = sacct(ids[:2], "Start", "End")
    assert times[ids[0]][1] <= times[ids[1]][0]
    # One report per stage, at the stage's own shapes; no stage output_dir touched by it.
    for name_ in ("pretrain", "sft"):
        report = json.loads((root / "warmup" / f"{name_}.json").read_text())
        assert report["status"] == "ok" and report["shapes"]["batch"] == 4, report
    log = (root / "warmup" / "slurm" / f"{ids[0]}_0_log.out").read_text()
    assert "kernel warm-up of stage sft: ok" in log

    status = relay("status", str(root)).stdout.splitlines()
    assert status[1].split()[:4] == ["warmup", ids[0], "COMPLETED", "2/2"]
    assert status[2].split()[2] == "COMPLETED" and status[3].split()[2] == "COMPLETED"


def test_a_plugin_family_named_in_the_yaml_trains_in_the_slurm_job(slurm_cluster, tmp_path):
    # A user's project directory holding the plug-in package, relay submitted from there: the
    # job runs in that directory and imports the family as the login node did.
    import shutil

    work = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "families", work / "families",
                    ignore=shutil.ignore_patterns("__pycache__"))
    name = unique("relay-it-plugin-")
    spec = "families.pixel_mlp:PixelMLPFamily"
    pretrain = stage("pretrain", tmp_path, max_steps=4, save_interval=2, use_muon=False,
                     model_family=spec,
                     transformer_config_overrides={"hidden": 16, "layers": 2})
    path = write_pipeline(tmp_path, name, {"pretrain": pretrain})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's relay; nothing names the project
    proc = relay("submit", str(path), env=env, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "runs"
    job = json.loads((root / "pipeline.json").read_text())["stages"]["pretrain"]["job_id"]
    assert wait_final([job]) == {job: "COMPLETED"}, (root / "pretrain" / "slurm").glob("*")
    out = root / "pretrain"
    assert logged_steps(out) == [1, 2, 3, 4]
    complete = json.loads((out / "checkpoint-4" / "COMPLETE").read_text())
    assert complete["model_config"]["hidden"] == 16 and complete["model_config"]["layers"] == 2
    assert json.loads((out / "resolved-config.json").read_text())["model_family"] == spec
