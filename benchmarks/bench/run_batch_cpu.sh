#!/usr/bin/env bash
# Issue 17: batched decode on CPU, every policy against full in one run (results/bench/README.md).
#   bash benchmarks/bench/run_batch_cpu.sh TAG [which...]
# TAG names the output folders (results/bench/batch-<which>-<TAG>); which: 8x4096 1x1024 memory (default all).
# KVKIT_GIT_COMMIT, if set, is recorded as the measured commit (for a `git archive` export of a commit).
set -euo pipefail
TAG=${1:?usage: run_batch_cpu.sh TAG [8x4096|1x1024|memory ...]}
shift
WHICH=${*:-8x4096 1x1024 memory}
KVKIT=${KVKIT:-kvkit}
OUT=${OUT:-results/bench}
export KVKIT_NO_PROGRESS=1
for w in $WHICH; do
  case $w in
    8x4096)  # budgets: streaming/cake T/2, tidal T/4, shadowkv T/8 (min_prompt below the context)
      $KVKIT bench --model default --policy streaming --budget 2048 --lengths 4096 --batch 8 \
        --add duo --add cake:budget=2048 --add chelsea:ratio=0.5 --add tidal:budget=1024 \
        --add tidal:budget=1024,selection=kv_head --add zipcache --add shadowkv:budget=512,min_prompt=1024 \
        --threads 1,2 --rounds 3 --steps 4 --profile --out "$OUT/batch-8x4096-$TAG" ;;
    1x1024)
      $KVKIT bench --model default --policy streaming --budget 512 --lengths 1024 --batch 1 \
        --add duo --add cake:budget=512 --add chelsea:ratio=0.5 --add tidal:budget=256 \
        --add tidal:budget=256,selection=kv_head --add zipcache --add shadowkv:budget=128,min_prompt=512 \
        --threads 1,2 --rounds 5 --steps 4 --profile --out "$OUT/batch-1x1024-$TAG" ;;
    memory)  # memory-saving policies only (tidal saves reads, not memory)
      $KVKIT bench --model default --policy streaming --budget 2048 --lengths 4096 --batch 8 \
        --add duo --add cake:budget=2048 --add chelsea:ratio=0.5 --add zipcache \
        --add shadowkv:budget=512,min_prompt=1024 --threads 1 --rounds 3 --steps 3 \
        --memory 4 --max-batch 24 --out "$OUT/batch-memory4-$TAG" ;;
    *) echo "unknown: $w" >&2; exit 2 ;;
  esac
done
