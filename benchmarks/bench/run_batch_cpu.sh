#!/usr/bin/env bash
# Batched decode on CPU, every policy against full in one run (results/speed-cpu/README.md).
#   bash benchmarks/bench/run_batch_cpu.sh [8x4096|1x1024|memory|chunked ...]
# Output: $OUT/<what>-<DATE>: decode-b8x4096, decode-b1x1024, decode-fit-4gib-b8x4096, prefill-chunked-b8x4096
# (OUT default results/speed-cpu, DATE default today, UTC). Environment: THREADS (default 1,2), ROUNDS (3),
# STEPS (3), PREFILL_CACHE (a folder: the recorded 8 x 4096 exact prefill is kept there and reused by later runs),
# KVKIT_GIT_COMMIT (recorded as the measured commit, for a `git archive` export of a commit), KVKIT (command).
# Policies are listed slowest-path first so that an interrupted run (partial.json) has the ones that matter most.
set -euo pipefail
DATE=${DATE:-$(date -u +%F)}
WHICH=${*:-8x4096 1x1024}
KVKIT=${KVKIT:-kvkit}
OUT=${OUT:-results/speed-cpu}
THREADS=${THREADS:-1,2}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
CACHE=()
[ -n "${PREFILL_CACHE:-}" ] && CACHE=(--prefill-cache "$PREFILL_CACHE")
export KVKIT_NO_PROGRESS=1
for w in $WHICH; do
  case $w in
    8x4096)  # budgets: streaming/cake T/2, tidal T/4, shadowkv T/8 (min_prompt below the context); tidal q_head: the
      # paper's per-query-head selection (the default is selection=shared, which reads what kv_head reads)
      $KVKIT bench --model default --policy zipcache --lengths 4096 --batch 8 \
        --add tidal:budget=1024,selection=q_head --add tidal:budget=1024,selection=kv_head --add shadowkv:budget=512,min_prompt=1024 \
        --add chelsea:ratio=0.5,protect=0 --add cake:budget=2048 --add duo --add streaming:budget=2048 \
        --threads "$THREADS" --rounds "$ROUNDS" --steps "$STEPS" --profile "${CACHE[@]}" --out "$OUT/decode-b8x4096-$DATE" ;;
    1x1024)
      $KVKIT bench --model default --policy zipcache --lengths 1024 --batch 1 \
        --add tidal:budget=256,selection=q_head --add tidal:budget=256,selection=kv_head --add shadowkv:budget=128,min_prompt=512 \
        --add chelsea:ratio=0.5,protect=0 --add cake:budget=512 --add duo --add streaming:budget=512 \
        --threads "$THREADS" --rounds "$ROUNDS" --steps "$STEPS" --profile --out "$OUT/decode-b1x1024-$DATE" ;;
    memory)  # memory-saving policies (tidal saves reads, not memory)
      $KVKIT bench --model default --policy zipcache --lengths 4096 --batch 8 \
        --add shadowkv:budget=512,min_prompt=1024 --add chelsea:ratio=0.5,protect=0 --add cake:budget=2048 --add duo \
        --add streaming:budget=2048 --threads 1 --rounds "$ROUNDS" --steps "$STEPS" --memory 4 --max-batch 24 \
        "${CACHE[@]}" --out "$OUT/decode-fit-4gib-b8x4096-$DATE" ;;
    chunked)  # peak prefill memory at batch 8 x 4096: full one-shot vs every policy's chunked prefill
      $KVKIT bench --model default --policy streaming --budget 2048 --lengths 4096 --batch 8 --prefill-chunk 1024 \
        --oneshot full --decode-tokens 2 --add duo --add cake:budget=2048 --add chelsea:ratio=0.5,protect=0 --add zipcache \
        --add shadowkv:budget=512,min_prompt=1024 --threads 2 --out "$OUT/prefill-chunked-b8x4096-$DATE" ;;
    *) echo "unknown: $w" >&2; exit 2 ;;
  esac
done
