"""The train.py argument contract: YAML sections flattened, CLI wins, every bad config refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fastvideo_t2v import write_fastvideo_dataset

from trainer.resolve import resolve_args, resolve_config

from trainer.config.schema import ARGS, ConfigError, render_reference

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BASE = """
data:
  data_path: {data}
output:
  output_dir: {out}
"""


def base_yaml(tmp_path, extra=""):
    if not (tmp_path / "data").exists():  # samples the default model takes (preflight reads them)
        write_fastvideo_dataset(tmp_path / "data", 6, channels=3, text_dim=32)
    return write(tmp_path, BASE.format(data=tmp_path / "data", out=tmp_path / "out") + extra)


def resolve(argv):
    args, _ = resolve_args(argv)
    return args


def test_yaml_value_beats_parser_default(tmp_path):
    # learning_rate's parser default is 1e-4; the YAML must win even though argparse knows it.
    cfg = base_yaml(tmp_path, "training:\n  learning_rate: 0.007\n  max_steps: 17\n")
    args = resolve(["--config", cfg])
    assert args.learning_rate == 0.007
    assert args.max_steps == 17
    assert args.weight_decay == ARGS["weight_decay"].default  # untouched keys get defaults


def test_command_line_beats_yaml(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  learning_rate: 0.007\n")
    args = resolve(["--config", cfg, "--learning_rate", "3e-4", "--use_muon", "true"])
    assert args.learning_rate == 3e-4
    assert args.use_muon is True


def test_command_line_key_before_config_flag_still_wins(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  max_steps: 5\n")
    assert resolve(["--max_steps", "9", "--config", cfg]).max_steps == 9


def test_sections_are_free_form(tmp_path):
    cfg = base_yaml(tmp_path, "my_own_section:\n  learning_rate: 0.5\nmax_steps: 3\n")
    args = resolve(["--config", cfg])
    assert args.learning_rate == 0.5 and args.max_steps == 3


def test_unknown_key_names_file_section_key_and_closest(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError) as err:
        resolve(["--config", cfg])
    msg = str(err.value)
    assert cfg in msg and "`training`" in msg and "learning_rat" in msg
    assert "`learning_rate`" in msg


def test_unknown_command_line_key_suggests_closest(tmp_path):
    cfg = base_yaml(tmp_path)
    with pytest.raises(ConfigError, match="save_intervall.*`save_interval`"):
        resolve(["--config", cfg, "--save_intervall", "3"])


def test_key_in_two_sections_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  seed: 1\nmodel:\n  seed: 2\n")
    with pytest.raises(ConfigError, match="`seed` is set twice"):
        resolve(["--config", cfg])


def test_key_twice_in_one_section_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match="duplicate key seed"):
        resolve(["--config", cfg])


@pytest.mark.parametrize("line,key,expected", [
    ("max_steps: ten", "max_steps", "an integer"),
    ("max_steps: 1.5", "max_steps", "an integer"),
    ("use_muon: 'yes'", "use_muon", "true or false"),
    ("learning_rate: fast", "learning_rate", "a number"),
    ("lr_scheduler_type: wobbly", "lr_scheduler_type", "one of constant, linear, cosine"),
    ("transformer_config_overrides: 5", "transformer_config_overrides", "a mapping"),
    ("warm_start_allow_missing: 3", "warm_start_allow_missing", "a list of strings"),
])
def test_wrong_type_names_key_and_expected_type(tmp_path, line, key, expected):
    cfg = base_yaml(tmp_path, f"x:\n  {line}\n")
    with pytest.raises(ConfigError) as err:
        resolve(["--config", cfg])
    assert f"`{key}`" in str(err.value) and expected in str(err.value)


def test_wrong_type_on_command_line(tmp_path):
    cfg = base_yaml(tmp_path)
    with pytest.raises(ConfigError, match="`max_steps` must be an integer"):
        resolve(["--config", cfg, "--max_steps", "many"])
    with pytest.raises(ConfigError, match="true or false"):
        resolve(["--config", cfg, "--use_ema", "maybe"])


def test_old_key_names_are_translated_with_warning(tmp_path):
    cfg = base_yaml(tmp_path, "model:\n  transformer_config_overrides:\n    heads_num: 4\n"
                              "    rope_dim_list: [8, 8, 8]\n  mm_single_blocks_depth: 2\n"
                              "training:\n  lr: 0.25\n")
    with pytest.warns(UserWarning, match="old name"):
        args = resolve(["--config", cfg])
    overrides = args.transformer_config_overrides
    assert overrides["num_attention_heads"] == 4
    assert overrides["rope_axes_dim"] == [8, 8, 8]
    assert overrides["num_layers"] == 2
    assert args.learning_rate == 0.25


def test_dicts_lists_booleans_and_null(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    write_fastvideo_dataset(d1, 6, channels=3, text_dim=32)
    write_fastvideo_dataset(d2, 6, channels=3, text_dim=32)
    cfg = write(tmp_path, f"""
data:
  data_path: {{{d1}: 1, {d2}: 3}}
model:
  transformer_config_overrides: {{hidden_size: 48, rope_axes_dim: [4, 4, 4], patch_size: [1, 2, 2]}}
  warm_start_allow_missing: ["r_embedder.*"]
training:
  lr_decay_steps: null
  deterministic: true
output:
  output_dir: {tmp_path / 'o'}
""")
    args = resolve(["--config", cfg, "--lr_decay_steps", "7", "--warm_start_allow_unexpected",
                    "[a.*, b]", "--wandb_run_name", "null"])
    assert args.data_path == {str(d1): 1, str(d2): 3}
    assert args.transformer_config_overrides == {"hidden_size": 48, "rope_axes_dim": [4, 4, 4],
                                                 "patch_size": [1, 2, 2]}
    assert args.warm_start_allow_missing == ["r_embedder.*"]
    assert args.warm_start_allow_unexpected == ["a.*", "b"]
    assert args.lr_decay_steps == 7 and args.deterministic is True
    assert args.wandb_run_name is None


def test_json_on_the_command_line_keeps_exponent_floats(tmp_path):
    # json.dumps writes 1e-6 as `1e-06`, which YAML 1.1 reads as a string: a config written by
    # a script must reach the model as the number it is.
    cfg = base_yaml(tmp_path, "model:\n  model_family: wan\n")
    overrides = {"eps": 1e-06, "num_layers": 2, "in_channels": 3, "out_channels": 3,
                 "text_dim": 32, "patch_size": [1, 4, 4], "num_attention_heads": 2,
                 "attention_head_dim": 8, "ffn_dim": 32, "freq_dim": 32}
    args = resolve(["--config", cfg, "--transformer_config_overrides", json.dumps(overrides)])
    assert args.transformer_config_overrides == overrides


def test_omegaconf_interpolation_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_TEST_OUT", str(tmp_path / "from-env"))
    write_fastvideo_dataset(tmp_path / "data", 6, channels=3, text_dim=32)
    cfg = write(tmp_path, f"""
data:
  data_path: {tmp_path / 'data'}
output:
  output_dir: ${{oc.env:RELAY_TEST_OUT}}
  save_interval: ${{training.max_steps}}
training:
  max_steps: 40
""")
    args = resolve(["--config", cfg])
    assert args.output_dir == str(tmp_path / "from-env")
    assert args.save_interval == 40


def test_missing_env_interpolation_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAY_SURELY_UNSET", raising=False)
    cfg = base_yaml(tmp_path, "training:\n  seed: ${oc.env:RELAY_SURELY_UNSET}\n")
    with pytest.raises(ConfigError, match="RELAY_SURELY_UNSET"):
        resolve(["--config", cfg])


def test_env_interpolation_on_the_command_line_resolves_as_in_the_yaml(tmp_path, monkeypatch,
                                                                       capsys):
    from launcher.cli import main as relay_main

    monkeypatch.setenv("RELAY_TEST_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.delenv("RELAY_SURELY_UNSET", raising=False)
    cfg = base_yaml(tmp_path)

    def resolve(argv):  # train.py's and relay resolve's parsing of `--key value` tokens
        return resolve_config(cfg, argv, check_paths=False)

    args = resolve(["--output_dir", "${oc.env:RELAY_TEST_SCRATCH}/run",
                    "--seed=${oc.env:RELAY_SURELY_UNSET,7}"])
    assert args.output_dir == str(tmp_path / "scratch" / "run") and args.seed == 7
    # Unset: refused naming the variable, never a directory called "${oc.env:...}".
    with pytest.raises(ConfigError, match=r"RELAY_SURELY_UNSET, which is not set"):
        resolve(["--output_dir", "${oc.env:RELAY_SURELY_UNSET}/run"])
    assert relay_main(["resolve", cfg, "--output_dir", "${oc.env:RELAY_SURELY_UNSET}"]) == 2
    captured = capsys.readouterr()
    assert "RELAY_SURELY_UNSET, which is not set" in captured.err and "Traceback" not in captured.err
    with pytest.raises(ConfigError, match="references to other keys work in the YAML only"):
        resolve(["--output_dir", "${training.seed}"])
    assert not any("${" in p.name for p in tmp_path.rglob("*"))


def test_warm_start_path_with_switch_off_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, f"model:\n  pretrained_transformer_path: {tmp_path}\n"
                              "  load_transformer_weights: false\n")
    with pytest.raises(ConfigError, match="load_transformer_weights: true"):
        resolve(["--config", cfg])


def test_switch_on_without_path_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "model:\n  load_transformer_weights: true\n")
    with pytest.raises(ConfigError, match="pretrained_transformer_path` is null"):
        resolve(["--config", cfg])


def test_zero_init_modulation_inside_overrides_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "model:\n  transformer_config_overrides:\n"
                              "    zero_init_modulation: false\n")
    with pytest.raises(ConfigError, match="top-level key only"):
        resolve(["--config", cfg])


def test_unknown_model_override_names_closest(tmp_path):
    cfg = base_yaml(tmp_path, "model:\n  transformer_config_overrides:\n    hiden_size: 8\n")
    with pytest.raises(ConfigError, match="hiden_size.*`hidden_size`"):
        resolve(["--config", cfg])


def test_heads_not_divisible_by_cp_size_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "model:\n  transformer_config_overrides:\n"
                              "    num_attention_heads: 6\n    hidden_size: 48\n"
                              "    rope_axes_dim: [4, 2, 2]\ndistributed:\n  cp_size: 4\n")
    with pytest.raises(ConfigError, match=r"attention heads \(6\).*cp_size \(4\)"):
        resolve(["--config", cfg])


def test_world_not_divisible_by_cp_size_is_rejected(tmp_path):
    cfg = base_yaml(tmp_path, "distributed:\n  cp_size: 4\n")
    with pytest.raises(ConfigError, match="world size 6 is not divisible by cp_size 4"):
        resolve_config(cfg, [], world_size=6)


def test_global_batch_arithmetic_must_add_up(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  train_batch_size: 4\n  global_batch_size: 64\n"
                              "  gradient_accumulation_steps: 2\n")
    resolve_config(cfg, [], world_size=8)  # 4 x 2 x 8 = 64
    with pytest.raises(ConfigError, match=r"4\) x gradient_accumulation_steps \(2\) x "
                                          r"data-parallel size \(4\) = 32"):
        resolve_config(cfg, [], world_size=4)


def test_missing_data_path_and_output_dir_are_errors(tmp_path):
    cfg = write(tmp_path, "training:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="output_dir"):
        resolve(["--config", cfg])
    with pytest.raises(ConfigError, match="data_path` is not set"):
        resolve(["--config", cfg, "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(["--config", cfg, "--output_dir", str(tmp_path), "--data_path",
                 str(tmp_path / "nope")])


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(["--config", str(tmp_path / "absent.yaml")])


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_fastvideo_dataset(tmp_path / "data", 6, channels=3, text_dim=32)
    cfg = write(tmp_path, "data:\n  data_path: data\noutput:\n  output_dir: runs/x\n")
    args = resolve(["--config", cfg])
    assert args.output_dir == str(tmp_path / "runs" / "x")
    assert args.data_path == str(tmp_path / "data")


def test_launcher_mapping_overrides_are_typed(tmp_path):
    cfg = base_yaml(tmp_path)
    args = resolve_config(cfg, {"max_steps": 11, "use_ema": True})
    assert args.max_steps == 11 and args.use_ema is True
    with pytest.raises(ConfigError, match="`max_steps` must be an integer"):
        resolve_config(cfg, {"max_steps": "11"})


def run_train(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "trainer/train.py", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_prints_resolved_json_with_cli_override():
    proc = run_train("--config", "config/tiny/pretrain.yaml", "--dry-run",
                     "--learning_rate", "3e-4")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    assert resolved["learning_rate"] == 3e-4
    assert resolved["max_steps"] > 0 and resolved["output_dir"].endswith("runs/tiny/pretrain")


def test_module_entry_point_matches_script_entry_point():
    by_script = run_train("--config", "config/tiny/pretrain.yaml", "--dry-run")
    by_module = subprocess.run([sys.executable, "-m", "trainer.train", "--config",
                                "config/tiny/pretrain.yaml", "--dry-run"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
    assert by_script.returncode == 0 and by_module.returncode == 0, by_module.stderr
    assert json.loads(by_script.stdout) == json.loads(by_module.stdout)


def test_config_error_is_one_paragraph_without_traceback(tmp_path):
    cfg = base_yaml(tmp_path, "training:\n  learning_rat: 0.1\n")
    proc = run_train("--config", cfg, "--dry-run")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("relay: config error:") and "learning_rate" in proc.stderr


def test_relay_resolve_prints_the_same_json():
    relay = Path(sys.executable).with_name("relay")
    a = run_train("--config", "config/tiny/pretrain.yaml", "--dry-run", "--seed", "5")
    b = subprocess.run([str(relay), "resolve", "config/tiny/pretrain.yaml", "--seed", "5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert b.returncode == 0, b.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_config_reference_is_up_to_date():
    doc = (ROOT / "docs" / "config-reference.md").read_text()
    assert doc == render_reference(), (
        "docs/config-reference.md is stale: run `python -m trainer.config.schema --markdown > "
        "docs/config-reference.md`")
