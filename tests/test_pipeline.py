"""Pipeline YAML validation: everything wrong is found before anything is submitted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.pipeline import (PipelineError, format_override, merge_resources,
                               parse_time_minutes, render_train_argv, select_stages,
                               validate_pipeline)
from trainer.args import resolve_config

ROOT = Path(__file__).resolve().parents[1]
TINY_PRETRAIN = str(ROOT / "config" / "tiny" / "pretrain.yaml")
TINY_SFT = str(ROOT / "config" / "tiny" / "sft.yaml")
SMALL = {"max_steps": 4, "warmup_steps": 1, "train_batch_size": 4, "synthetic_num_samples": 64}


def write_pipeline(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def two_stages(tmp_path: Path, **extra) -> dict:
    data = {
        "name": "t",
        "root": str(tmp_path / "runs"),
        "cluster": {"cpus_per_task": 1, "time": 10, "network": "none", "signal_lead_s": 60},
        "stages": {
            "pretrain": {"config": TINY_PRETRAIN,
                         "overrides": {**SMALL, "data_path": str(tmp_path / "d1")}},
            "sft": {"config": TINY_SFT,
                    "overrides": {**SMALL, "data_path": str(tmp_path / "d2"),
                                  "pretrained_transformer_path": "${stages.pretrain.output_dir}"}},
        },
    }
    data.update(extra)
    return data


def problems_of(path: Path, **kwargs) -> list[str]:
    with pytest.raises(PipelineError) as info:
        validate_pipeline(path, cwd=path.parent, **kwargs)
    return info.value.problems


def test_tiny_pipeline_validates_with_weights_wired_between_stages():
    pipeline = validate_pipeline(ROOT / "config/pipeline/tiny.yaml", root="/tmp/relay-unit-root",
                                 cwd=ROOT)
    pretrain, sft = pipeline.stages
    assert pretrain.output_dir == "/tmp/relay-unit-root/pretrain"
    assert sft.args.pretrained_transformer_path == "/tmp/relay-unit-root/pretrain"
    assert sft.depends_on == ("pretrain",) and pretrain.depends_on == ()
    assert pretrain.resources.world_size == 1
    assert pipeline.workdir == str(ROOT)


def test_root_option_moves_default_output_dirs_and_interpolations(tmp_path):
    path = write_pipeline(tmp_path, two_stages(tmp_path))
    pipeline = validate_pipeline(path, root="elsewhere", cwd=tmp_path)
    assert pipeline.root == str(tmp_path / "elsewhere")
    assert pipeline.output_dirs == {"pretrain": str(tmp_path / "elsewhere/pretrain"),
                                    "sft": str(tmp_path / "elsewhere/sft")}
    assert pipeline.stage("sft").args.pretrained_transformer_path == str(tmp_path / "elsewhere/pretrain")


def test_unknown_pipeline_stage_and_cluster_keys_get_closest_hints(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overides"] = {}
    path = write_pipeline(tmp_path, data)
    assert any("unknown key `overides`" in p and "`overrides`" in p for p in problems_of(path))

    data = two_stages(tmp_path)
    data["clustr"] = {}
    path = write_pipeline(tmp_path, data)
    assert any("unknown key `clustr`" in p and "`cluster`" in p for p in problems_of(path))

    data = two_stages(tmp_path)
    data["cluster"]["gpus_per_nod"] = 8
    path = write_pipeline(tmp_path, data)
    assert any("`gpus_per_node`" in p for p in problems_of(path))


def test_stage_config_errors_are_prefixed_with_the_stage_and_all_reported(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overrides"]["learning_rat"] = 1e-3
    data["stages"]["sft"]["overrides"]["max_steps"] = "many"
    problems = problems_of(write_pipeline(tmp_path, data))
    assert len(problems) == 2
    assert problems[0].startswith("stage pretrain:") and "learning_rate" in problems[0]
    assert problems[1].startswith("stage sft:") and "max_steps" in problems[1]


def test_missing_train_yaml_is_reported(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["sft"]["config"] = "config/tiny/nope.yaml"
    problems = problems_of(write_pipeline(tmp_path, data))
    assert problems == [p for p in problems if p.startswith("stage sft:")]
    assert "nope.yaml does not exist" in problems[0]


def test_interpolation_to_an_unknown_stage_is_an_error(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["sft"]["overrides"]["pretrained_transformer_path"] = "${stages.pretrian.output_dir}"
    problems = problems_of(write_pipeline(tmp_path, data))
    assert "stages.pretrian.output_dir" in problems[0]


def test_duplicated_and_nested_output_dirs_are_rejected(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["sft"]["output_dir"] = "${stages.pretrain.output_dir}"
    assert any("share output_dir" in p for p in problems_of(write_pipeline(tmp_path, data)))
    data["stages"]["sft"]["output_dir"] = "${stages.pretrain.output_dir}/inner"
    assert any("nested" in p for p in problems_of(write_pipeline(tmp_path, data)))


def test_output_dir_in_overrides_is_refused(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overrides"]["output_dir"] = "x"
    assert any("output_dir at the stage level" in p for p in problems_of(write_pipeline(tmp_path, data)))


def test_from_sft_needs_a_complete_pretrain_checkpoint(tmp_path):
    path = write_pipeline(tmp_path, two_stages(tmp_path))
    problems = problems_of(path, from_stage="sft")
    assert len(problems) == 1
    assert "stage sft: `pretrained_transformer_path`" in problems[0]
    assert "--from pretrain" in problems[0]
    # A checkpoint directory without its COMPLETE marker does not count.
    (tmp_path / "runs/pretrain/checkpoint-4").mkdir(parents=True)
    assert "stage sft" in problems_of(path, from_stage="sft")[0]


def test_a_stage_launched_alone_is_not_checked_against_itself(tmp_path):
    pipeline = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path)), only="pretrain",
                                 cwd=tmp_path)
    assert [s.name for s in pipeline.stages] == ["pretrain"]
    assert pipeline.stages[0].depends_on == ()


def test_warm_start_from_a_later_stage_is_rejected(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overrides"]["pretrained_transformer_path"] = "${stages.sft.output_dir}"
    data["stages"]["pretrain"]["overrides"]["load_transformer_weights"] = True
    problems = problems_of(write_pipeline(tmp_path, data))
    assert any("stage pretrain" in p and "does not run before it" in p for p in problems)


def test_missing_data_path_is_found_before_submission(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overrides"].update(synthetic_data=False,
                                                   data_path=str(tmp_path / "no-such-data"))
    problems = problems_of(write_pipeline(tmp_path, data))
    assert any(p.startswith("stage pretrain:") and "no-such-data does not exist" in p for p in problems)


def test_topology_is_checked_at_nodes_times_gpus(tmp_path):
    data = two_stages(tmp_path)
    data["cluster"].update(nodes=2, gpus_per_node=8)
    data["stages"]["pretrain"]["overrides"]["global_batch_size"] = 64  # 4 x 1 x 16 = 64
    validate_pipeline(write_pipeline(tmp_path, data), cwd=tmp_path, check_paths=False)
    data["stages"]["pretrain"]["resources"] = {"nodes": 3}
    problems = problems_of(write_pipeline(tmp_path, data), check_paths=False)
    assert len(problems) == 1 and problems[0].startswith("stage pretrain:")
    assert "global_batch_size is 64" in problems[0] and "(24)" in problems[0]


def test_production_example_renders_240_nodes_of_8_gpus():
    pipeline = validate_pipeline(ROOT / "config/pipeline/production-example.yaml", only="pretrain",
                                 cwd=ROOT, check_paths=False)
    stage = pipeline.stages[0]
    assert stage.resources.world_size == 1920
    assert stage.resources.network == "efa"
    assert stage.resources.time_min == 48 * 60


def test_bad_stage_names_are_refused_before_anything_else(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["x; touch /tmp/pwned"] = data["stages"].pop("sft")
    problems = problems_of(write_pipeline(tmp_path, data))
    assert any("stage name 'x; touch /tmp/pwned'" in p for p in problems)


def test_secrets_in_cluster_env_are_refused(tmp_path):
    data = two_stages(tmp_path)
    data["cluster"]["env"] = {"WANDB_API_KEY": "abc", "HF_TOKEN": "x", "FINE": "1"}
    problems = problems_of(write_pipeline(tmp_path, data))
    assert len(problems) == 2 and all(p.startswith("cluster:") and "looks like a secret" in p
                                      for p in problems)


def test_values_with_newlines_cannot_reach_sbatch_lines(tmp_path):
    data = two_stages(tmp_path)
    data["cluster"]["partition"] = "gpu\n#SBATCH --wrap=touch"
    data["stages"]["sft"]["job_name"] = "a\nb"
    problems = problems_of(write_pipeline(tmp_path, data))
    assert sum("newline" in p for p in problems) == 2


def test_sbatch_extra_may_not_override_what_relay_manages(tmp_path):
    data = two_stages(tmp_path)
    data["cluster"]["sbatch_extra"] = {"signal": "USR1@10", "reservation": "big"}
    problems = problems_of(write_pipeline(tmp_path, data))
    assert len(problems) == 1 and "`signal`" in problems[0]


@pytest.mark.parametrize("value, minutes", [
    (30, 30), ("30", 30), ("01:00:00", 60), ("1-00:00:00", 1440), ("00:01:30", 2), ("10:00", 10),
])
def test_time_accepts_minutes_and_clock_formats(value, minutes):
    assert parse_time_minutes(value) == minutes


@pytest.mark.parametrize("value", [0, "soon", "1:99:00", True, -5, 1.5])
def test_time_rejects_nonsense(value):
    with pytest.raises(ValueError):
        parse_time_minutes(value)


def test_signal_lead_must_fit_in_the_time_limit():
    problems: list[str] = []
    assert merge_resources({"time": 2, "signal_lead_s": 120}, None, "stage x", problems,
                           default_python="py") is None
    assert "signal_lead_s" in problems[0]


def test_cpu_stage_runs_tasks_per_node_ranks_and_gpu_stage_one_per_gpu():
    problems: list[str] = []
    cpu = merge_resources({"nodes": 2, "tasks_per_node": 3}, None, "s", problems, default_python="p")
    gpu = merge_resources({"nodes": 2, "gpus_per_node": 4}, None, "s", problems, default_python="p")
    assert (cpu.world_size, gpu.world_size, gpu.tasks_per_node) == (6, 8, 4)
    assert merge_resources({"gpus_per_node": 8, "tasks_per_node": 2}, None, "s", problems,
                           default_python="p") is None


def test_stage_resources_override_cluster_defaults():
    problems: list[str] = []
    r = merge_resources({"nodes": 240, "time": "48:00:00", "mem": 0, "env": {"A": 1}},
                        {"nodes": 64, "time": 30, "env": {"B": "x"}}, "s", problems,
                        default_python="p")
    assert (r.nodes, r.time_min, r.mem, r.env) == (64, 30, "0", {"B": "x"})


@pytest.mark.parametrize("key, value", [
    ("learning_rate", 1e-5), ("learning_rate", 3.0e-4), ("max_steps", 700), ("use_ema", False),
    ("wandb_run_name", "123"), ("wandb_run_name", "--weird name; $(x)"), ("lr_decay_steps", None),
    ("warm_start_allow_missing", ["r_embedder.*", "a b"]), ("synthetic_seed", 0),
    ("transformer_config_overrides", {"hidden_size": 64, "mlp_ratio": 1e-6, "patch_size": [1, 2, 2],
                                      "causal_chunk_size": None}),
    ("data_path", "relative/dir"), ("data_path", {"a/b": 2, "c": 1}),
])
def test_overrides_survive_the_train_py_command_line(tmp_path, key, value):
    (tmp_path / "a/b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    base = {"data_path": str(tmp_path), "synthetic_data": False}
    overrides = {**base, key: value}
    if key == "data_path":
        overrides[key] = value
    direct = resolve_config(TINY_PRETRAIN, overrides, cwd=tmp_path, check_paths=False)
    argv = render_train_argv(TINY_PRETRAIN, overrides)
    via_cli = resolve_config(TINY_PRETRAIN, argv[2:], cwd=tmp_path, check_paths=False)
    assert direct == via_cli


def test_format_override_uses_yaml_flow_for_structures():
    assert format_override([1, 4, 4], "int_list") == "[1, 4, 4]"
    assert format_override(True, "bool") == "true"
    assert format_override(None, "str") == "null"
    assert format_override("a b", "str") == "a b"


def test_select_stages_from_only_and_typos():
    names = ["pretrain", "sft", "stage1", "stage2"]
    assert select_stages(names) == names
    assert select_stages(names, from_stage="sft") == ["sft", "stage1", "stage2"]
    assert select_stages(names, only="stage1") == ["stage1"]
    with pytest.raises(PipelineError, match="Did you mean `sft`"):
        select_stages(names, from_stage="stf")


def test_validation_result_is_json_serialisable_for_the_record(tmp_path):
    pipeline = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path)), cwd=tmp_path)
    json.dumps([s.args for s in pipeline.stages])
    json.dumps([list(s.train_argv) for s in pipeline.stages])


def four_stages(tmp_path: Path) -> dict:
    data = two_stages(tmp_path)
    data["stages"]["stage1"] = {"config": str(ROOT / "config/tiny/stage1.yaml"), "overrides": {
        "pretrained_transformer_path": "${stages.sft.output_dir}"}}
    data["stages"]["stage2"] = {"config": str(ROOT / "config/tiny/stage2.yaml"), "overrides": {
        "student_init_path": "${stages.stage1.output_dir}",
        "teacher_init_path": "${stages.sft.output_dir}",
        "critic_init_path": "${stages.sft.output_dir}"}}
    return data


def test_stage2_weight_sources_from_two_stages_are_wired_and_each_checked(tmp_path):
    path = write_pipeline(tmp_path, four_stages(tmp_path))
    pipeline = validate_pipeline(path, cwd=tmp_path)
    stage2 = pipeline.stage("stage2")
    runs = tmp_path / "runs"
    assert (stage2.args.student_init_path, stage2.args.teacher_init_path,
            stage2.args.critic_init_path) == (str(runs / "stage1"), str(runs / "sft"), str(runs / "sft"))
    assert stage2.depends_on == ("stage1",)

    problems = problems_of(path, only="stage2")
    assert sorted(p.split("`")[1] for p in problems) == ["critic_init_path", "student_init_path",
                                                          "teacher_init_path"]
    assert all("--from" in p for p in problems)
