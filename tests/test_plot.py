"""`relay plot`: the PNG exists, has the promised size, one column per stage and a panel per
kind of metric (its pixels are matplotlib's business, not ours)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from launcher.plot import PANELS, build_figure, read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_metrics(out: Path, records: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def fm_records(steps: int) -> list[dict]:
    records = [{"step": s, "loss": 1.0 / s, "grad_norm": 0.5, "lr": 1e-3, "muon_lr": 0.02,
                "step_time_s": 0.3, "sigma_mean": 0.7} for s in range(1, steps + 1)]
    records[-1].update({"val/live/colour_accuracy": 1.0, "val/live/direction_accuracy": 0.5})
    return records


def dmd_records(steps: int) -> list[dict]:
    return [{"step": s, "loss": 1.2, "critic_loss": 1.2, "generator_loss": 0.01,
             "critic_grad_norm": 0.3, "student_grad_norm": 0.05, "lr": 2e-5, "critic_lr": 1e-4,
             "step_time_s": 0.2} for s in range(1, steps + 1)]


def relay(*args: str, cwd: Path = ROOT):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def panel_lines(figure) -> dict[str, list[str]]:
    """Axes title -> the labels of the lines drawn in it."""
    return {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in figure.axes}


def test_every_loss_term_lr_norm_step_time_and_score_gets_its_panel():
    figure = build_figure([("pretrain", fm_records(30)), ("stage2", dmd_records(20))])
    lines = panel_lines(figure)
    assert len(figure.axes) == 2 * len(PANELS) == 10
    assert lines["pretrain: loss"] == ["loss"]
    assert lines["pretrain: learning rate"] == ["lr", "muon_lr"]
    assert lines["pretrain: validation"] == ["val/live/colour_accuracy",
                                             "val/live/direction_accuracy"]
    assert lines["stage2: loss"] == ["loss", "critic_loss", "generator_loss"]
    assert lines["stage2: gradient norm"] == ["critic_grad_norm", "student_grad_norm"]
    assert lines["stage2: learning rate"] == ["lr", "critic_lr"]
    assert lines["stage2: step time"] == ["step_time_s"]
    assert lines["stage2: validation"] == []  # Stage2 validated nothing: the panel says so
    assert "sigma_mean" not in sum(lines.values(), [])


def test_relay_plot_of_a_pipeline_root_puts_its_stages_side_by_side(tmp_path):
    root = tmp_path / "runs"
    stages = {"pretrain": fm_records(30), "sft": fm_records(10), "stage2": dmd_records(5)}
    for name, records in stages.items():
        write_metrics(root / name, records)
    (root / "pipeline.json").write_text(json.dumps({"stages": {
        name: {"output_dir": str(root / name), "job_id": None} for name in stages}}))
    proc = relay("plot", str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(root / "plot.png")
    # 4.2 x 2.3 inches per panel at 100 dpi: three columns, five rows.
    assert Image.open(root / "plot.png").size == (3 * 420, 5 * 230)

    one = relay("plot", str(root / "sft"), "--out", str(tmp_path / "sft.png"))
    assert one.returncode == 0, one.stderr
    assert Image.open(tmp_path / "sft.png").size == (420, 5 * 230)


def test_plot_skips_a_line_being_written_and_refuses_a_directory_without_metrics(tmp_path):
    run = write_metrics(tmp_path / "run", fm_records(3))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    proc = relay("plot", str(tmp_path))
    assert proc.returncode == 2
    assert "neither a pipeline root" in proc.stderr and "Traceback" not in proc.stderr
