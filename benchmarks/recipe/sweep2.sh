# Recipe sweep 2, run as `bash sweep2.sh` in a checkout (carry .venv/lib/python3.11/site-packages/omegaconf).
# GPU (fp32, cores 6-15): batch-16 pretrain recipes and seeds, SFT from two checkpoints of each.
# CPU (cores 0-5, two each): candidate embedded defaults end to end through `relay run`:
# c1 the candidate, c2 its pretrain with another seed, c3 a longer SFT after a shorter pretrain.
O=/tmp/g C=/tmp/c; mkdir -p $O $C; export PYTHONPATH=$PWD:$PWD/.venv/lib/python3.11/site-packages OMP_NUM_THREADS=1
T(){ n=$1 c=$2; shift 2; taskset -c 6-15 python3 trainer/train.py --config config/tiny/$c.yaml --output_dir $O/$n --dtype float32 "$@" >$O/$n.log 2>&1; }
E(){ taskset -c 6-15 python3 -m launcher.cli eval --checkpoint $1 --steps $2 --guidance $3 --out $1/eval.json >>$1.log 2>&1; }
P(){ n=$1; shift; T $n pretrain --data_path $O/dp --save_interval 100 --save_total_limit 0 --validation_interval 100 --train_batch_size 16 --max_steps 1400 "$@"
  for k in 1000 1200; do T s$n$k sft --data_path $O/ds --max_steps 150 --train_batch_size 16 --warmup_steps 20 --validation_interval 0 --pretrained_transformer_path $O/$n/checkpoint-$k && E $O/s$n$k 30 4 & done; wait; }
for s in 1 2; do P w30s$s --warmup_steps 30 --seed $s & done
P lr3 --warmup_steps 30 --muon_learning_rate 0.03 --learning_rate 1.5e-3 & P sh5 --warmup_steps 30 --train_timestep_shift 5 &
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
  echo "start $EPOCHREALTIME" >$C/$n.times; OMP_NUM_THREADS=2 CUDA_VISIBLE_DEVICES= timeout 380 taskset -c $cores python3 -m launcher.cli run $C/$n.yaml >$C/$n.log 2>&1; echo "end $EPOCHREALTIME $?" >>$C/$n.times
  E $C/$n/sft 30 4 & E $C/$n/stage1 4 1 & E $C/$n/stage2 4 1; wait; }
R c1 0,1 "max_steps: 1200, save_interval: 600, validation_interval: 600" "max_steps: 100, save_interval: 100" &
R c2 2,3 "max_steps: 1200, save_interval: 600, validation_interval: 600, seed: 1" "max_steps: 100, save_interval: 100" &
R c3 4,5 "max_steps: 1100, save_interval: 550, validation_interval: 550" "max_steps: 200, save_interval: 200" &
wait
