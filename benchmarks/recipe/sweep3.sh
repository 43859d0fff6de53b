# Recipe sweep 3, run as `bash benchmarks/recipe/sweep3.sh` in a checkout on the 2-core VM
# (CPU, fp32, one thread a run, two runs at a time). Can motion come sooner than step 700 at
# batch 32? Pretrain variants validated every 100 steps (16 captions, direction), then SFT
# (shipped config, 100 x 16) from checkpoints 500 and 600 and `relay eval` (48 captions,
# 30 Euler steps, CFG 4).
O=${O:-/tmp/sw}; mkdir -p $O; export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=
PY=${PY:-.venv/bin/python}
T(){ n=$1 c=$2; shift 2; $PY trainer/train.py --config config/tiny/$c.yaml --output_dir $O/$n "$@" >$O/$n.log 2>&1; }
E(){ $PY -m launcher.cli eval --checkpoint $O/$1 --steps 30 --guidance 4 --out $O/$1/eval.json >>$O/$1.log 2>&1; }
P(){ n=$1; shift; T $n pretrain --data_path $O/dp --max_steps 700 --save_interval 100 --save_total_limit 0 \
       --validation_interval 100 "$@"
     for k in 500 600; do T s$n$k sft --data_path $O/ds --pretrained_transformer_path $O/$n/checkpoint-$k && E s$n$k; done; }
$PY -c "from trainer.data.synthetic import ensure_dataset as e; e('$O/dp', 4096, seed=0); e('$O/ds', 2048, seed=1)"
VARIANTS=${VARIANTS:-"shift5:--train_timestep_shift=5.0 lr4:--muon_learning_rate=0.04,--learning_rate=2e-3"}
for v in $VARIANTS; do n=${v%%:*}; a=${v#*:}; P $n ${a//,/ } & done
wait
