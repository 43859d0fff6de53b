"""The embedded default learns: tiny pretrain then SFT, on this CPU, produce the captioned clips.

This is the slow test of the suite: it trains the shipped tiny configs unchanged (only the
directories move into tmp) and scores the SFT checkpoint with `relay eval`, the same pixel
detector users read, against the bar the embedded default promises (docs/training.md).
About 2.5 minutes on two idle cores (docs/training.md); 21.7 minutes were measured on the
2-core VM with load average 3.6-6.2 (five engineers' jobs) when a clip cost twice as much, so
its timeout is three times that.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELAY = str(Path(sys.executable).with_name("relay"))


def train(config: str, *extra: str) -> None:
    proc = subprocess.run([sys.executable, "trainer/train.py", "--config", config,
                           "--validation_interval", "-1", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(3 * 22 * 60)
def test_tiny_pretrain_then_sft_draw_the_right_colour_and_direction(tmp_path):
    pretrain, sft = tmp_path / "pretrain", tmp_path / "sft"
    train("config/tiny/pretrain.yaml", "--output_dir", str(pretrain),
          "--data_path", str(tmp_path / "data-pretrain"))
    train("config/tiny/sft.yaml", "--output_dir", str(sft), "--data_path",
          str(tmp_path / "data-sft"), "--pretrained_transformer_path", str(pretrain))
    warm = json.loads((sft / "warm-start.json").read_text())
    assert warm["source"].startswith(str(pretrain / "checkpoint-"))  # from pretrain's checkpoint

    out = tmp_path / "eval.json"
    proc = subprocess.run([RELAY, "eval", "--checkpoint", str(sft), "--steps", "30",
                           "--guidance", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["num_clips"] == 48
    assert report["colour_accuracy"] >= 0.95, report
    # Motion is learned late and abruptly (25 % direction, chance, until pretrain step ~600),
    # and a CPU with other float kernels moves that moment: the same configs score 100 % on
    # one 2-vCPU VM and 89.6 % on another (docs/training.md). The bar is "learned", with room.
    assert report["direction_accuracy"] >= 0.80, report
