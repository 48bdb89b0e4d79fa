#!/bin/bash
# Issue 19, second model: Qwen2.5-Coder-0.5B-Instruct on RULER-4K (3 samples per task, index-major: every task gets
# sample 0 before any gets sample 1), every policy at ~50% of the KV removed (tidal: of the reads), question-agnostic
# (context compressed before the question), one shared exact prefill per sample replayed into each policy. CPU,
# 1 thread, resumable. Prompts: `kvkit eval ruler --model qwen2.5-coder-0.5b --length 4096 --samples 3
#   --dump-prompts results/policies/qwen05/ruler-4096-s3.jsonl`.
# Calibration (kvkit/data/calibration/qwen2.5-coder-0.5b-instruct.json): `kvkit calibrate shadowkv --model
# qwen2.5-coder-0.5b --out ... --threads 1` (rank 64 of 128) and `kvkit calibrate zipcache ...` (the paper's 4/2-bit
# split keeps every calibration needle: calibrated = paper); tidal not calibrated for this model (paper layers);
# DuoAttention has no pattern for this model (its calibration takes hours on this CPU), so it is not in the table.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
Q=results/policies/qwen05
nice -n 5 .venv/bin/kvkit eval sweep --model qwen2.5-coder-0.5b --prompts $Q/ruler-4096-s3.jsonl --out-root $Q --resume \
  --run full=full --run streaming2048=streaming:budget=2048 --run snapkv2048=snapkv:budget=2048 \
  --run cake2048=cake:budget=2048 --run chelsea50=chelsea:ratio=0.5 --run zipcache=zipcache \
  --run shadowkv1024=shadowkv:budget=1024,min_prompt=2048 --run tidal1732kv=tidal:budget=1732,selection=kv_head
