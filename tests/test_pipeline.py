"""Pipeline YAML validation: everything wrong is found before anything is submitted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.pipeline import (PipelineError, format_override, merge_resources,
                               parse_time_minutes, render_train_argv, select_stages,
                               validate_pipeline)
from trainer.resolve import resolve_config

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
    pretrain, sft = pipeline.stages[:2]
    assert pretrain.output_dir == "/tmp/relay-unit-root/pretrain"
    assert sft.args.pretrained_transformer_path == "/tmp/relay-unit-root/pretrain"
    assert sft.depends_on == ("pretrain",) and pretrain.depends_on == ()
    assert pretrain.resources.world_size == 1
    assert pipeline.workdir == str(ROOT)
    assert [s.name for s in pipeline.stages] == ["pretrain", "sft", "stage1", "stage2"]
    # CPU has no kernel cache to fill: the short default skips the warm-up, the long one warms
    # every stage (the production path).
    assert pipeline.warmup is None
    long = validate_pipeline(ROOT / "config/pipeline/tiny-long.yaml", root="/tmp/relay-unit-long",
                             cwd=ROOT)
    assert long.warmup.stages == ["pretrain", "sft", "stage1", "stage2"]
    assert long.warmup.before == "pretrain"
    assert not any("no kernel warm-up" in n for n in long.notes)
    # The long variant is the same configs with more steps.
    assert [s.config for s in long.stages] == [s.config for s in pipeline.stages]
    assert all(a.args.max_steps > b.args.max_steps for a, b in zip(long.stages, pipeline.stages))


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


def test_a_stage_reading_from_one_that_failed_validation_is_told_so(tmp_path):
    data = two_stages(tmp_path)
    data["stages"]["pretrain"]["overrides"]["learning_rat"] = 1e-3
    problems = problems_of(write_pipeline(tmp_path, data))
    assert len(problems) == 2
    assert problems[0].startswith("stage pretrain:") and "learning_rate" in problems[0]
    assert problems[1].startswith("stage sft: `pretrained_transformer_path`")
    assert "stage pretrain failed validation" in problems[1]
    assert "does not run" not in problems[1]


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


def _production_data(root: Path) -> Path:
    """One sample of the production configs' data: a [16, 11, 90, 160] latent, a caption of
    8 x 4096 (bfloat16, zeros), in relay's layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    latent, text = [16, 11, 90, 160], [8, 4096]
    row = {"id": "p-0", "caption": "a clip",
           "vae_latent_bytes": bytes(2 * 16 * 11 * 90 * 160), "vae_latent_shape": latent,
           "vae_latent_dtype": "bfloat16", "text_embedding_bytes": bytes(2 * 8 * 4096),
           "text_embedding_shape": text, "text_embedding_dtype": "bfloat16"}
    pq.write_table(pa.Table.from_pylist([row]), root / "part-0.parquet")
    return root


def test_production_example_dry_runs_all_four_stages_at_240_nodes_of_8_gpus(tmp_path):
    data = yaml.safe_load((ROOT / "config/pipeline/production-example.yaml").read_text())
    data["root"] = str(tmp_path / "runs")
    # The latents and the VAE live on the cluster's filesystem: one 41-frame 720p sample of
    # the production shape, and a VAE directory of the model's 16 channels.
    latents, vae = _production_data(tmp_path / "data"), tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKLWan", "z_dim": 16, "latents_mean": [0.0] * 16,
        "latents_std": [1.0] * 16}))
    (vae / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    for name, stage in data["stages"].items():
        stage["config"] = str(ROOT / stage["config"])
        stage.setdefault("overrides", {}).update(data_path=str(latents), vae_path=str(vae))
    path = write_pipeline(tmp_path, data)
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(path), "--dry-run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, steps in (("pretrain", 200000), ("sft", 20000), ("stage1", 10000),
                        ("stage2", 5000)):
        assert f"  {name}: 240 node(s) x 8 GPUs = world 1920, {steps} steps" in proc.stdout
    pipeline = validate_pipeline(path, cwd=tmp_path)
    # Production Stage1/Stage2 YAMLs of their own, for the model of config/pretrain.yaml.
    assert [Path(s.config).name for s in pipeline.stages] == \
        ["pretrain.yaml", "sft.yaml", "stage1.yaml", "stage2.yaml"]
    from trainer.models.registry import model_config

    stage_keys = ("causal_chunk_size", "two_time", "time_gate")
    pretrain = model_config(pipeline.stage("pretrain").args)
    for name in ("stage1", "stage2"):
        model = model_config(pipeline.stage(name).args)
        assert model["causal_chunk_size"] == 3 and isinstance(model["two_time"], bool)
        assert {k: v for k, v in model.items() if k not in stage_keys} == \
            {k: v for k, v in pretrain.items() if k not in stage_keys}, name
    assert pipeline.stage("stage2").args.student_init_path == str(tmp_path / "runs/stage1")


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
    ("transformer_config_overrides", {"hidden_size": 48, "rope_axes_dim": [4, 4, 4], "mlp_ratio": 1e-6,
                                      "patch_size": [1, 2, 2],
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


def test_validation_result_survives_the_json_record_unchanged(tmp_path):
    pipeline = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path)), cwd=tmp_path)
    for stage in pipeline.stages:
        # The record is read back by `relay status` and `--from`: no value may come back as
        # another type (a tuple as a list is fine: JSON has one sequence type).
        args = json.loads(json.dumps(stage.args))
        assert args == {k: list(v) if isinstance(v, tuple) else v for k, v in stage.args.items()}
        assert json.loads(json.dumps(list(stage.train_argv))) == list(stage.train_argv)


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


# ---------------------------------------------------------------------------------------------
# The kernel-cache warm-up job (cluster.warmup)
# ---------------------------------------------------------------------------------------------

def with_warmup(tmp_path: Path, **cluster) -> dict:
    data = two_stages(tmp_path)
    data["cluster"].update(warmup=True, **cluster)
    return data


def test_warmup_is_off_by_default(tmp_path):
    pipeline = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path)), cwd=tmp_path)
    assert pipeline.warmup is None


def test_warmup_runs_each_launched_stage_with_its_exact_train_argv(tmp_path):
    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    warmup = pipeline.warmup
    root = tmp_path / "runs"
    assert warmup.job_name == "t-warmup" and warmup.directory == str(root / "warmup")
    assert [(r.stage, r.argv, r.report) for r in warmup.runs] == [
        (s.name, s.train_argv, str(root / "warmup" / f"{s.name}.json")) for s in pipeline.stages]
    r = warmup.resources
    assert (r.nodes, r.tasks_per_node, r.gpus_per_node, r.time_min, r.network) == (1, 1, 0, 60, "none")


def test_warmup_from_sft_warms_sft_onward_and_sft_waits_for_it(tmp_path):
    path = write_pipeline(tmp_path, with_warmup(tmp_path))
    pipeline = validate_pipeline(path, cwd=tmp_path, from_stage="sft", check_paths=False)
    assert pipeline.warmup.stages == ["sft"] and pipeline.warmup.before == "sft"


def test_warmup_on_gpu_asks_for_one_gpu_with_the_cluster_settings(tmp_path):
    data = with_warmup(tmp_path, warmup_time="01:30:00", nodes=4, gpus_per_node=8,
                       partition="gpu", account="acct", qos="high", constraint="h200",
                       network="efa", env={"RELAY_CACHE_ROOT": "/fsx/cache"},
                       sbatch_extra={"reservation": "big"})
    data["stages"]["pretrain"]["overrides"]["global_batch_size"] = 128
    data["stages"]["sft"]["overrides"]["global_batch_size"] = 128
    pipeline = validate_pipeline(write_pipeline(tmp_path, data), cwd=tmp_path, check_paths=False)
    r = pipeline.warmup.resources
    assert (r.nodes, r.gpus_per_node, r.tasks_per_node, r.world_size, r.time_min) == (1, 1, 1, 1, 90)
    assert (r.partition, r.account, r.qos, r.constraint, r.network) == ("gpu", "acct", "high",
                                                                        "h200", "efa")
    assert r.env == {"RELAY_CACHE_ROOT": "/fsx/cache"} and r.sbatch_extra == {"reservation": "big"}


def test_a_stage_can_opt_out_of_the_warmup(tmp_path):
    data = with_warmup(tmp_path)
    data["stages"]["sft"]["resources"] = {"warmup": False}
    pipeline = validate_pipeline(write_pipeline(tmp_path, data), cwd=tmp_path)
    assert pipeline.warmup.stages == ["pretrain"]
    data["stages"]["pretrain"]["resources"] = {"warmup": False}
    pipeline = validate_pipeline(write_pipeline(tmp_path, data), cwd=tmp_path)
    assert pipeline.warmup is None


@pytest.mark.parametrize("cluster, stage_resources, expected", [
    ({"warmpu": True}, None, "Did you mean `warmup`?"),
    ({"warmup": True, "warmup_tim": 30}, None, "Did you mean `warmup_time`?"),
    ({"warmup": "yes"}, None, "`warmup` must be true or false"),
    ({"warmup": True, "warmup_time": 1}, None, "`warmup_time` must be at least 2 minutes"),
    ({"warmup": True, "warmup_time": "soon"}, None, "warmup_time must be minutes"),
    ({"warmup": True}, {"warmup_time": 30}, "`warmup_time` applies to the whole pipeline"),
])
def test_warmup_keys_are_validated(tmp_path, cluster, stage_resources, expected):
    data = two_stages(tmp_path)
    data["cluster"].update(cluster)
    if stage_resources:
        data["stages"]["sft"]["resources"] = stage_resources
    problems = problems_of(write_pipeline(tmp_path, data))
    assert any(expected in p for p in problems), problems


def test_warmup_directory_may_not_collide_with_a_stage(tmp_path):
    data = with_warmup(tmp_path)
    data["stages"]["sft"]["output_dir"] = "${root}/warmup/sft"
    assert any("overlap" in p for p in problems_of(write_pipeline(tmp_path, data)))
    data = with_warmup(tmp_path)
    data["stages"]["warmup"] = data["stages"].pop("sft")
    data["stages"]["warmup"]["output_dir"] = "${root}/other"
    assert any("name is taken by the kernel warm-up" in p
               for p in problems_of(write_pipeline(tmp_path, data)))


class FakeSubmit:
    """submit_stage / submit_warmup without Slurm: job ids 100, 101, ... and the dependency each
    submission asked for."""

    def __init__(self, monkeypatch, refuse: str | None = None):
        from launcher import slurm

        self.calls: list[tuple[str, str | None]] = []
        self.cancelled: list[str] = []
        self.next_id = 100

        def submit_stage(stage, *, dependency, workdir, repo_root=None):
            if stage.name == refuse:
                raise slurm.SlurmError(f"sbatch refused stage {stage.name}: no")
            return self._submitted(stage.name, dependency, stage.depends_on, False)

        def submit_warmup(warmup, *, workdir, repo_root=None):
            return self._submitted("warmup", None, (), True)

        monkeypatch.setattr(slurm, "submit_stage", submit_stage)
        monkeypatch.setattr(slurm, "submit_warmup", submit_warmup)
        monkeypatch.setattr(slurm, "cancel_jobs", self.cancelled.extend)

    def _submitted(self, name, dependency, depends_on, warmup):
        from launcher.slurm import SubmittedStage

        self.calls.append((name, dependency))
        self.next_id += 1
        return SubmittedStage(name=name, job_id=str(self.next_id - 1), sbatch=f"/s/{name}",
                              depends_on=depends_on, warmup=warmup)


def test_first_stage_waits_afterok_for_the_warmup_and_the_rest_for_each_other(tmp_path,
                                                                              monkeypatch):
    from launcher.slurm import render_sbatch, submit_pipeline

    fake = FakeSubmit(monkeypatch)
    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    seen = []
    submit_pipeline(pipeline, on_submit=seen.append)
    assert fake.calls == [("warmup", None), ("pretrain", "100"), ("sft", "101")]
    assert [s.warmup for s in seen] == [True, False, False]
    lines = render_sbatch(pipeline.stages[0], dependency="100").splitlines()
    assert "#SBATCH --dependency=afterok:100" in lines and "#SBATCH --kill-on-invalid-dep=yes" in lines

    fake = FakeSubmit(monkeypatch)
    off = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path), "off.yaml"), cwd=tmp_path)
    submit_pipeline(off)
    assert fake.calls == [("pretrain", None), ("sft", "100")]


def test_a_refused_stage_cancels_the_warmup_too(tmp_path, monkeypatch):
    from launcher.slurm import SlurmError, submit_pipeline

    fake = FakeSubmit(monkeypatch, refuse="sft")
    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    with pytest.raises(SlurmError):
        submit_pipeline(pipeline)
    assert fake.cancelled == ["100", "101"]


def test_pipeline_json_records_the_warmup_beside_the_stages_contract(tmp_path):
    from launcher.record import build_record

    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    launched = {"pretrain": {"job_id": "11", "sbatch": "/s/p"}, "sft": {"job_id": "12", "sbatch": "/s/s"}}
    record = build_record(pipeline, launched, mode="slurm",
                          warmup={"job_id": "10", "sbatch": "/s/w"})
    root = tmp_path / "runs"
    assert record["warmup"] == {**record["warmup"], "job_id": "10", "sbatch": "/s/w",
                                "job_name": "t-warmup", "directory": str(root / "warmup"),
                                "launched": "slurm", "before": "pretrain",
                                "stages": ["pretrain", "sft"],
                                "reports": {"pretrain": str(root / "warmup/pretrain.json"),
                                            "sft": str(root / "warmup/sft.json")}}
    # "stages" keeps its contract: stage names only, depends_on names stages only.
    assert list(record["stages"]) == ["pretrain", "sft"]
    assert record["stages"]["pretrain"]["depends_on"] == []
    json.dumps(record)
    # A launch without a warm-up writes no "warmup" entry.
    off = validate_pipeline(write_pipeline(tmp_path, two_stages(tmp_path), "off.yaml"), cwd=tmp_path)
    assert "warmup" not in build_record(off, launched, mode="slurm", previous=record)


# -- status ----------------------------------------------------------------------------------

def warmup_record(tmp_path: Path, job_id: str | None, result: dict | None,
                  reports: dict[str, dict]) -> dict:
    directory = tmp_path / "warmup"
    (directory / "slurm").mkdir(parents=True, exist_ok=True)
    for stage, report in reports.items():
        (directory / f"{stage}.json").write_text(json.dumps(report))
    if result is not None:
        (directory / "warmup-result.json").write_text(json.dumps(result))
    return {"job_id": job_id, "directory": str(directory), "before": "pretrain",
            "stages": ["pretrain", "sft"],
            "reports": {s: str(directory / f"{s}.json") for s in ("pretrain", "sft")},
            "result": str(directory / "warmup-result.json")}


def test_status_shows_a_failed_warmup_first_with_why_and_its_log(tmp_path, monkeypatch):
    import launcher.status as status
    from launcher.record import write_record
    from launcher.slurm import JobInfo

    error = ("kernel warm-up of stage pretrain failed (exit 1: forward or backward failed, e.g. "
             "a kernel that does not build or out of memory): OutOfMemoryError: CUDA out of memory")
    warm = warmup_record(tmp_path, "20", {"status": "failed", "failed": "pretrain", "error": error},
                         {"pretrain": {"status": "failed", "error": "OutOfMemoryError"}})
    log = tmp_path / "warmup" / "slurm" / "20_0_log.out"
    log.write_text("...")
    write_record(tmp_path, {"pipeline": "p.yaml", "stages": {
        "pretrain": {"output_dir": str(tmp_path / "pretrain"), "job_id": "21", "depends_on": []},
        "sft": {"output_dir": str(tmp_path / "sft"), "job_id": "22", "depends_on": ["pretrain"]}},
        "warmup": warm})
    monkeypatch.setattr(status, "query_jobs", lambda ids: {
        "20": JobInfo("20", "FAILED", "1:0", "00:00:40"),
        "21": JobInfo("21", "CANCELLED", "0:0", "00:00:00", "DependencyNeverSatisfied"),
        "22": JobInfo("22", "CANCELLED", "0:0", "00:00:00", "DependencyNeverSatisfied")})
    rows = status.collect_status(tmp_path)
    assert [r.name for r in rows] == ["warmup", "pretrain", "sft"]
    assert (rows[0].state, rows[0].step, rows[0].max_steps) == ("FAILED", 0, 2)
    assert rows[0].reason == error and rows[0].log == str(log)
    assert rows[1].reason.startswith("not run: warmup did not complete")
    assert rows[2].reason.startswith("not run: pretrain did not complete")
    table = status.render_status_table(rows)
    assert table.splitlines()[1].split()[:4] == ["warmup", "20", "FAILED", "0/2"]
    assert f"warmup: {error}" in table and f"warmup: log {log}" in table
    assert [r.name for r in status.active_jobs(rows)] == []


def test_status_of_a_warmup_in_progress_and_of_a_local_one(tmp_path, monkeypatch):
    import launcher.status as status
    from launcher.slurm import JobInfo

    ok = {"status": "ok"}
    warm = warmup_record(tmp_path, "30", {"status": "running"}, {"pretrain": ok})
    row = status.warmup_status(warm, JobInfo("30", "RUNNING", elapsed="1:00"))
    assert (row.state, row.step, row.reason) == ("RUNNING", 1, None)
    assert status.active_jobs([row]) == [row]  # relay cancel stops it, relay submit waits
    row = status.warmup_status(warm, JobInfo("30", "TIMEOUT", "0:15", "10:00"))
    assert "raise cluster.warmup_time" in row.reason
    local = warmup_record(tmp_path, None, {"status": "ok"}, {"pretrain": ok, "sft": ok})
    row = status.warmup_status(local, None)
    assert (row.state, row.step, row.max_steps, row.reason) == ("COMPLETED", 2, 2, None)


# -- running the warm-up (the job's loop, and relay run) --------------------------------------

FAKE_PYTHON = """#!/bin/sh
# Stands in for python: `-u -m trainer.warmup ...` writes a report; `-m trainer.train` succeeds.
echo "$*" >> "$RELAY_TEST_CALLS"
case "$*" in
*trainer.warmup*)
    case "$RELAY_WARMUP_REPORT" in
    *"/$RELAY_TEST_FAIL.json")
        printf '{"status": "failed", "error": "OutOfMemoryError: out of memory"}' > "$RELAY_WARMUP_REPORT"
        exit 1 ;;
    esac
    printf '{"status": "ok", "timings_s": {"forward": 0.5, "backward": 0.25}}' > "$RELAY_WARMUP_REPORT"
    echo '{"status": "ok"}'
    exit 0 ;;
esac
exit 0
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("RELAY_TEST_CALLS", str(calls))
    monkeypatch.setenv("RELAY_TEST_FAIL", "none")

    def read_calls() -> list[str]:
        return calls.read_text().splitlines() if calls.exists() else []

    return str(path), read_calls


def test_warmup_job_runs_trainer_warmup_per_stage_and_stops_at_the_first_failure(
        tmp_path, monkeypatch, fake_python):
    from launcher.job import WarmupFailed, WarmupJob

    python, calls = fake_python
    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    job = WarmupJob.from_spec(pipeline.warmup, workdir=str(tmp_path))
    monkeypatch.setattr("sys.executable", python)
    stale = Path(job.runs[1]["report"])
    stale.parent.mkdir(parents=True)
    stale.write_text('{"status": "ok"}')  # from an earlier warm-up: must not count
    monkeypatch.setenv("RELAY_TEST_FAIL", "pretrain")
    with pytest.raises(WarmupFailed, match="stage pretrain failed .*out of memory"):
        job()
    assert len(calls()) == 1 and calls()[0].startswith("-u -m trainer.warmup --config ")
    assert calls()[0].endswith(" ".join(pipeline.stages[0].train_argv[2:]))
    assert not stale.exists()
    result = json.loads((tmp_path / "runs/warmup/warmup-result.json").read_text())
    assert (result["status"], result["failed"]) == ("failed", "pretrain")

    monkeypatch.setenv("RELAY_TEST_FAIL", "none")
    result = job()
    assert result["status"] == "ok" and list(result["stages"]) == ["pretrain", "sft"]
    assert all(json.loads(Path(r["report"]).read_text())["status"] == "ok" for r in job.runs)


def test_relay_run_warms_up_first_and_a_failure_runs_no_stage(tmp_path, monkeypatch, fake_python):
    from launcher.local import run_pipeline_locally
    from launcher.record import read_record

    python, calls = fake_python
    pipeline = validate_pipeline(write_pipeline(tmp_path, with_warmup(tmp_path)), cwd=tmp_path)
    said: list[str] = []
    monkeypatch.setenv("RELAY_TEST_FAIL", "sft")
    assert run_pipeline_locally(pipeline, python=python, echo=said.append) == 1
    assert [c.split()[2] for c in calls()] == ["trainer.warmup", "trainer.warmup"]
    assert any("kernel warm-up of stage sft failed" in m and "No stage was run" in m for m in said)
    record = read_record(pipeline.root)
    assert record["warmup"]["launched"] == "local" and record["warmup"]["job_id"] is None

    monkeypatch.setenv("RELAY_TEST_FAIL", "none")
    said.clear()
    (tmp_path / "calls.txt").unlink()
    assert run_pipeline_locally(pipeline, python=python, echo=said.append) == 0
    assert [c.split()[1 if c.startswith("-m") else 2] for c in calls()] == [
        "trainer.warmup", "trainer.warmup", "trainer.train", "trainer.train"]
    assert f"  sft: {pipeline.warmup.runs[1].report}" in said

