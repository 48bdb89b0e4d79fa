#!/bin/bash
# The RULER 4K policy sweep on CPU (no GPU was lent): `kvkit eval sweep` prefills each sample's context
# once (exact attention) and replays it into every listed policy's cache. Two processes (1 thread each)
# split the 13 tasks and share the run folders (RunDir merges rows under a lock); every folder is
# resumable and continues the earlier rows (H100 samples of the former results/policies-4k-partial, in git history before its removal, and the CPU sweeps
# of earlier sessions, same options: a row does not depend on which other policies shared its prefill,
# tests/evals/test_shared_prefill.py).
# usage: bash benchmarks/policies/run_cpu.sh {6|7} {1|2|all}
#   6 = issue 6's settings (duo, tidal, cake), 7 = issue 7's (chelsea, zipcache, shadowkv);
#   1 / 2 = the two task halves (run both at once), all = every task (also rewrites each run's summary)
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
case ${1:-6} in
6) RUNS="--run duo054-4k=duo:sparsity=0.54 --run duo081-4k=duo:sparsity=0.81
 --run tidal1732kv-4k=tidal:budget=1732,selection=kv_head --run tidal550kv-4k=tidal:budget=550,selection=kv_head
 --run cake2048-4k=cake:budget=2048 --run cake1024-4k=cake:budget=1024" ;;
7) RUNS="--run chelsea50-4k=chelsea:ratio=0.5,protect=0 --run chelsea20-4k=chelsea:ratio=0.2,protect=0 --run chelsea25-4k=chelsea:ratio=0.25,protect=0
 --run zipcache-4k=zipcache --run zipcache84-4k=zipcache:high_bits=8,low_bits=4
 --run shadowkv1024-4k=shadowkv:budget=1024,min_prompt=2048
 --run zipcache84r40-4k=zipcache:high_bits=8,low_bits=4,high_ratio=0.4" ;;
*) echo "usage: $0 {6|7} {1|2|all}" >&2; exit 2 ;;
esac
S="nice -n 5 .venv/bin/kvkit eval sweep --model default --prompts results/policies/ruler-4096-s5.jsonl --out-root results/policies --resume $RUNS"
case ${2:-all} in
1) $S --tasks niah_single_1,niah_single_3,niah_multikey_2,niah_multivalue,vt,fwe,qa_2 ;;
2) $S --tasks niah_single_2,niah_multikey_1,niah_multikey_3,niah_multiquery,cwe,qa_1 ;;
all) $S ;;
*) echo "usage: $0 {6|7} {1|2|all}" >&2; exit 2 ;;
esac
