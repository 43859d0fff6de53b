"""`relay data inspect` and `relay data plan`: what they print, and that they never need torch."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fixtures.fastvideo_t2v import T2V_SCHEMA, write_fastvideo_dataset

from launcher.cli import main
from trainer.data import BatchPlan, SampleIndex

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fastvideo_dir(tmp_path_factory):
    return write_fastvideo_dataset(tmp_path_factory.mktemp("fv"), 12, dtype=torch.float32)


def _relay(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_counts_shapes_tokens_and_dtypes(fastvideo_dir, capsys):
    code, out, _ = _relay(capsys, "data", "inspect", str(fastvideo_dir), "--json", "--verify")
    report = json.loads(out)
    assert code == 0 and report["layouts"] == ["fastvideo"]
    assert report["samples"] == 12 and report["images"] == 4 and report["shards"] == 2
    assert sorted((tuple(s["shape"]), s["count"]) for s in report["shapes"]) == [
        ((4, 1, 4, 6), 4), ((4, 2, 6, 4), 4), ((4, 3, 4, 6), 4)]
    assert report["text_tokens"] == {"min": 3, "median": 5.5, "max": 11}  # rows 0..11: 3 + n % 9
    assert report["dtypes"] == {"text_embedding:float32": 12, "vae_latent:float32": 12}


def test_inspect_verify_lists_a_row_whose_bytes_are_short_and_exits_1(tmp_path, capsys):
    write_fastvideo_dataset(tmp_path, 4, workers=1)
    path = tmp_path / "worker_0" / "data_chunk_0.parquet"
    rows = pq.read_table(path).to_pylist()
    rows[1]["vae_latent_bytes"] = rows[1]["vae_latent_bytes"][:-2]
    pq.write_table(pa.Table.from_pylist(rows, schema=T2V_SCHEMA), path)
    assert _relay(capsys, "data", "inspect", str(tmp_path))[0] == 0   # shapes alone look fine
    code, out, _ = _relay(capsys, "data", "inspect", str(tmp_path), "--verify")
    assert code == 1 and "row 1: vae_latent:" in out and "bad rows (shapes and byte counts): 1" in out


def test_plan_lists_what_the_trainer_would_read(fastvideo_dir, capsys):
    code, out, _ = _relay(capsys, "data", "plan", str(fastvideo_dir), "--world-size", "4",
                          "--cp-size", "2", "--rank", "3", "--seed", "5", "--token-budget", "60",
                          "--patch-size", "1", "2", "2", "--json", "--batches", "3")
    report = json.loads(out)
    plan = BatchPlan(SampleIndex(str(fastvideo_dir)), dp_rank=1, dp_world=2, seed=5,
                     token_budget=60, patch_size=(1, 2, 2))
    cursor = plan.initial_cursor()
    for batch in report["batches"]:
        indices, cursor = plan.next(cursor)
        assert batch["samples"] == indices.tolist()
    assert code == 0 and report["dp_rank"] == 1 and 0 < report["packing_efficiency"] <= 1


def test_plan_refuses_a_rank_outside_the_world(fastvideo_dir, capsys):
    code, _, err = _relay(capsys, "data", "plan", str(fastvideo_dir), "--world-size", "2", "--rank", "2")
    assert code == 2 and "outside the world" in err


def test_inspect_and_plan_never_import_torch(fastvideo_dir):
    code = ("import sys\nfrom launcher.cli import main\n"
            f"main(['data', 'inspect', {str(fastvideo_dir)!r}])\n"
            f"main(['data', 'plan', {str(fastvideo_dir)!r}, '--world-size', '2', '--token-budget', '60'])\n"
            "print('TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert "TORCH False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
