"""`relay data encode` end to end: a tiny random AutoencoderKLWan and a tiny UMT5 encoder saved to
a temp directory, small real video and image files, the shards read back by the trainer."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("transformers", reason="needs the encode extra")
imageio = pytest.importorskip("imageio.v3")

from trainer.data import ParquetLatentDataset, SampleIndex
from trainer.data.encode import EncodeError, MediaEncoder, encode_manifest, load_media
from trainer.encoders.text import build_text_encoder

from fixtures.tiny_encoders import save_text_encoder, save_vae


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    save_text_encoder(root / "text")
    save_vae(root / "vae")
    return root / "vae", root / "text"


@pytest.fixture()
def media(tmp_path):
    rng = np.random.default_rng(0)
    entries = []
    for n, caption in enumerate(["a red square moving left", "a blue circle moving up"]):
        path = tmp_path / f"clip{n}.mp4"
        imageio.imwrite(path, (rng.random((9, 32, 48, 3)) * 255).astype(np.uint8), fps=8, plugin="FFMPEG")
        entries.append({"path": path.name, "caption": caption})
    imageio.imwrite(tmp_path / "still.png", (rng.random((32, 32, 3)) * 255).astype(np.uint8))
    entries.append({"path": "still.png", "caption": "a green square still"})
    (tmp_path / "broken.mp4").write_bytes(b"not a video" * 20)
    entries += [{"path": "broken.mp4", "caption": "a red circle"},
                {"path": "missing.mp4", "caption": "a blue square"}]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(entries))
    return manifest


def test_encode_writes_shards_the_trainer_reads_and_lists_bad_files(models, media, tmp_path):
    vae, text = models
    out = tmp_path / "encoded"
    summary = encode_manifest(media, vae_dir=vae, text_encoder_dir=text, out_dir=out,
                              rows_per_shard=2, skip_layer=1, progress=False)
    assert summary["encoded"] == 3
    assert sorted(b["path"].rsplit("/", 1)[1] for b in summary["bad"]) == ["broken.mp4", "missing.mp4"]
    index = SampleIndex(str(out))
    # 9 frames -> 1 + 8/2 = 5 latent frames; 32x48 / 2; the image is one frame.
    assert sorted(map(tuple, index.shape.tolist())) == [(4, 1, 16, 16), (4, 5, 16, 24), (4, 5, 16, 24)]
    assert index.is_image.sum() == 1
    dataset = ParquetLatentDataset(str(out), pad_text=False)
    encoder = MediaEncoder(vae, text, skip_layer=1)
    for i in range(len(dataset)):
        item = dataset[i]
        frames, _, _ = load_media(item_path(item, media))
        torch.testing.assert_close(item["latent"], encoder.latent(frames))
        hidden, mask = build_text_encoder(str(text), skip_layer=1, max_tokens=512).encode([item["caption"]])
        torch.testing.assert_close(item["text"], hidden[0, mask[0]])
        assert item["text"].shape[0] == len(item["caption"].split())   # real tokens only, no padding


def item_path(item, manifest):
    return str(manifest.parent / {"sample-00000000": "clip0.mp4", "sample-00000001": "clip1.mp4",
                                  "sample-00000002": "still.png"}[item["id"]])


def test_skip_layer_selects_an_earlier_hidden_state(models):
    _, text = models
    last, _ = build_text_encoder(str(text), skip_layer=0).encode(["a red square"])
    earlier, _ = build_text_encoder(str(text), skip_layer=1).encode(["a red square"])
    assert not torch.allclose(last, earlier)
    with pytest.raises(ValueError, match="must be in"):
        build_text_encoder(str(text), skip_layer=2)


def test_a_restarted_encode_redoes_only_the_unfinished_part(models, media, tmp_path):
    vae, text = models
    out = tmp_path / "encoded"
    kwargs = dict(vae_dir=vae, text_encoder_dir=text, out_dir=out, rows_per_shard=2, progress=False)
    encode_manifest(media, **kwargs)
    before = {p.name: p.read_bytes() for p in out.glob("*.parquet")}
    # A kill during part 1: its parquet may be half-written as .tmp, its record missing.
    (out / "part-r000-00001.json").unlink()
    (out / "part-r000-00001.parquet").rename(out / "part-r000-00001.parquet.tmp")
    again = encode_manifest(media, **kwargs)
    assert again["skipped"] == 2 and again["encoded"] == 1   # part 0 kept; part 1 redone
    assert {p.name: p.read_bytes() for p in out.glob("*.parquet")} == before
    with pytest.raises(EncodeError, match="another --out or the same split"):
        encode_manifest(media, **{**kwargs, "rows_per_shard": 3})


def test_two_processes_split_the_manifest_without_overlap(models, media, tmp_path):
    vae, text = models
    out = tmp_path / "encoded"
    for rank in (0, 1):
        encode_manifest(media, vae_dir=vae, text_encoder_dir=text, out_dir=out, rank=rank,
                        world_size=2, progress=False)
    ids = [r for p in sorted(out.glob("*.parquet")) for r in pq.read_table(p, columns=["id"])["id"].to_pylist()]
    assert sorted(ids) == ["sample-00000000", "sample-00000001", "sample-00000002"]


def test_relay_data_encode_takes_a_csv_manifest_and_exits_1_listing_bad_files(models, media, tmp_path,
                                                                               capsys):
    from launcher.cli import main

    vae, text = models
    rows = json.loads(media.read_text())
    csv_manifest = media.with_suffix(".csv")
    csv_manifest.write_text("path,caption\n" + "".join(f"{r['path']},{r['caption']}\n" for r in rows))
    code = main(["data", "encode", str(csv_manifest), "--vae", str(vae), "--text-encoder", str(text),
                 "--out", str(tmp_path / "encoded")])
    out = capsys.readouterr().out
    assert code == 1 and "encoded 3" in out and out.count("  bad: ") == 2
    assert main(["data", "encode", str(tmp_path / "nope.csv"), "--vae", str(vae), "--text-encoder",
                 str(text), "--out", str(tmp_path / "x")]) == 2


def test_a_text_encoder_directory_without_its_tokenizer_is_named_with_the_missing_files(
        models, media, tmp_path, capsys):
    import shutil

    from launcher.cli import main

    vae, text = models
    bare = tmp_path / "umt5-no-tokenizer"
    shutil.copytree(text, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    code = main(["data", "encode", str(media), "--vae", str(vae), "--text-encoder", str(bare),
                 "--out", str(tmp_path / "encoded")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{bare} holds no tokenizer" in err and "tokenizer.json" in err and "spiece.model" in err
    assert "config.json" in err  # what the directory does hold
    assert "sentencepiece or tiktoken" not in err and "Traceback" not in err
