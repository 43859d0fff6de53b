# Recipe sweep 1, run as `taskset -c 4-15 bash sweep1.sh` in a checkout. GPU (fp32): pretrain batch/LR
# variants, SFT from their checkpoints, Stage1/Stage2 step counts. CPU (cores 0-3): step costs.
# Needs omegaconf: carry .venv/lib/python3.11/site-packages/omegaconf.
O=/tmp/g Q=/tmp/q; mkdir -p $O $Q; export PYTHONPATH=$PWD:$PWD/.venv/lib/python3.11/site-packages OMP_NUM_THREADS=1
T(){ n=$1 c=$2; shift 2; python3 trainer/train.py --config config/tiny/$c.yaml --output_dir $O/$n --dtype float32 "$@" >$O/$n.log 2>&1; }
E(){ python3 -m launcher.cli eval --checkpoint $O/$1 --steps $2 --guidance $3 --out $O/$1/eval.json >>$O/$1.log 2>&1; }
DS="--data_path $O/ds"; PRE="--data_path $O/dp --save_interval 100 --save_total_limit 0 --validation_interval 100"
SFT(){ n=$1 s=$2; shift 2; T $n sft $DS --max_steps 100 --train_batch_size 16 --warmup_steps 20 --validation_interval 0 --pretrained_transformer_path $O/$s "$@" && E $n 30 4; }
S1(){ n=$1 s=$2; shift 2; T $n stage1 $DS --validation_interval 50 --pretrained_transformer_path $O/$s "$@" && E $n 4 1; }
S2(){ n=$1 s=$2; shift 2; T $n stage2 $DS --validation_interval 50 --student_init_path $O/$s --teacher_init_path $O/ref-sft --critic_init_path $O/ref-sft "$@" && E $n 4 1; }
( T pA pretrain $PRE --max_steps 1000
  for k in 400 600 800; do SFT sA$k pA/checkpoint-$k & done
  T ref-sft sft $DS --pretrained_transformer_path $O/pA && E ref-sft 30 4
  for v in "100 16" "150 16" "200 16" "200 8" "300 8"; do set -- $v; S1 s1-$1-b$2 ref-sft --max_steps $1 --train_batch_size $2 & done
  S1 s1-400-b16 ref-sft
  for v in "100 8 5" "150 8 5" "150 4 5" "150 8 3" "100 8 3"; do set -- $v; S2 s2-$1-b$2-i$3 s1-400-b16 --max_steps $1 --train_batch_size $2 --generator_update_interval $3 & done
  S2 s2-300 s1-400-b16; wait
  S2 s2-150-from150 s1-150-b16 --max_steps 150 & S2 s2-100-from100 s1-100-b16 --max_steps 100; wait ) &
P(){ n=$1 k=$2; shift 2; T $n pretrain $PRE "$@"; for k in $k; do SFT s$n$k $n/checkpoint-$k & done; wait; }
B="--train_batch_size 16 --max_steps 1000"
P pB "500 700 900" $B & P pC "500 700 900" $B --muon_learning_rate 0.03 --learning_rate 1.5e-3 &
P pE "500 700 900" $B --warmup_steps 30 & P pG "500 700 900" $B --muon_learning_rate 0.04 --learning_rate 2e-3 --warmup_steps 50 &
P pD "700 1000 1300" --train_batch_size 8 --max_steps 1400 &
P pH "400 600 800" --max_steps 1000 --muon_learning_rate 0.03 --learning_rate 1.5e-3 --warmup_steps 50 &
C(){ n=$1 c=$2; shift 2; t=$EPOCHREALTIME; CUDA_VISIBLE_DEVICES= taskset -c $CO python3 trainer/train.py --config config/tiny/$c.yaml --output_dir $Q/$n --log_interval 1 --save_interval 1000 --validation_interval 0 "$@" >$Q/$n.log 2>&1; echo "$n $t $EPOCHREALTIME" >>$Q/times.txt; }
( export OMP_NUM_THREADS=2 CO=0,1; t=$EPOCHREALTIME; CUDA_VISIBLE_DEVICES= taskset -c 0,1 python3 -c "import trainer.train"; echo "import $t $EPOCHREALTIME" >>$Q/times.txt
  CUDA_VISIBLE_DEVICES= taskset -c 0,1 python3 -c "import time;from trainer.data.synthetic import ensure_dataset as e;t=time.time();e('$Q/dp',4096,seed=0);print('gen-pre',time.time()-t);t=time.time();e('$Q/ds',2048,seed=1);print('gen-sft',time.time()-t)" >>$Q/times.txt
  D="--data_path $Q/dp"; for b in 32 16 8; do C tp$b pretrain $D --max_steps 40 --train_batch_size $b; done; C tp32nv pretrain $D --max_steps 40 --validation_interval -1
  D="--data_path $Q/ds"; for b in 32 16; do C ts$b sft $D --max_steps 30 --train_batch_size $b --pretrained_transformer_path $Q/tp32; done; C ts32nv sft $D --max_steps 30 --pretrained_transformer_path $Q/tp32 --validation_interval -1
  for b in 16 8; do C t1b$b stage1 $D --max_steps 15 --train_batch_size $b --pretrained_transformer_path $Q/ts32; done; C t1nv stage1 $D --max_steps 15 --pretrained_transformer_path $Q/ts32 --validation_interval -1
  S="--student_init_path $Q/t1b16 --teacher_init_path $Q/ts32 --critic_init_path $Q/ts32"; for b in 8 4; do C t2b$b stage2 $D --max_steps 25 --train_batch_size $b $S; done; C t2nv stage2 $D --max_steps 25 $S --validation_interval -1 ) &
( export OMP_NUM_THREADS=1 CO=2,3; C tp32t1 pretrain --data_path $Q/dp1 --max_steps 40; export OMP_NUM_THREADS=2; C tp32r pretrain --data_path $Q/dp1 --max_steps 40 ) &
wait
