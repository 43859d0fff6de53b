"""Distilling a Wan (config/pipeline/wan-distill-*.yaml): the tiny random Wan in the diffusers
layout through SFT -> Stage1 -> Stage2 under `relay run`, few steps each.

- Stage2 (the stage with three roles) preempted once (SIGUSR2 to its train.py) and resumed with
  `relay run --from stage2` logs and saves exactly what the uninterrupted chain did. The whole
  chain is not run twice: SFT and Stage1 of the preempted copy are the reference's, copied.
- each role receives the tensors it should: the second time input only in Stage1's model
  (copied from the time embedder), the Stage2 student from Stage1's EMA without it, teacher
  and critic from SFT's EMA (warm-start.json and the checkpoints agree);
- the Stage2 student exported with --format diffusers loads in diffusers'
  WanTransformer3DModel and gives relay's bidirectional output; relay-sampling.json beside it
  holds the few-step settings; a two-time Stage1 model is refused;
- `relay sample` at 1, 2 and 4 steps writes mp4s through the tiny pipeline's VAE;
- the health gate works over wan's Stage2 statistics: a diverging critic stops the run,
  saved, with a sentence;
- `relay submit --dry-run` validates the shipped 1.3B and 14B chains against stub releases
  (only `source` and `data` edited), and the tiny chain before anything exists.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from launcher.cli import main as relay_main
from trainer.checkpoint.dcp_io import read_dcp_state_dict
from trainer.checkpoint.lora_base import base_reference
from trainer.models.wan import tiny

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "config" / "pipeline" / "wan-distill-tiny.yaml"
PREEMPTED = 75
E_R = "condition_embedder.time_embedder_r."
# stage -> max_steps. Stage2's student updates every 2nd outer step: it is preempted after its
# first update, so its EMA has moved and must be restored, not recomputed.
STEPS = {"sft": 3, "stage1": 3, "stage2": 6}
TIMING_KEYS = {"step_time_s", "tokens_per_s", "host_mem_gb", "peak_device_mem_gb"}


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _pipeline(tmp: Path) -> Path:
    """The shipped tiny chain with its two lines (source, data) pointed at tmp, few steps."""
    data = yaml.safe_load(PIPELINE.read_text())
    data["source"], data["data"] = str(tmp / "tiny-wan"), str(tmp / "data")
    common = {"log_interval": 1, "validation_interval": -1, "deterministic": True,
              "synthetic_num_samples": 8, "train_batch_size": 4, "save_total_limit": 0}
    extra = {"sft": {"warmup_steps": 1, "save_interval": 3},
             "stage1": {"warmup_steps": 1, "save_interval": 3},
             "stage2": {"save_interval": 2, "generator_update_interval": 2}}
    for name, stage in data["stages"].items():
        stage["config"] = str(ROOT / stage["config"])
        stage["overrides"].update(common, max_steps=STEPS[name], **extra[name])
    path = tmp / "distill.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _relay_run(pipeline: Path, root: Path, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", str(pipeline),
                                 "--root", str(root), *extra], cwd=ROOT, env=_env(),
                                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _records(out: Path) -> list[dict]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return found


def _preempt_at(relay: subprocess.Popen, out: Path, step: int, log: Path) -> int:
    """SIGUSR2 to the stage's train.py once it has logged `step`; the step it saved."""
    deadline = time.monotonic() + 240
    while not any(r["step"] >= step for r in _records(out)):
        assert relay.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.001)
    child = next(c for c in psutil.Process(relay.pid).children(recursive=True)
                 if f"--output_dir={out}" in c.cmdline())
    child.send_signal(signal.SIGUSR2)
    assert relay.wait(timeout=240) == PREEMPTED, log.read_text()[-3000:]
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "preempted", result
    return result["step"]


def _tensors(checkpoint: Path, member: str) -> dict[str, torch.Tensor]:
    return read_dcp_state_dict(checkpoint / member)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("distill")
    pipeline = _pipeline(tmp)
    reference, cut, log = tmp / "reference", tmp / "preempted", tmp / "relay.log"
    started = time.monotonic()
    assert _relay_run(pipeline, reference, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    # The preempted copy: SFT and Stage1 as the reference wrote them, Stage2 cut once.
    for name in ("sft", "stage1"):
        shutil.copytree(reference / name, cut / name)
    stopped = _preempt_at(_relay_run(pipeline, cut, log, "--from", "stage2"), cut / "stage2", 3, log)
    assert 3 <= stopped < STEPS["stage2"], stopped
    assert _relay_run(pipeline, cut, log, "--from", "stage2").wait(timeout=600) == 0, \
        log.read_text()[-3000:]
    print(f"chain + preempted Stage2: {time.monotonic() - started:.0f} s")
    return {"tmp": tmp, "pipeline": pipeline, "reference": reference, "cut": cut, "log": log,
            "stopped": stopped}


def test_stage2_preempted_and_resumed_equals_the_uninterrupted_chain(chain):
    reference, cut = chain["reference"] / "stage2", chain["cut"] / "stage2"
    resumed_from = cut / f"checkpoint-{chain['stopped']}"
    assert f"resumed from {resumed_from}" in chain["log"].read_text()
    want = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _records(reference)]
    got = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _records(cut)]
    assert [r["step"] for r in got] == list(range(1, STEPS["stage2"] + 1))
    assert got == want
    assert "critic_loss_rel" in got[0] and "generator_loss" in got[-1]  # the health gate's input
    final = f"checkpoint-{STEPS['stage2']}"
    members = json.loads((reference / final / "COMPLETE").read_text())["members"]
    assert {"student", "critic", "ema", "optimizer"} <= set(members), members
    assert "teacher" not in members  # frozen: recorded by reference, loaded again on resume
    for member in members:
        saved, resumed = _tensors(reference / final, member), _tensors(cut / final, member)
        assert saved.keys() == resumed.keys(), member
        differing = [k for k in saved if not torch.equal(saved[k], resumed[k])]
        assert not differing, f"{member} differs after the resume: {differing[:5]}"
    ema, live = _tensors(reference / final, "ema"), _tensors(reference / final, "student")
    assert any(not torch.equal(ema[k], live[k]) for k in live)  # the EMA had moved


def test_each_role_receives_the_tensors_it_should(chain):
    reference = chain["reference"]
    sft = reference / "sft" / f"checkpoint-{STEPS['sft']}"
    stage1 = reference / "stage1" / f"checkpoint-{STEPS['stage1']}"
    sft_ema, sft_live = _tensors(sft, "ema"), _tensors(sft, "transformer")
    stage1_ema = _tensors(stage1, "ema")
    # SFT started from the directory's diffusers keys; only Stage1 has the second time input,
    # which started as a copy of the time embedder.
    assert not any(k.startswith(E_R) for k in sft_ema)
    second = sorted(k for k in stage1_ema if k.startswith(E_R))
    assert second and set(stage1_ema) - set(second) == set(sft_ema)
    report = json.loads((reference / "stage1" / "warm-start.json").read_text())
    assert json.dumps(report).count('"second_time": "copied from the first"') == 1
    assert str(sft / "ema") in json.dumps(report)

    roles = json.loads((reference / "stage2" / "warm-start.json").read_text())["roles"]
    assert (roles["student"]["source"], roles["student"]["member"]) == (str(stage1 / "ema"), "ema")
    assert sorted(roles["student"]["unexpected"]) == second
    for role in ("teacher", "critic"):
        assert (roles[role]["source"], roles[role]["member"]) == (str(sft / "ema"), "ema")
    # Checkpoint-2 comes before the student's first update: it is Stage1's EMA without E_r.
    student = _tensors(reference / "stage2" / "checkpoint-2", "student")
    assert sorted(set(stage1_ema) - set(student)) == second
    assert all(torch.equal(student[k], stage1_ema[k]) for k in student)
    # The frozen teacher is not saved: every checkpoint records the bytes it was loaded from,
    # SFT's EMA, which a resume loads again
    final = reference / "stage2" / f"checkpoint-{STEPS['stage2']}"
    frozen = json.loads((final / "frozen-roles.json").read_text())["teacher"]
    assert frozen["root"] == str(sft / "ema")
    assert frozen["digest"] == base_reference(sft / "ema", "ema")["digest"]
    assert any(not torch.equal(sft_ema[k], sft_live[k]) for k in sft_ema)  # the EMA, not live


def test_the_exported_student_loads_in_diffusers_with_relays_bidirectional_output(
        chain, capsys):
    from diffusers import WanTransformer3DModel

    from trainer.evaluation.inference import load_model_for_inference
    from trainer.models.registry import get_family

    reference, out = chain["reference"], chain["tmp"] / "student"
    code = relay_main(["export", str(reference / "stage2"), "--format", "diffusers",
                       "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0 and "relay-sampling.json" in stdout and "bidirectionally" in stdout
    assert {"model_index.json", "transformer", "vae", "text_encoder", "tokenizer", "scheduler",
            "relay-sampling.json"} <= {p.name for p in out.iterdir()}
    settings = json.loads((out / "relay-sampling.json").read_text())
    assert settings["causal_chunk_size"] == 1 and settings["steps"] == 4
    assert settings["denoising_steps"] == [1000, 750, 500, 250]
    assert settings["shift"] == tiny.FLOW_SHIFT and settings["guidance"] == 1.0
    assert len(settings["timesteps"]) == 4 and settings["timesteps"][0] == 1000.0
    config = json.loads((out / "transformer" / "config.json").read_text())
    assert not {"causal_chunk_size", "two_time", "time_gate"} & set(config)

    diffusers_model = WanTransformer3DModel.from_pretrained(str(out / "transformer")).eval()
    loaded = load_model_for_inference(reference / "stage2")  # the EMA student, causal
    family = get_family("wan")
    bidirectional = family.build(family.bidirectional_config(
        json.loads((loaded.checkpoint / "COMPLETE").read_text())["model_config"])).eval()
    bidirectional.load_state_dict(loaded.model.state_dict())
    assert sorted(diffusers_model.state_dict()) == sorted(loaded.model.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tiny.LATENT_CHANNELS, 3, 4, 4, generator=g)
    t = torch.tensor([900.0, 250.0])
    text = torch.randn(2, 7, tiny.TEXT_DIM, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(bidirectional(x, t, text), diffusers_model(x, t, text).sample,
                                   rtol=1e-5, atol=1e-5)

    capsys.readouterr()
    refused = relay_main(["export", str(reference / "stage1"), "--format", "diffusers",
                          "--out", str(chain["tmp"] / "stage1-export")])
    err = capsys.readouterr().err
    assert refused == 2 and "two-time" in err and "Stage2 student" in err and "\n" not in err.strip()
    assert not (chain["tmp"] / "stage1-export").exists()


def test_relay_sample_at_1_2_and_4_steps_writes_mp4s_through_the_tiny_vae(chain, capsys):
    import imageio.v3 as iio
    import numpy as np

    config = json.loads((chain["reference"] / "stage2" / "resolved-config.json").read_text())
    assert config["vae_path"] == str(chain["tmp"] / "tiny-wan" / "vae")
    clips = {}
    for steps in (1, 2, 4):
        out = chain["tmp"] / f"sample-{steps}"
        code = relay_main(["sample", "--checkpoint", str(chain["reference"] / "stage2"),
                           "--prompt", "a red square moving left", "--steps", str(steps),
                           "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        assert iio.imread(out / "sample.mp4", plugin="FFMPEG", index=None).shape[0] == 9
        clips[steps] = np.load(out / "frames.npy")
    assert not np.array_equal(clips[1], clips[4])  # the steps are the rollout's


# ---- dry runs -------------------------------------------------------------------------------

def test_the_tiny_chain_dry_runs_before_anything_exists_and_top_level_keys_are_checked(tmp_path):
    from launcher.pipeline import PipelineError, validate_pipeline

    pipeline = validate_pipeline(PIPELINE, root=str(tmp_path / "runs"), cwd=ROOT)
    assert [s.name for s in pipeline.stages] == ["sft", "stage1", "stage2"]
    stage2 = pipeline.stage("stage2")
    assert stage2.args.vae_path == str(tmp_path / "runs" / "tiny-wan" / "vae")
    assert "student:" in stage2.plan and "critic:" in stage2.plan and "teacher:" in stage2.plan
    assert not (tmp_path / "runs").exists()  # validation writes nothing
    text = PIPELINE.read_text()
    for bad, needle in ((text.replace("source: ${root}/tiny-wan", "sources: x"), "sources"),
                        (text.replace("source: ${root}/tiny-wan", "source: null"), "`source`")):
        (tmp_path / "p.yaml").write_text(bad)
        with pytest.raises(PipelineError, match=needle):
            validate_pipeline(tmp_path / "p.yaml", root=str(tmp_path / "runs"), cwd=ROOT)


def test_editing_source_alone_gives_every_stage_the_new_directory_architecture(tmp_path):
    """Another Wan directory (16 latent channels, three heads of 24) as `source`, the shipped
    chain otherwise as it is: Stage1 and Stage2 build what SFT builds, made causal/two-time."""
    from launcher.pipeline import validate_pipeline
    from trainer.models.registry import model_config

    source = tiny.write_tiny_wan_pipeline(tmp_path / "other-wan", latent_channels=16,
                                          transformer={"num_attention_heads": 3,
                                                       "attention_head_dim": 24})
    data = yaml.safe_load(PIPELINE.read_text())
    data["source"] = str(source)
    for stage in data["stages"].values():
        stage["config"] = str(ROOT / stage["config"])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    pipeline = validate_pipeline(tmp_path / "p.yaml", root=str(tmp_path / "runs"), cwd=ROOT)
    configs = {s.name: model_config(s.args) for s in pipeline.stages}
    for name, config in configs.items():
        assert (config["in_channels"], config["num_attention_heads"],
                config["attention_head_dim"]) == (16, 3, 24), name
    assert configs["stage1"]["two_time"] and configs["stage1"]["causal_chunk_size"] == 1
    assert not configs["stage2"]["two_time"] and configs["stage2"]["causal_chunk_size"] == 1
    assert configs["sft"]["causal_chunk_size"] is None


RELEASES = {  # pipeline -> (transformer/config.json keys, VAE spatial factor, flow_shift,
    #                         latent shape, world, the Stage2 line of the plan)
    "wan-distill-1.3b": ({"num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960},
                         8, 3.0, [16, 21, 60, 104], "world 8,"),
    "wan-distill-14b": ({"num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824},
                        8, 5.0, [16, 21, 90, 160], "world 256,"),
}


def _release(root: Path, transformer: dict, spatial: int, shift: float) -> Path:
    """A release's config files with stub weights: what the dry run reads of a directory."""
    from safetensors.torch import save_file

    files = {
        "model_index.json": {"_class_name": "WanPipeline"},
        "transformer/config.json": {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128,
                                    "patch_size": [1, 2, 2], "text_dim": 4096, "freq_dim": 256,
                                    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                                    "eps": 1e-6, "rope_max_seq_len": 1024, "in_channels": 16,
                                    "out_channels": 16, **transformer},
        "vae/config.json": {"_class_name": "AutoencoderKLWan", "z_dim": 16,
                            "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
                            "scale_factor_spatial": spatial},
        "text_encoder/config.json": {"architectures": ["UMT5EncoderModel"], "d_model": 4096,
                                     "num_layers": 24},
        "tokenizer/tokenizer.json": {},
        "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler",
                                            "flow_shift": shift},
    }
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    for part in ("transformer", "vae"):
        save_file({"stub": torch.zeros(1)}, str(root / part / "diffusion_pytorch_model.safetensors"))
    return root


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_the_shipped_distill_chains_dry_run_with_two_lines_edited(name, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    transformer, spatial, shift, latent, world = RELEASES[name]
    model = _release(tmp_path / "model", transformer, spatial, shift)
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist([{
        "id": "p-0", "caption": "a clip", "vae_latent_bytes": bytes(2 * math.prod(latent)),
        "vae_latent_shape": latent, "vae_latent_dtype": "bfloat16",
        "text_embedding_bytes": bytes(2 * 8 * 4096), "text_embedding_shape": [8, 4096],
        "text_embedding_dtype": "bfloat16"}]), data / "part-0.parquet")
    pipeline = yaml.safe_load((ROOT / f"config/pipeline/{name}.yaml").read_text())
    pipeline.update(root=str(tmp_path / "runs"), source=str(model), data=str(data))
    for stage in pipeline["stages"].values():
        stage["config"] = str(ROOT / stage["config"])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipeline))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", "p.yaml", "--dry-run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    plan = proc.stdout
    assert plan.count(world) == 3 and "after sft" in plan and "after stage1" in plan
    stage2 = plan[plan.index("  stage2:"):]
    assert "student:" in stage2 and "critic:" in stage2 and "teacher:" in stage2
    # every stage fits the H200s it asks for (the estimate counts all three Stage2 models)
    totals = [float(line.split("~")[1].split()[0]) for line in plan.splitlines()
              if line.strip().startswith("total ~")]
    assert len(totals) == 3 and max(totals) < 141, totals


def test_a_diverging_wan_critic_stops_stage2_saved_with_a_sentence(chain):
    """The health gate over wan's Stage2 statistics: 6 healthy steps, then the same run
    resumed at a critic learning rate of 1.0 diverges; the run saves, says why in one sentence
    and exits 1. Checkpoints every 2 steps, one kept: the newest saved before the critic's
    first unhealthy reading (checkpoint-6) survives every prune, and the sentence names it."""
    reference, out = chain["reference"], chain["tmp"] / "broken"
    source = chain["tmp"] / "tiny-wan"

    def stage2(critic_lr: str, max_steps: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "trainer/train.py", "--config", "config/wan/tiny-stage2.yaml",
             "--student_init_path", str(reference / "stage1"), "--teacher_init_path",
             str(reference / "sft"), "--critic_init_path", str(reference / "sft"),
             "--data_path", str(chain["tmp"] / "data"), "--synthetic_num_samples", "8",
             "--vae_path", str(source / "vae"), "--text_encoder", str(source / "text_encoder"),
             "--output_dir", str(out), "--critic_learning_rate", critic_lr,
             "--max_steps", max_steps, "--validation_interval", "-1", "--log_interval", "1",
             "--save_interval", "2", "--save_total_limit", "1"],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)

    assert stage2("0.03", "6").returncode == 0
    proc = stage2("1.0", "30")
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads((out / "run-result.json").read_text())
    stop = result["stop_reason"]
    assert result["status"] == "failed" and stop["gate"] == "critic" and stop["step"] < 30
    assert "critic_learning_rate" in result["error"] and "\n" not in result["error"]
    assert result["last_checkpoint"] == str(out / f"checkpoint-{stop['step']}")
    assert (out / f"checkpoint-{stop['step']}" / "COMPLETE").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["critic_loss_rel"] == pytest.approx(1.0)
    assert max(r["critic_loss_rel"] for r in records if r["step"] <= 6) < 10
    assert records[-1]["critic_loss_rel"] > 10
    onset = min(r["step"] for r in records if r["critic_loss_rel"] > 10)
    assert stop["onset"] == onset > 6 and records[-1]["step"] - onset >= 4  # patience 5
    healthy = out / "checkpoint-6"  # the newest save before the onset
    assert stop["healthy_checkpoint"] == str(healthy) and (healthy / "COMPLETE").is_file()
    assert "checkpoint-6" in result["error"] and f"step {onset}" in result["error"]
    # the saves between the onset and the stop were pruned as save_total_limit 1 says
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == sorted({healthy.name, f"checkpoint-{stop['step']}"})
