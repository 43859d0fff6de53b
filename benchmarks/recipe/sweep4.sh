# Recipe sweep 4, run as `bash benchmarks/recipe/sweep4.sh` in a checkout on a GPU host (fp32,
# one thread a run, every variant at once). Can a cheaper token layout or a smaller model learn
# motion from as few clips as the shipped one? Each variant edits all four tiny stage configs
# (sed), pretrains 1000 steps validated every 100 (16 captions), then runs the shipped SFT
# from checkpoints 600, 700 and 800 and `relay eval` (48 captions, 30 Euler steps, CFG 4), and
# from 800 the whole chain: Stage1 and Stage2 at their shipped step counts, each evaluated
# (4 steps, guidance 1). Results: $O/*/eval.json and the pretrain's metrics.jsonl;
# `python benchmarks/recipe/summarize.py $O` prints them. The variants edit the tiny configs
# as they were when it ran (commit c9dae2d: patch (1, 4, 4), Stage1 chunks of 2, 300 x 8 at
# lr 2e-4), read from git, so it measures the same thing in any later checkout.
O=${O:-/tmp/sw4}; mkdir -p $O; export OMP_NUM_THREADS=1
PY=${PY:-python3}; BASE=c9dae2d
cfg(){ local d=$O/cfg-$1; mkdir -p $d
       for s in pretrain sft stage1 stage2; do git show $BASE:config/tiny/$s.yaml | sed "$2" >$d/$s.yaml; done; }
T(){ local n=$1 v=$2 c=$3; shift 3; $PY trainer/train.py --config $O/cfg-$v/$c.yaml --output_dir $O/$n --dtype float32 "$@" >$O/$n.log 2>&1; }
E(){ $PY -m launcher.cli eval --checkpoint $O/$1 --steps $2 --guidance $3 --out $O/$1/eval.json >>$O/$1.log 2>&1; }
D="--data_path $O/ds"
SFT(){ local n=$1 v=$2 k=$3; T sft-$n-$k $v sft $D --pretrained_transformer_path $O/pre-$n/checkpoint-$k && E sft-$n-$k 30 4; }
CHAIN(){ local n=$1 v=$2; T s1-$n $v stage1 $D --pretrained_transformer_path $O/sft-$n-800 && E s1-$n 4 1 &&
         T s2-$n $v stage2 $D --student_init_path $O/s1-$n --teacher_init_path $O/sft-$n-800 \
           --critic_init_path $O/sft-$n-800 && E s2-$n 4 1; }
P(){ local n=$1 v=$2; shift 2; T pre-$n $v pretrain --data_path $O/dp --max_steps 1000 --save_interval 100 \
       --save_total_limit 0 --validation_interval 100 "$@" || return
     SFT $n $v 600 & SFT $n $v 700 & SFT $n $v 800 && CHAIN $n $v; wait; }
$PY -c "from trainer.data.synthetic import ensure_dataset as e; e('$O/dp', 4096, seed=0); e('$O/ds', 2048, seed=1)"
PT2='s/patch_size: \[1, 4, 4\]/patch_size: [2, 4, 4]/'
H64='s/hidden_size: 96/hidden_size: 64/; s/rope_axes_dim: \[8, 8, 8\]/rope_axes_dim: [4, 6, 6]/'
L3='s/num_layers: 4/num_layers: 3/'
cfg ref ''; cfg pt2 "$PT2"; cfg h64 "$H64"; cfg pt2h64 "$PT2; $H64"; cfg pt2l3 "$PT2; $L3"
P ref ref & P pt2 pt2 & P pt2s1 pt2 --seed 1 & P pt2lr pt2 --muon_learning_rate 0.04 --learning_rate 2e-3 &
P h64 h64 & P pt2h64 pt2h64 & P pt2l3 pt2l3 &
wait
