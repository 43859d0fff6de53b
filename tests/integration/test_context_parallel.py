"""Ulysses context parallel (cp_size > 1): real ranks under torchrun (gloo, CPU), nothing mocked.

First the model alone (tests/context_parallel_worker.py): every forward, the packed rollout
among them, its video and caption tokens split over 2 and 4 ranks (captions of 5 tokens, a
pack's of 11: padded to split), against the same model unsplit. Then train.py, with captions
of 5 tokens: the same global batch of 8 samples on one process, on one cp group of 2 and on
dp 2 x cp 2 must log the same losses and gradient norms (the draws are keyed by sample, cp
rank 0 reads and shares the batch, the gathered output feeds the unchanged losses); the same
for Stage1 (block-causal teacher forcing), Stage2 (the KV-cached rollout), a pack of mixed
shapes, and Stage2 on such packs (the packed rollout); a cp checkpoint resumes on one process
on the same trajectory; the wan family trains the same at dp 2 and cp 2, and a cp 2 checkpoint
resumes at cp 2 bit for bit (the same layout) and at dp 2 within the tolerance (another layout
sums in another order); a split that cannot work is refused before a model exists.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from fixtures.fastvideo_t2v import write_fastvideo_dataset
from fixtures.ports import free_port
from test_distributed_fsdp import (MODEL, REPO, STAGE1_MODEL, STAGE2_MODEL, _env,
                                   assert_same_trajectory, records, train)

from trainer.checkpoint.layout import read_complete


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_forward_of_the_model_matches_the_unsplit_model(tmp_path, ranks):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
         str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(REPO / "tests" / "context_parallel_worker.py"), str(tmp_path)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(ranks):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        refusal = result.pop("refused")
        assert refusal and "runs of 9 tokens" in refusal and f"cp_size {ranks}" in refusal
        # Every rank's share of the caption moves the output a million times the tolerance
        # below, so a share that went wrong would show.
        assert min(result.pop("caption_share_moves_output")) > 1e-6
        # A rollout caches the whole caption (padded to a multiple of ranks: 6 or 8 keys) for
        # this rank's heads only (4 heads in all).
        padded = math.ceil(5 / ranks) * ranks
        assert result.pop("cached_text") == {"whole": [5, 4], "split": [padded, 4 // ranks]}
        # A packed rollout caches each caption whole for this rank's heads, the last one
        # with the pack's padding (11 caption tokens: 12 keys in all).
        last = 3 + math.ceil(11 / ranks) * ranks - 11
        assert result.pop("cached_pack") == {"whole": [[3, 4], [5, 4], [3, 4]],
                                             "split": [[3, 4 // ranks], [5, 4 // ranks],
                                                       [last, 4 // ranks]]}
        assert set(result) == {"bidirectional", "unmasked_caption", "per_frame_times",
                               "block_causal", "teacher_forcing", "kv_rollout", "packed",
                               "packed_rollout"}
        for case, diff in result.items():  # float64: only the order of sums differs
            assert diff["out"] < 1e-12, (case, diff)
            if "grad" in diff:
                assert diff["grad"] < 1e-12 * diff["grad_scale"], (case, diff)
            # A block's text stream holds ceil(L / size) of the caption's L tokens per rank.
            length = 11 if case.startswith("packed") else 5
            assert diff["text_tokens"] == {"whole": [length],
                                           "split": [math.ceil(length / ranks)]}, case


# Captions of 5 tokens, which 2 cp ranks split only once padded to 6 with a masked token.
CAPTION = ("--text_max_tokens", "5")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny pretrain on one global batch of 8: one process, cp 2, dp 2 x cp 2."""
    root = tmp_path_factory.mktemp("cp")
    data = root / "data"
    model = ("--transformer_config_overrides", MODEL, *CAPTION)
    splits = {"one": (1, "--train_batch_size", "8"),
              "cp2": (2, "--train_batch_size", "8", "--cp_size", "2"),
              "dp2cp2": (4, "--train_batch_size", "4", "--cp_size", "2")}
    for name, (ranks, *extra) in splits.items():
        train(root / name, data, ranks, *model, *extra)
    return root, data


def test_pretrain_losses_and_gradients_agree_on_one_process_cp2_and_dp2_x_cp2(runs):
    root, _ = runs
    for name in ("cp2", "dp2cp2"):
        assert_same_trajectory(root / name, root / "one")
    losses = [r["loss"] for r in records(root / "one").values()]
    assert losses[-1] < losses[0]  # it trained
    # The split is real, and only cp rank 0 of each group saved a data cursor.
    for name, dp_ranks in (("cp2", ["0.json"]), ("dp2cp2", ["0.json", "1.json"])):
        complete = read_complete(root / name / "checkpoint-6")
        assert complete["cp_size"] == 2 and complete["world_size"] == 2 * len(dp_ranks)
        cursors = sorted(p.name for p in (root / name / "checkpoint-6" / "dataloader").iterdir())
        assert cursors == dp_ranks


def test_a_cp2_checkpoint_resumes_on_one_process_on_the_same_trajectory(runs):
    root, data = runs
    out = root / "resume-cp2-on-one"
    out.mkdir()
    subprocess.run(["cp", "-r", str(root / "cp2" / "checkpoint-3"), str(out)], check=True)
    proc = train(out, data, 1, "--transformer_config_overrides", MODEL, *CAPTION,
                 "--train_batch_size", "8")
    assert "resumed from" in proc.stderr
    assert sorted(records(out)) == [4, 5, 6]
    assert_same_trajectory(out, root / "cp2", steps=[4, 5, 6])


STAGE2_EXTRA = ("--student_init_weights", "live", "--teacher_init_weights", "live",
                "--critic_init_weights", "live", "--generator_update_interval", "2",
                "--use_ema", "false")


@pytest.mark.parametrize("config, model, extra, keys", [
    ("stage1", STAGE1_MODEL, ("--pretrained_weights", "live"), ("loss", "grad_norm")),
    ("stage2", STAGE2_MODEL, STAGE2_EXTRA, ("critic_loss", "critic_grad_norm",
                                            "generator_loss")),
])
def test_stage1_and_stage2_give_the_same_losses_at_cp2_as_on_one_process(runs, tmp_path, config,
                                                                         model, extra, keys):
    root, _ = runs
    source = str(root / "one")
    sources = (("--pretrained_transformer_path", source) if config == "stage1" else
               ("--student_init_path", source, "--teacher_init_path", source,
                "--critic_init_path", source))
    common = ("--transformer_config_overrides", model, *CAPTION, *sources, *extra,
              "--max_steps", "4", "--train_batch_size", "4")
    train(tmp_path / "one", tmp_path / "data", 1, *common, config=config)
    train(tmp_path / "cp2", tmp_path / "data", 2, *common, "--cp_size", "2", config=config)
    assert_same_trajectory(tmp_path / "cp2", tmp_path / "one", keys=keys)
    assert set(keys) <= set(records(tmp_path / "cp2")[4])


PACKED_MODEL = ("{hidden_size: 16, num_attention_heads: 2, num_layers: 1, rope_axes_dim: [2, 2, 4], "
                "text_dim: 8, patch_size: [1, 2, 2], in_channels: 4}")


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    """The tiny pretrain in packs of mixed shapes on one process and at cp 2: videos and
    images, several sizes, captions of 3 to 11 tokens (packs of odd caption sums)."""
    root = tmp_path_factory.mktemp("cp-packed")
    data = write_fastvideo_dataset(root / "data", 24)
    common = ("--transformer_config_overrides", PACKED_MODEL, "--synthetic_data", "false",
              "--packing_token_budget", "60", "--max_steps", "4", "--train_batch_size", "4")
    train(root / "one", data, 1, *common)
    train(root / "cp2", data, 2, *common, "--cp_size", "2")
    return root, data


def test_a_pack_of_mixed_shapes_trains_the_same_at_cp2_as_on_one_process(packed_runs):
    root, _ = packed_runs
    assert_same_trajectory(root / "cp2", root / "one")
    cursor = json.loads((root / "cp2" / "checkpoint-4" / "dataloader" / "0.json").read_text())
    assert cursor["token_budget"] == 60  # it did train on packs


def test_stage2_on_packs_of_mixed_shapes_gives_the_same_losses_at_cp2(packed_runs, tmp_path):
    # The packed rollout's chunks and captions split over the cp group, its cache in head space.
    root, data = packed_runs
    source = str(root / "one")
    common = ("--transformer_config_overrides", PACKED_MODEL[:-1] + ", causal_chunk_size: 2}",
              "--synthetic_data", "false", "--packing_token_budget", "60",
              "--student_init_path", source, "--teacher_init_path", source,
              "--critic_init_path", source, *STAGE2_EXTRA, "--generator_update_interval", "1",
              "--max_steps", "3")
    train(tmp_path / "one", data, 1, *common, config="stage2")
    train(tmp_path / "cp2", data, 2, *common, "--cp_size", "2", config="stage2")
    keys = ("critic_loss", "critic_grad_norm", "generator_loss", "student_grad_norm")
    assert_same_trajectory(tmp_path / "cp2", tmp_path / "one", keys=keys)
    assert set(keys) <= set(records(tmp_path / "cp2")[3])  # the student trained too
    assert read_complete(tmp_path / "cp2" / "checkpoint-3")["cp_size"] == 2  # the split is real
    cursor = json.loads((tmp_path / "cp2" / "checkpoint-3" / "dataloader" / "0.json").read_text())
    assert cursor["token_budget"] == 60  # it did train on packs


def test_a_cp_split_that_cannot_work_is_refused_before_a_model_exists(tmp_path):
    # 12 x 12 pixels in 4 x 4 patches: 9 tokens a frame, which 2 cp ranks cannot share.
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(REPO / "trainer" / "train.py"), "--config", str(REPO / "config/tiny/pretrain.yaml"),
         "--data_path", str(tmp_path / "data"), "--output_dir", str(out), "--cp_size", "2",
         "--synthetic_height", "12", "--synthetic_width", "12"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "relay: config error: cp_size 2 does not divide the tokens of one latent frame: " \
           "3 x 3 = 9 patches a frame" in proc.stderr, proc.stderr[-3000:]
    # a sentence from each rank, no traceback of relay's (torchrun's agent prints its own)
    assert not [line for line in proc.stderr.splitlines() if 'File "' in line and "/trainer/" in line]
    assert not out.exists() and not (tmp_path / "data").exists()  # nothing was built or written


WAN_MODEL = ("{num_attention_heads: 2, attention_head_dim: 8, num_layers: 2, ffn_dim: 32, "
             "in_channels: 3, out_channels: 3, text_dim: 32, freq_dim: 32, patch_size: [1, 4, 4]}")


def test_wan_trains_the_same_at_dp2_and_cp2_and_a_cp2_checkpoint_resumes_at_cp2_and_dp2(tmp_path):
    # The wan family (cross-attention to the caption; every rank projects the caption whole)
    # through the same harness: one global batch of 8 on two ranks, split by data or by sequence.
    data = tmp_path / "data"
    common = ("--model_family", "wan", "--transformer_config_overrides", WAN_MODEL, *CAPTION,
              "--max_steps", "4", "--save_interval", "2")
    train(tmp_path / "dp2", data, 2, *common, "--train_batch_size", "4")
    train(tmp_path / "cp2", data, 2, *common, "--train_batch_size", "8", "--cp_size", "2")
    # Another layout agrees to a tolerance, not bit for bit. Both shard the weights over the
    # same 2 ranks and compute the norm the same way, but they sum the same float32 terms in
    # other orders: a weight's gradient sums over samples x tokens (a dp rank: 4 samples whole,
    # a cp rank: half the tokens of 8), and the loss averages 4 samples on a dp rank, 8 on a cp
    # rank. How those sums round depends on the CPU's kernels (the vector width of ATen's
    # reductions, MKL's and oneDNN's blocking of a matrix product), so the layouts differ in
    # float32's last bit (measured: at most 1.1e-7 relative over the 4 steps, with ATen's
    # AVX-512, AVX2 and scalar kernels and MKL/oneDNN at AVX-512, AVX2 and SSE4) and which steps
    # happen to agree bit for bit changes from CPU to CPU. RTOL (1e-4) is a thousand times
    # that and still tight: a step moves the loss by 2 to 6 %, a resume at a learning rate 1 %
    # off lands 2.5e-4 away at step 4, one that restarts the data stream 2.5e-2 at step 3.
    assert_same_trajectory(tmp_path / "cp2", tmp_path / "dp2")
    assert read_complete(tmp_path / "cp2" / "checkpoint-4")["cp_size"] == 2  # the split is real
    want = records(tmp_path / "cp2")
    for name, split in (("cp2", ("--train_batch_size", "8", "--cp_size", "2")),
                        ("dp2", ("--train_batch_size", "4"))):
        out = tmp_path / f"resume-cp2-at-{name}"
        out.mkdir()
        subprocess.run(["cp", "-r", str(tmp_path / "cp2" / "checkpoint-2"), str(out)], check=True)
        proc = train(out, data, 2, *common, *split)
        assert "resumed from" in proc.stderr
        got = records(out)
        assert sorted(got) == [3, 4]
        if name == "cp2":  # the same layout: the same sums in the same order, bit for bit
            assert [(got[s]["loss"], got[s]["grad_norm"]) for s in got] == \
                [(want[s]["loss"], want[s]["grad_norm"]) for s in got]
        else:  # resharded to another layout: within RTOL, as above
            assert_same_trajectory(out, tmp_path / "cp2", steps=[3, 4])
