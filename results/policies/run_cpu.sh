#!/bin/bash
# The RULER 4K policy sweep on CPU (no GPU was lent to this session): two `kvkit eval sweep` processes
# (1 thread each), each sharing one exact context prefill per sample among its policies; every run
# folder is resumable and also continues the H100 samples of results/policies-4k-partial copied here.
# usage: bash results/policies/run_cpu.sh [a|b]
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
S="nice -n 5 .venv/bin/kvkit eval sweep --model default --prompts results/policies/ruler-4096-s5.jsonl --out-root results/policies --resume"
case ${1:-a} in
a) $S --run duo054-4k=duo:sparsity=0.54 --run duo081-4k=duo:sparsity=0.81 \
      --run tidal1732kv-4k=tidal:budget=1732,selection=kv_head --run cake2048-4k=cake:budget=2048 \
      --run cake1024-4k=cake:budget=1024 ;;
b) $S --run chelsea50-4k=chelsea:ratio=0.5 --run chelsea25-4k=chelsea:ratio=0.25 --run zipcache-4k=zipcache \
      --run tidal550kv-4k=tidal:budget=550,selection=kv_head \
      --run chelsea20-4k=chelsea:ratio=0.2 ;;
esac
