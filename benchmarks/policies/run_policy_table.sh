#!/bin/bash
# Issue 19 evidence on RULER-4K (default model), CPU, 1 thread each, resumable.
# usage: bash benchmarks/policies/run_issue19.sh agnostic   # one shared-prefill sweep (question-agnostic)
#        bash benchmarks/policies/run_issue19.sh qaware     # SnapKV with the question in the prefill (own prefills),
#                                                           # budgets interleaved sample-by-sample (index-major)
#        bash benchmarks/policies/run_issue19.sh chelsea-qaware  # Chelsea with protect, the question in the prefill
#        bash benchmarks/policies/run_issue19.sh chelsea-agnostic  # Chelsea protected by reconstruction scores
# The calibrated tidal / zipcache / shadowkv runs use no options: the policy reads the model's shipped
# calibration (kvkit/data/calibration/<model>.json); CAL="shadowkv" (a subset) or CAL="" limits them,
# SNAP=0 leaves the SnapKV runs out (sixth session: one sweep SNAP=1 CAL=shadowkv, one SNAP=0 CAL="tidal zipcache";
# eighth: SNAP=0 CAL="tidalrf shadowkv2048").
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
P=results/policies/ruler-4096-s5.jsonl
# `kvkit calibrate tidal --model default --out kvkit/data/calibration/smollm2-135m-instruct.json --threads 1` (read
# fraction 0.5): layers [2, 6, 10, 14, 18, 22, 26]; budget 1132 puts the reads at 0.50 of full's at 3968 tokens
TIDAL_RF="tidalrf1132kv-4k=tidal:budget=1132,selection=kv_head,select_layers=[2,6,10,14,18,22,26]"
case ${1:-agnostic} in
agnostic)
  RUNS=""
  [ "${SNAP:-1}" = 1 ] && RUNS="--run snapkv2048-4k=snapkv:budget=2048 --run snapkv1024-4k=snapkv:budget=1024"
  for c in ${CAL-shadowkv tidal zipcache}; do
    case $c in
    shadowkv) RUNS="$RUNS --run shadowkvcal1024-4k=shadowkv:budget=1024,min_prompt=2048" ;;
    tidal) RUNS="$RUNS --run tidalcal1732kv-4k=tidal:budget=1732,selection=kv_head" ;;  # the first calibration's layers
    tidalrf) RUNS="$RUNS --run $TIDAL_RF" ;;  # the read-fraction calibration's layout at half the reads (TIDAL_RF above)
    shadowkv2048) RUNS="$RUNS --run shadowkvcal2048-4k=shadowkv:budget=2048,min_prompt=2048" ;;  # paper budget
    zipcache) RUNS="$RUNS --run zipcachecal-4k=zipcache" ;;
    esac
  done
  nice -n 5 .venv/bin/kvkit eval sweep --model default --prompts $P --out-root results/policies --resume $RUNS ;;
qaware)
  # QPOL="snapkv cake" (default) / QBUD="2048 1024" (default) choose the runs; cake1024-4k-qaware was run before
  # CAKE's tau calibration (taus 1, 1), cake2048-4k-qaware uses the calibrated taus. QTAG names new folders
  # ($p$b$QTAG-4k-qaware): the snapkv*-4k-qaware folders were run with the paper's pooling (kernel 5, avg), before
  # `kvkit calibrate snapkv`; QPOL=snapkv QBUD=2048 QTAG=cal runs the calibrated pooling (ninth session)
  for n in 1 2 3 4 5; do
    for b in ${QBUD:-2048 1024}; do
      for p in ${QPOL:-snapkv cake}; do
        nice -n 5 .venv/bin/kvkit eval ruler --model default --policy $p --budget $b --full-prompt-prefill \
          --prompts $P --samples $n --out results/policies/$p$b${QTAG:-}-4k-qaware --resume
      done
    done
  done ;;
chelsea-qaware)
  # thirteenth session: Chelsea with the question in the prefill. protect 0.4 keeps 26 of each chunk's 32 slots exact
  # (the most attended by the question); with protect > 0 the chunk size and the protection's pooling come from the
  # model's `kvkit calibrate chelsea` (chelsea50p40cal); CHQ="fallback" adds protect 0.4 with kvkit's fallback
  # (64-token chunks, kernel 7 max centered: chelsea50p40), CHQ="paper" the paper's matching (protect 0)
  for n in 1 2 3 4 5; do
    nice -n 5 .venv/bin/kvkit eval ruler --model default --policy chelsea --opt ratio=0.5,protect=0.4 \
      --full-prompt-prefill --prompts $P --samples $n --out results/policies/chelsea50p40cal-4k-qaware --resume
    case ${CHQ:-} in
    fallback) nice -n 5 .venv/bin/kvkit eval ruler --model default --policy chelsea \
      --opt ratio=0.5,protect=0.4,calibrated=false --full-prompt-prefill --prompts $P --samples $n \
      --out results/policies/chelsea50p40-4k-qaware --resume ;;
    paper) nice -n 5 .venv/bin/kvkit eval ruler --model default --policy chelsea --opt ratio=0.5,protect=0 --full-prompt-prefill \
      --prompts $P --samples $n --out results/policies/chelsea50-4k-qaware --resume ;;
    esac
  done ;;
chelsea-agnostic)
  # fourteenth session: Chelsea question-agnostic with the protection scored by KVzip's context reconstruction
  # (protect_score=reconstruct: the context repeated on top of the cache, about two prefills more), the protected
  # slots ranked per KV head over the whole context (protect_scope=context); CHS=chunk adds the chunk-scoped ranking
  # (chelsea50rc). Own prefills (the pass runs after the prefill: a replayed prefill would skip it).
  nice -n 5 .venv/bin/kvkit eval ruler --model default --policy chelsea \
    --opt ratio=0.5,protect_score=reconstruct,protect_scope=context --prompts $P --samples 5 \
    --out results/policies/chelsea50rcx-4k --resume
  [ "${CHS:-}" = chunk ] && nice -n 5 .venv/bin/kvkit eval ruler --model default --policy chelsea \
    --opt ratio=0.5,protect_score=reconstruct --prompts $P --samples 5 --out results/policies/chelsea50rc-4k --resume ;;
*) echo "usage: $0 {agnostic|qaware|chelsea-qaware|chelsea-agnostic}" >&2; exit 2 ;;
esac
