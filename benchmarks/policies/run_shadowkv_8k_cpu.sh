#!/bin/bash
# ShadowKV at 8K (its regime: prompts > 4096) with the paper's rank, on the CPU, continuing the H100 run folder (same
# prompts, fp32):
# two 1-thread processes over the tasks full-8k covers (its 49 H100 rows have no fwe / qa_1 / qa_2); resumable.
# usage: bash benchmarks/policies/run_shadowkv_8k_cpu.sh {1|2}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
S="nice -n 5 .venv/bin/python -m kvkit.cli eval ruler --model default --policy shadowkv --prompts results/ruler/prompts/ruler-8192-s5-seed42.jsonl --opt calibrated=False --out results/ruler/smollm2-8k/shadowkv-8k --resume"
case ${1:-1} in
1) $S --tasks niah_single_3,niah_multikey_2,niah_multivalue,vt ;;
2) $S --tasks niah_multikey_1,niah_multikey_3,niah_multiquery,cwe ;;
*) echo "usage: $0 {1|2}" >&2; exit 2 ;;
esac
