"""SFT -> Stage1 -> Stage2 through `relay run`: the hand-off, and resume with EMA, bit for bit.

Two chains of the same pipeline, tiny and deterministic. The reference chain runs each stage
to its end. The other is preempted (SIGUSR2 to its train.py, at a step reached) in the middle
of every stage and resumed the way a user would, `relay run --from <stage>`: each stage must
log exactly the reference's numbers and end with exactly its weights, EMA and optimizer
state. The EMA does not feed the loss, so only the final tensors show whether it was restored;
each stage is preempted after its EMA has moved away from the live weights.

On the reference chain, the hand-off: the Stage2 student starts from Stage1's EMA without
r_embedder.*, the teacher and the critic from SFT's EMA (config/tiny/stage2.yaml), and the
report in warm-start.json says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from trainer.checkpoint.dcp_io import read_dcp_state_dict
from trainer.checkpoint.lora_base import base_reference

REPO = Path(__file__).resolve().parents[2]
PREEMPTED = 75
MODEL = {"hidden_size": 32, "num_attention_heads": 2, "num_layers": 1,
         "rope_axes_dim": [4, 6, 6], "text_dim": 32, "patch_size": [1, 4, 4], "in_channels": 3}
# stage -> (max_steps, the step to preempt at or after). Stage2's student (and its EMA)
# updates at outer steps 3, 5, 7 (generator_update_interval 2): preempted after the first.
PLAN = {"sft": (6, 2), "stage1": (6, 2), "stage2": (8, 3)}
# Every logged number except those that measure the machine.
TIMING_KEYS = {"step_time_s", "tokens_per_s", "host_mem_gb", "peak_device_mem_gb"}


def write_pipeline(tmp: Path, pretrain: Path) -> Path:
    common = {"train_batch_size": 4, "synthetic_num_samples": 64, "data_path": str(tmp / "data"),
              "log_interval": 1, "save_interval": 2, "save_total_limit": 0,
              "validation_interval": -1, "deterministic": True, "warmup_steps": 1}
    stages = {
        "sft": {"pretrained_transformer_path": str(pretrain),
                "transformer_config_overrides": MODEL},
        "stage1": {"pretrained_transformer_path": "${stages.sft.output_dir}",
                   "transformer_config_overrides": {**MODEL, "causal_chunk_size": 2,
                                                    "two_time": True, "time_gate": 0.25}},
        "stage2": {"student_init_path": "${stages.stage1.output_dir}",
                   "teacher_init_path": "${stages.sft.output_dir}",
                   "critic_init_path": "${stages.sft.output_dir}",
                   "generator_update_interval": 2,
                   "transformer_config_overrides": {**MODEL, "causal_chunk_size": 2,
                                                    "two_time": False}},
    }
    path = tmp / "chain.yaml"
    path.write_text(yaml.safe_dump({"name": "chain", "stages": {
        name: {"config": str(REPO / "config" / "tiny" / f"{name}.yaml"),
               "overrides": {**common, "max_steps": PLAN[name][0], **overrides}}
        for name, overrides in stages.items()}}, sort_keys=False))
    return path


def relay_run(pipeline: Path, root: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_API_KEY", None)
    with open(log, "ab") as handle:
        return subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", str(pipeline),
                                 "--root", str(root), *extra], cwd=pipeline.parent, env=env,
                                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def records(out: Path) -> list[dict]:
    """The complete lines of metrics.jsonl (a line being written is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return found


def train_child(relay: subprocess.Popen, out: Path) -> psutil.Process:
    """The train.py process `relay run` started for the stage writing to `out`."""
    for child in psutil.Process(relay.pid).children(recursive=True):
        try:
            if "trainer.train" in child.cmdline() and f"--output_dir={out}" in child.cmdline():
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"relay run {relay.pid} has no train.py child for {out}")


def preempt_when_reached(relay: subprocess.Popen, out: Path, step: int, log: Path) -> int:
    """SIGUSR2 to the stage's train.py once it has logged `step`; returns the step it saved."""
    deadline = time.monotonic() + 300
    # Polled at 1 ms and signalled at once: the run has steps left to go well past that.
    while not any(r["step"] >= step for r in records(out)):
        assert relay.poll() is None, f"relay run ended before step {step}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached:\n{log.read_text()[-3000:]}"
        time.sleep(0.001)
    train_child(relay, out).send_signal(signal.SIGUSR2)
    assert relay.wait(timeout=300) == PREEMPTED, log.read_text()[-3000:]
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "preempted", result
    return result["step"]


def tensors(checkpoint: Path, member: str) -> dict[str, torch.Tensor]:
    return read_dcp_state_dict(checkpoint / member)


@pytest.fixture(scope="module")
def chains(tiny_trainer, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chain")
    pipeline = write_pipeline(tmp, tiny_trainer.reference())
    reference, cut = tmp / "reference", tmp / "preempted"
    log = tmp / "relay.log"
    proc = relay_run(pipeline, reference, log)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]

    stopped = {}
    previous = None
    for name, (max_steps, at) in PLAN.items():
        # Resumes the previous stage (preempted in the last round), then starts this one.
        proc = relay_run(pipeline, cut, log, *(("--from", previous) if previous else ()))
        stopped[name] = preempt_when_reached(proc, cut / name, at, log)
        assert at <= stopped[name] <= max_steps - 2, (name, stopped[name])
        previous = name
    proc = relay_run(pipeline, cut, log, "--from", previous)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    return {"pipeline": pipeline, "reference": reference, "cut": cut, "stopped": stopped,
            "log": log}


@pytest.mark.parametrize("name", list(PLAN))
def test_a_stage_preempted_and_resumed_logs_and_saves_exactly_what_the_reference_did(
        chains, name):
    reference, cut = chains["reference"] / name, chains["cut"] / name
    resumed_from = cut / f"checkpoint-{chains['stopped'][name]}"
    assert f"resumed from {resumed_from}" in chains["log"].read_text()
    want = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records(reference)]
    got = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records(cut)]
    assert [r["step"] for r in got] == list(range(1, PLAN[name][0] + 1))
    assert got == want

    final = f"checkpoint-{PLAN[name][0]}"
    members = json.loads((reference / final / "COMPLETE").read_text())["members"]
    assert "ema" in members and "optimizer" in members, members
    for member in members:
        saved, resumed = tensors(reference / final, member), tensors(cut / final, member)
        assert saved.keys() == resumed.keys(), member
        differing = [k for k in saved if not torch.equal(saved[k], resumed[k])]
        assert not differing, f"{name}: {member} differs after the resume: {differing[:5]}"
    # The EMA is not the live model (else restoring it could not be told from copying it).
    live_role = "student" if name == "stage2" else "transformer"
    ema, live = tensors(reference / final, "ema"), tensors(reference / final, live_role)
    assert any(not torch.equal(ema[k], live[k]) for k in live)


def test_stage2_roles_start_from_stage1_ema_and_sft_ema(chains):
    reference = chains["reference"]
    sft, stage1 = reference / "sft" / "checkpoint-6", reference / "stage1" / "checkpoint-6"
    sft_ema, sft_live = tensors(sft, "ema"), tensors(sft, "transformer")
    stage1_ema, stage1_live = tensors(stage1, "ema"), tensors(stage1, "transformer")
    dropped = sorted(k for k in stage1_ema if k.startswith("r_embedder."))
    assert dropped, "Stage1's two-time model has an r_embedder"

    report = json.loads((reference / "stage2" / "warm-start.json").read_text())["roles"]
    assert (report["student"]["source"], report["student"]["member"]) == (str(stage1 / "ema"), "ema")
    assert sorted(report["student"]["unexpected"]) == dropped
    for role in ("teacher", "critic"):
        assert (report[role]["source"], report[role]["member"]) == (str(sft / "ema"), "ema")

    # Checkpoint-2 comes before the first student update (outer step k = 2, i.e. step 3):
    # the student is still exactly what it was given. The teacher never changes.
    student = tensors(reference / "stage2" / "checkpoint-2", "student")
    assert sorted(set(stage1_ema) - set(student)) == dropped
    assert all(torch.equal(student[k], stage1_ema[k]) for k in student)
    assert any(not torch.equal(student[k], stage1_live[k]) for k in student)  # EMA, not live
    # The frozen teacher is not saved: checkpoint-8 records the bytes it was loaded from,
    # SFT's EMA, which a resume loads again
    frozen = json.loads((reference / "stage2" / "checkpoint-8" / "frozen-roles.json").read_text())
    assert frozen["teacher"]["root"] == str(sft / "ema")
    assert frozen["teacher"]["digest"] == base_reference(sft / "ema", "ema")["digest"]
    assert any(not torch.equal(sft_ema[k], sft_live[k]) for k in sft_ema)


def test_stage2_critic_and_student_ema_receive_their_sources_at_the_warm_start(chains):
    # The critic trains from step 1, so what it was given is seen at the warm start itself:
    # Stage2's job argv as `relay run` ran it, its stage built and warm-started in-process.
    from launcher.pipeline import validate_pipeline
    from trainer.resolve import resolve_args
    from trainer.parallel.distributed import Topology
    from trainer import run_state
    from trainer.stages.registry import build_stage

    reference = chains["reference"]
    spec = validate_pipeline(chains["pipeline"], root=str(reference),
                             cwd=chains["pipeline"].parent).stage("stage2")
    args, _ = resolve_args(list(spec.train_argv), world_size=1)
    topo = Topology(rank=0, world_size=1, local_rank=0, cp_size=1, device=torch.device("cpu"))
    with torch.random.fork_rng():
        stage = build_stage(args, topo)
        run_state.warm_start(stage)
    sft_ema = tensors(reference / "sft" / "checkpoint-6", "ema")
    stage1_ema = tensors(reference / "stage1" / "checkpoint-6", "ema")
    for role, source in (("critic", sft_ema), ("teacher", sft_ema), ("student", stage1_ema)):
        state = stage.roles[role].state_dict()
        assert all(torch.equal(state[k], source[k]) for k in state), role
    ema = stage.emas["student"].state_dict()
    assert all(torch.equal(ema[k], stage1_ema[k]) for k in ema)  # the EMA starts at the student
