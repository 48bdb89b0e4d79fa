#!/bin/bash
# Replays a few committed RULER-4K samples of every policy through the current code and compares the rows
# (prediction, score, KV bytes) with the committed ones (results/ruler/smollm2-4k/): every row must come out the same.
# usage: bash benchmarks/replay/replay_committed.sh [TASKS] [INDEX]   (default: niah_single_1,qa_1 at index 4,
#        a CPU-made sample of every run); writes results/ruler/replay/ (rows + compare.md).
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TQDM_MININTERVAL=60 TOKENIZERS_PARALLELISM=false
TASKS=${1:-niah_single_1,qa_1}; INDEX=${2:-4}
OUT=results/ruler/replay; mkdir -p $OUT
.venv/bin/python - "$TASKS" "$INDEX" <<'PY'
import json, sys
tasks, index = sys.argv[1].split(","), int(sys.argv[2])
rows = [json.loads(l) for l in open("results/ruler/prompts/ruler-4096-s5.jsonl")]
keep = [r for r in rows if r["task"] in tasks and r["index"] == index]
with open("results/ruler/replay/prompts.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in keep)
print(len(keep), "prompts")
PY
.venv/bin/kvkit eval sweep --model default --prompts $OUT/prompts.jsonl --out-root $OUT --resume \
  --run full-4k=full --run streaming1024-4k=streaming:budget=1024 \
  --run duo054-4k=duo:sparsity=0.54,pattern=benchmarks/replay/duo_smollm2_2fa10fc.json --run tidal1732kv-4k=tidal:budget=1732,selection=kv_head,calibrated=False \
  --run cake1024-4k=cake:budget=1024,calibrated=False,protect_heads=0 --run chelsea20-4k=chelsea:ratio=0.2,protect=0,protect_heads=0 \
  --run zipcache84-4k=zipcache:high_bits=8,low_bits=4,calibrated=False,key_group=None,stats=auto --run shadowkv1024-4k=shadowkv:budget=1024,min_prompt=2048,calibrated=False
.venv/bin/python - <<'PY' | tee results/ruler/replay/compare.md
import json, pathlib
print("| run | sample | committed prediction | replayed prediction | same prediction | same score | same KV bytes |")
print("|---|---|---|---|---|---|---|")
for run in sorted(pathlib.Path("results/ruler/replay").glob("*-4k")):
    old_dir = f"results/ruler/smollm2-4k/{run.name}"
    old = {r["id"]: r for r in map(json.loads, open(f"{old_dir}/samples.jsonl"))}
    for r in map(json.loads, open(run / "samples.jsonl")):
        o = old[r["id"]]
        print(f"| {run.name} | {r['id']} | {o['prediction']!r} | {r['prediction']!r} | {o['prediction'] == r['prediction']} "
              f"| {o['score'] == r['score']} | {o.get('kv_bytes') == r.get('kv_bytes')} |")
PY
