#!/bin/bash
# The RULER-4K runs behind results/ruler/policies-smollm2-4k.md and policies-qwen05-4k.md: one folder per row under
# results/ruler/<model>-4k/, each resumable (a folder continues where it stopped). Every setting is named in full, so
# a row keeps its meaning when a default or a shipped calibration changes: `calibrated=False` is the paper's
# setting, no option the model's shipped calibration (kvkit/data/calibration/<model>.json).
# usage: bash benchmarks/policies/run_policy_table.sh MODE [extra kvkit arguments, e.g. --tasks qa_1,vt]
#   smollm2          question-agnostic rows, one shared exact prefill per sample (kvkit eval sweep)
#   smollm2-own      the rows whose policy runs a pass after the prefill (kvzip, chelsea's reconstruction score)
#   smollm2-aware    question in the prefill (the eviction papers' protocol)
#   smollm2-base     full and streaming, 10 samples per task (made on an H100: add --device cuda)
#   smollm2-h100     kvzip at budgets 1024 / 512 (made on an H100)
#   qwen05 / qwen05-own / qwen05-aware   the same for Qwen2.5-Coder-0.5B-Instruct (3 samples per task)
# then: bash benchmarks/policies/make_table.sh
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
KV="nice -n 5 .venv/bin/python -m kvkit.cli eval"
MODE=${1:-}; shift
S=results/ruler/smollm2-4k; P5=results/ruler/prompts/ruler-4096-s5.jsonl
Q=results/ruler/qwen05-4k; P3=results/ruler/prompts/ruler-4096-s3-qwen05.jsonl
QWEN=qwen2.5-coder-0.5b
LAYERS="select_layers=[2,6,10,14,18,22,26],layer_shares=[1,1,1,1.695,1.148,1.258,1,1.367,0.82,0.602,1,0.93,1.148,0.93,1,1.094,0.109,1.148,1,1.422,0.875,1.531,1,0.547,0.984,0.055,1,0.273,1.312,1.75]"
PAPERZIP="calibrated=False,key_group=None,stats=auto"  # the paper's bits and statistics layout
# ruler ROOT PROMPTS MODEL NAME POLICY OPTS [args]: one `kvkit eval ruler` row
ruler() { local root=$1 prompts=$2 model=$3 name=$4 pol=$5 opts=$6; shift 6
  $KV ruler --model "$model" --policy "$pol" ${opts:+--opt "$opts"} --prompts "$prompts" --out "$root/$name" --resume "$@"; }
case $MODE in
smollm2)
  $KV sweep --model default --prompts $P5 --out-root $S --resume \
    --run duo054-4k120=duo:sparsity=0.54,pattern=results/calibration/duo-patterns/smollm2-4k-disjoint.json \
    --run duo054-4k=duo:sparsity=0.54,pattern=benchmarks/replay/duo_smollm2_2fa10fc.json \
    --run "tidalshared1132-4k=tidal:budget=1132,selection=shared,$LAYERS" \
    --run "tidalsh1132kv-4k=tidal:budget=1132,selection=kv_head,$LAYERS" \
    --run tidal1732kv-4k=tidal:budget=1732,selection=kv_head,calibrated=False \
    --run tidal550kv-4k=tidal:budget=550,selection=kv_head,calibrated=False \
    --run zipcachecal-4k=zipcache:key_group=None,stats=auto --run zipcache-4k=zipcache:$PAPERZIP \
    --run zipcache84-4k=zipcache:high_bits=8,low_bits=4,$PAPERZIP \
    --run shadowkvcal2048-4k=shadowkv:budget=2048,min_prompt=2048 \
    --run shadowkvcal1024-4k=shadowkv:budget=1024,min_prompt=2048 \
    --run shadowkv1024-4k=shadowkv:budget=1024,min_prompt=2048,calibrated=False \
    --run cake2048tr-4k=cake:budget=2048,protect_heads=0 --run cake2048-4k=cake:budget=2048,calibrated=False,protect_heads=0 \
    --run cake1024-4k=cake:budget=1024,calibrated=False,protect_heads=0 \
    --run chelsea50p40cal-4k=chelsea:ratio=0.5,protect=0.4,protect_heads=0 --run chelsea50-4k=chelsea:ratio=0.5,protect=0,protect_heads=0 \
    --run chelsea20p16cal-4k=chelsea:ratio=0.2,protect=0.16,protect_heads=0 --run chelsea20-4k=chelsea:ratio=0.2,protect=0,protect_heads=0 \
    --run snapkv2048tr-4k=snapkv:budget=2048,protect_heads=0 --run snapkv2048-4k=snapkv:budget=2048,calibrated=False,protect_heads=0 "$@" ;;
smollm2-own)
  ruler $S $P5 default kvzip2048a-4k kvzip budget=2048 "$@"
  ruler $S $P5 default kvzip2048-4k kvzip budget=2048,adaptive=false "$@"
  ruler $S $P5 default kvzip1024-4k kvzip budget=1024,adaptive=false "$@"
  ruler $S $P5 default chelsea50rcx-4k chelsea ratio=0.5,protect_score=reconstruct,protect_scope=context "$@" ;;
smollm2-aware)
  A="--full-prompt-prefill"
  ruler $S $P5 default snapkv2048tr-4k-qaware snapkv budget=2048 $A "$@"
  ruler $S $P5 default snapkv2048-4k-qaware snapkv budget=2048,calibrated=False $A "$@"
  ruler $S $P5 default snapkv1024tr-4k-qaware snapkv budget=1024 $A "$@"
  ruler $S $P5 default snapkv1024-4k-qaware snapkv budget=1024,calibrated=False $A "$@"
  ruler $S $P5 default snapkv512tr-4k-qaware snapkv budget=512 $A "$@"
  ruler $S $P5 default cake2048tr-4k-qaware cake budget=2048 $A "$@"
  ruler $S $P5 default cake1024-4k-qaware cake budget=1024,calibrated=False $A "$@"
  ruler $S $P5 default chelsea50p40cal-4k-qaware chelsea ratio=0.5,protect=0.4 $A "$@"
  ruler $S $P5 default chelsea50-4k-qaware chelsea ratio=0.5,protect=0 $A "$@"
  ruler $S $P5 default chelsea20p16cal-4k-qaware chelsea ratio=0.2,protect=0.16 $A "$@" ;;
smollm2-base)
  P10=results/ruler/prompts/ruler-4096-s10-seed42.jsonl
  ruler $S $P10 default full-4k full "" "$@"
  for b in 2048 1024 512; do ruler $S $P10 default streaming$b-4k streaming budget=$b "$@"; done ;;
smollm2-h100)
  P20=results/ruler/prompts/ruler-4096-s20.jsonl
  ruler $S $P20 default kvzip1024a-4k-h100 kvzip budget=1024 --samples 5 --device cuda "$@"
  ruler $S $P20 default kvzip512a-4k-h100 kvzip budget=512 --samples 5 --device cuda "$@" ;;
qwen05)
  $KV sweep --model $QWEN --prompts $P3 --out-root $Q --resume --run full=full \
    --run duo054=duo:sparsity=0.54 --run duo081=duo:sparsity=0.81 \
    --run streaming2048=streaming:budget=2048 --run streaming1024=streaming:budget=1024 \
    --run snapkv2048cal=snapkv:budget=2048,protect_heads=0 --run snapkv2048=snapkv:budget=2048,calibrated=False,protect_heads=0 \
    --run snapkv1024=snapkv:budget=1024,calibrated=False,protect_heads=0 \
    --run cake2048=cake:budget=2048,protect_heads=0 --run cake1024=cake:budget=1024,protect_heads=0 \
    --run chelsea50d=chelsea:ratio=0.5,protect_heads=0 --run chelsea50=chelsea:ratio=0.5,protect=0,protect_heads=0 \
    --run chelsea25d=chelsea:ratio=0.25,protect_heads=0 --run chelsea25=chelsea:ratio=0.25,protect=0,protect_heads=0 \
    --run zipcachecal=zipcache:key_group=None,stats=auto --run zipcache=zipcache:$PAPERZIP \
    --run shadowkv1024=shadowkv:budget=1024,min_prompt=2048 --run shadowkv512=shadowkv:budget=512,min_prompt=2048 \
    --run tidalrf999kv=tidal:budget=999,selection=kv_head \
    --run tidal1732kv=tidal:budget=1732,selection=kv_head,calibrated=False \
    --run tidal550kv=tidal:budget=550,selection=kv_head,calibrated=False "$@" ;;
qwen05-own)
  ruler $Q $P3 $QWEN kvzip2048a kvzip budget=2048 "$@"
  ruler $Q $P3 $QWEN kvzip2048 kvzip budget=2048,adaptive=false "$@"
  ruler $Q $P3 $QWEN chelsea50rcx chelsea ratio=0.5,protect_score=reconstruct,protect_scope=context "$@" ;;
qwen05-aware)
  A="--full-prompt-prefill"
  ruler $Q $P3 $QWEN cake2048-qaware cake budget=2048 $A "$@"
  ruler $Q $P3 $QWEN cake1024-qaware cake budget=1024 $A "$@"
  ruler $Q $P3 $QWEN snapkv2048cal-qaware snapkv budget=2048 $A "$@"
  ruler $Q $P3 $QWEN snapkv2048tr-qaware snapkv budget=2048,kernel=61,pooling=avg,pool_window=trailing $A "$@"
  ruler $Q $P3 $QWEN snapkv2048-qaware snapkv budget=2048,calibrated=False $A "$@"
  ruler $Q $P3 $QWEN snapkv1024cal-qaware snapkv budget=1024 $A "$@"
  ruler $Q $P3 $QWEN snapkv1024-qaware snapkv budget=1024,calibrated=False $A "$@"
  ruler $Q $P3 $QWEN chelsea50p40cal-qaware chelsea ratio=0.5,protect=0.4 $A "$@"
  ruler $Q $P3 $QWEN chelsea50-qaware chelsea ratio=0.5,protect=0 $A "$@" ;;
*) echo "usage: $0 {smollm2|smollm2-own|smollm2-aware|smollm2-base|smollm2-h100|qwen05|qwen05-own|qwen05-aware} [kvkit args]" >&2
   exit 2 ;;
esac
