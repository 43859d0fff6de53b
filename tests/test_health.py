"""The Stage2 health gate (trainer.runtime.health): it stops a collapsing run after saving, says why in
run-result.json and `relay status`, and leaves a healthy run alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.status import explain_failure
from trainer.resolve import resolve_config
from trainer.runtime.health import HealthGate, HealthSettings
from trainer.stages.registry import stage_of
from trainer.config.schema import ConfigError, ResolvedArgs

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MODEL = ("{in_channels: 3, hidden_size: 32, num_attention_heads: 2, num_layers: 2, "
         "patch_size: [1, 4, 4], rope_axes_dim: [4, 4, 8], text_dim: 32, qk_norm: true%s}")


def gate(**settings) -> HealthGate:
    defaults = {"health_gate": True, "health_score_margin": 0.1, "health_score_patience": 2,
                "health_critic_max_ratio": 10.0, "health_critic_min_ratio": 0.01,
                "health_critic_patience": 3, "health_sample_min_ratio": 0.2,
                "stage": "dmd_sgf"}
    args = ResolvedArgs({**defaults, **settings})
    return HealthGate(HealthSettings.of(args, watches_samples=stage_of(args).health_watches_samples))


def scores(g: HealthGate, values, weights="ema"):
    """Feed one validation per value; the steps at which the gate said stop."""
    return [step for step, v in enumerate(values, 1)
            if g.observe(step, {f"val/{weights}/mean_score": v}) is not None]


def test_scores_below_their_best_for_n_validations_in_a_row_stop_the_run():
    assert scores(gate(), [0.5, 0.8, 0.65, 0.75, 0.6, 0.55]) == [6]  # 0.65 and 0.6 alone pass
    g = gate()  # the message names the best score and where it was
    for step, v in enumerate([0.9, 0.7], 1):
        g.observe(step, {"val/live/mean_score": v})
    reason = g.observe(3, {"val/live/mean_score": 0.6})
    assert reason.gate == "validation" and "0.900 at step 1" in reason.message


def test_a_score_within_the_margin_or_recovering_resets_the_count():
    assert scores(gate(), [0.8, 0.6, 0.75, 0.6, 0.85, 0.8]) == []
    assert scores(gate(health_score_patience=1), [0.8, 0.65]) == [2]


def test_ema_scores_are_watched_before_live_ones():
    g = gate()
    for step in (1, 2, 3):  # live collapses, the EMA holds: no stop
        assert g.observe(step, {"val/live/mean_score": 1.0 / step,
                                "val/ema/mean_score": 0.9}) is None


def test_a_diverging_critic_stops_after_its_patience():
    g = gate()
    ratios = [1.0, 12.0, 15.0, 9.0, 20.0, 30.0, 40.0]
    stops = [s for s, r in enumerate(ratios, 1) if g.observe(s, {"critic_loss_rel": r})]
    assert stops == [7]
    assert gate(health_critic_max_ratio=0).observe(1, {"critic_loss_rel": 1e9}) is None


def test_a_critic_with_nothing_left_to_learn_stops_after_its_patience():
    g = gate()
    ratios = [1.0, 0.5, 0.005, 0.004, 0.02, 0.003, 0.002, 0.001]
    stops = [s for s, r in enumerate(ratios, 1) if g.observe(s, {"critic_loss_rel": r})]
    assert stops == [8]  # three in a row, after 0.02 broke the first run
    reason = gate().observe(1, {"critic_loss_rel": 0.0})
    assert reason is None  # one step is not a trend
    assert gate(health_critic_min_ratio=0).observe(1, {"critic_loss_rel": 0.0}) is None


def samples(g: HealthGate, values, name: str, weights="ema"):
    """Feed one validation per value of the sample statistic `name`; the stop reasons."""
    return [(step, reason) for step, v in enumerate(values, 1)
            if (reason := g.observe(step, {f"val/{weights}/{name}": v})) is not None]


@pytest.mark.parametrize("name, collapse", [("motion", "a static video"),
                                            ("contrast", "a colour flood")])
def test_samples_that_stop_moving_or_flood_stop_a_distillation_stage(name, collapse):
    # 0.03 is above 0.2 x 0.1: it passes and resets the count
    stops = samples(gate(), [0.08, 0.1, 0.015, 0.03, 0.01, 0.005], name)
    assert [s for s, _ in stops] == [6]
    reason = stops[0][1]
    assert reason.gate == "samples" and collapse in reason.message
    assert f"val/ema/{name}" in reason.message and "0.1000 at step 2" in reason.message
    assert samples(gate(health_sample_min_ratio=0), [0.1, 0.0, 0.0, 0.0], name) == []
    # a pretrain's first samples are noise, which moves more than any video: not watched
    assert samples(gate(stage="fm"), [0.5, 0.01, 0.01, 0.01], name) == []


def test_the_gate_off_never_stops():
    assert scores(gate(health_gate=False), [1.0, 0.0, 0.0, 0.0]) == []


def test_a_resumed_gate_continues_the_counts_of_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 10, "val/ema/mean_score": 0.9}, {"step": 20, "val/ema/mean_score": 0.5},
             {"step": 30, "val/ema/mean_score": 0.4}]  # step 30 is past the resume point
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4')
    g = gate()
    g.replay(path, through_step=20)
    assert g.score.best == 0.9 and g.score.below == 1
    assert g.observe(30, {"val/ema/mean_score": 0.5}) is not None
    # the sample statistics' counts continue too
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 10, "val/ema/motion": 0.1}, {"step": 20, "val/ema/motion": 0.01}]))
    g = gate()
    g.replay(path, through_step=20)
    assert g.observe(30, {"val/ema/motion": 0.01}).gate == "samples"




@pytest.mark.parametrize("overrides, message", [
    ({"health_score_margin": 1.5}, "health_score_margin"),
    ({"health_score_patience": 0}, "health_score_patience"),
    ({"health_critic_max_ratio": 0.5}, "health_critic_max_ratio"),
    ({"health_critic_min_ratio": 1.0}, "health_critic_min_ratio"),
    ({"health_sample_min_ratio": -0.1}, "health_sample_min_ratio"),
    ({"health_gate": "true", "stage": "fm", "validation_interval": 0}, "nothing to watch"),
])
def test_preflight_rejects_a_gate_that_cannot_work(overrides, message):
    argv = [token for key, value in overrides.items() for token in (f"--{key}", str(value))]
    with pytest.raises(ConfigError, match=message):
        resolve_config(str(REPO / "config/tiny/stage2.yaml"), argv, check_paths=False)


def train(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "trainer/train.py", *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A 2-step FM run with EMA: teacher, critic and student of the Stage2 runs below."""
    tmp = tmp_path_factory.mktemp("health")
    proc = train("--config", "config/tiny/pretrain.yaml", "--max_steps", "2",
                 "--train_batch_size", "4", "--synthetic_num_samples", "32",
                 "--data_path", str(tmp / "data"), "--output_dir", str(tmp / "sft"),
                 "--use_ema", "true", "--warmup_steps", "0", "--validation_interval", "-1",
                 "--transformer_config_overrides", MODEL % "")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def stage2(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    sft = str(tmp / "sft")
    return train("--config", "config/tiny/stage2.yaml", "--student_init_path", sft,
                 "--teacher_init_path", sft, "--critic_init_path", sft,
                 "--data_path", str(tmp / "data"), "--synthetic_num_samples", "32",
                 "--train_batch_size", "4", "--generator_update_interval", "3",
                 "--save_interval", "100", "--log_interval", "1",
                 "--output_dir", str(tmp / name), "--health_gate", "true",
                 "--transformer_config_overrides", MODEL % ", causal_chunk_size: 2", *extra)


def test_a_broken_critic_learning_rate_stops_stage2_saved_and_says_why(sources):
    proc = stage2(sources, "broken", "--critic_learning_rate", "1.0", "--max_steps", "30",
                  "--validation_interval", "-1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = sources / "broken"
    result = json.loads((out / "run-result.json").read_text())
    stop = result["stop_reason"]
    assert result["status"] == "failed" and stop["gate"] == "critic"
    assert stop["step"] < 30 and "critic_learning_rate" in result["error"]
    assert result["last_checkpoint"] == str(out / f"checkpoint-{stop['step']}")
    assert (out / f"checkpoint-{stop['step']}" / "COMPLETE").is_file()  # saved before stopping
    assert "health gate" in proc.stderr
    reason = explain_failure("FAILED", None, result, {"depends_on": []}, {})
    assert reason.startswith("stopped by the health gate (critic)") and "checkpoint-" in reason


def test_a_healthy_stage2_runs_to_the_end_and_logs_what_the_gate_watches(sources):
    proc = stage2(sources, "healthy", "--max_steps", "8", "--validation_interval", "4",
                  "--validation_num_captions", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = sources / "healthy"
    assert json.loads((out / "run-result.json").read_text())["status"] == "completed"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["critic_loss_rel"] == pytest.approx(1.0)
    assert all(r["critic_loss_rel"] < 10 for r in records)
    assert "generator_critic_loss_ratio" in records[-1] and records[-1]["dmd_grad_rms"] > 0
    assert "val/ema/mean_score" in records[3]  # the score the gate watches, at step 4
    # and what any data shows: the samples move and vary within a frame
    assert records[3]["val/ema/motion"] > 0 and records[3]["val/ema/contrast"] > 0
