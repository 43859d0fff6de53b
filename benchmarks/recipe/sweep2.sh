# Recipe sweep 2, run as `bash sweep2.sh` in a checkout (carry .venv/lib/python3.11/site-packages/omegaconf).
# Three candidate embedded defaults end to end through `relay run`, each pinned to two cores
# (0-1, 2-3, 4-5) of an otherwise idle 16-core machine, cut at 285 s: c1 pretrain batch 16 x
# 1200 + SFT 100, c2 the same with pretrain seed 1, c3 pretrain 1100 + SFT 200. No evals (the
# device time allowed none): the trainers' own validation scores and the stage timings.
C=/tmp/c; mkdir -p $C; export PYTHONPATH=$PWD:$PWD/.venv/lib/python3.11/site-packages OMP_NUM_THREADS=1
R(){ n=$1 cores=$2; cat >$C/$n.yaml <<Y
name: $n
root: $C/$n
cluster: {nodes: 1, gpus_per_node: 0, tasks_per_node: 1, cpus_per_task: 2, mem: 4G, time: 60, network: none, signal_lead_s: 120, warmup: false}
stages:
  pretrain: {config: config/tiny/pretrain.yaml, overrides: {train_batch_size: 16, warmup_steps: 30, $3}}
  sft: {config: config/tiny/sft.yaml, overrides: {pretrained_transformer_path: '\${stages.pretrain.output_dir}', train_batch_size: 16, warmup_steps: 20, validation_interval: 0, $4}}
  stage1: {config: config/tiny/stage1.yaml, overrides: {pretrained_transformer_path: '\${stages.sft.output_dir}', train_batch_size: 8, max_steps: 150, warmup_steps: 10, save_interval: 150, validation_interval: 0}}
  stage2: {config: config/tiny/stage2.yaml, overrides: {student_init_path: '\${stages.stage1.output_dir}', teacher_init_path: '\${stages.sft.output_dir}', critic_init_path: '\${stages.sft.output_dir}', max_steps: 100, save_interval: 100, validation_interval: 0}}
Y
  echo "start $EPOCHREALTIME" >$C/$n.times; OMP_NUM_THREADS=2 CUDA_VISIBLE_DEVICES= timeout 285 taskset -c $cores python3 -m launcher.cli run $C/$n.yaml >$C/$n.log 2>&1; echo "end $EPOCHREALTIME $?" >>$C/$n.times
}
R c1 0,1 "max_steps: 1200, save_interval: 600, validation_interval: 600" "max_steps: 100, save_interval: 100" &
R c2 2,3 "max_steps: 1200, save_interval: 600, validation_interval: 600, seed: 1" "max_steps: 100, save_interval: 100" &
R c3 4,5 "max_steps: 1100, save_interval: 550, validation_interval: 550" "max_steps: 200, save_interval: 200" &
wait
