#!/usr/bin/env bash
# Batched self-speculative decoding on CPU: default model (SmolLM2-135M) fp32, essay continuation,
# 64 new tokens per row, streaming and retrieval drafts of 512 slots, gamma 2 and 4, plain batched greedy over kvkit's `full` and over
# transformers' DynamicCache as baselines, 2 interleaved repeats. Run from the repository root; appends to
# results/speculative/batch_cpu.jsonl and writes one log per batch x length.
set -euo pipefail
out=results/speculative
mkdir -p "$out"
run() {  # batch length
  OMP_NUM_THREADS=2 .venv/bin/kvkit speculate --task continue --batch "$1" --length "$2" --new-tokens 64 \
    --draft-policy streaming,retrieval --budget 512 --gamma 2,4 --repeat 2 --threads 2 --baselines dynamic \
    --json "$out/batch_cpu.jsonl" 2>&1 | grep -v Warning | tee "$out/batch${1}_${2}_cpu.txt"
}
for spec in ${@:-8:6144 1:4096 4:4096 8:4096}; do
  run "${spec%%:*}" "${spec##*:}"
done
