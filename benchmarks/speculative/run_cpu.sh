#!/bin/bash
# The CPU speculative benchmark (no GPU lent): default model, needle prompts at 8K and 4K and raw essay
# continuation at 8K. Plain greedy (kvkit full, appending in place; transformers DynamicCache and StaticCache) and every
# setting run 3 times interleaved on one prefill (medians; speedup = median of the per-repeat ratios).
# Run on an otherwise idle machine: the timings are wall-clock.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
K=".venv/bin/kvkit speculate --model default --threads 2 --repeat 3 --new-tokens 64 --baselines dynamic,static"
$K --length 8120 --gamma 4,6,8 --draft-policy retrieval --budget 512,1024 --json results/speculative/cpu_8k_needle.jsonl
$K --length 8120 --task continue --gamma 4,8 --draft-policy streaming,retrieval --budget 1024 \
  --json results/speculative/cpu_8k_continue.jsonl
$K --length 4096 --gamma 2,4,6 --draft-policy streaming,retrieval --budget 512 --json results/speculative/cpu_4k_needle.jsonl
