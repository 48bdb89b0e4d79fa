#!/bin/bash
# The GPU decode benchmark (kvkit/evals/gpu_bench.py) on the lent GPU machine, everything in ONE call of the device
# tool: install the carried transformers 5.24.0 wheel (the machine has 5.17; kvkit needs >= 5.19), then
#   kvkit bench --shape llama-3.2-1b --device cuda --batch 16 --lengths 16384   (the issue's reference workload)
#   kvkit bench --shape llama-3.2-1b --device cuda --batch 1  --lengths 8192
# each with its own --time-limit, writing straight into $OUT (so a run cut short still brings back its rows):
#   $OUT/log.txt, $OUT/b16-16384/{config.json,rows.jsonl,summary.md}, $OUT/b1-8192/{...}   (7 files: limit is 8)
#
# Prepare here (the machine has no network; wheels/ is git-ignored and travels as a carried path):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 transformers==5.24.0 -d wheels/
# Device tool call (one machine start + ~7 minutes; leaves room in a 15-minute lease):
#   run(command="KVKIT_GIT_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu/device_bench.sh",
#       carry=["wheels"], timeout_s=540)
# Knobs (environment): SHAPE (llama-3.2-1b), DEVICE (cuda), T_BIG / T_SMALL (each run's --time-limit, seconds:
# 250 / 130), EXTRA (more `kvkit bench` arguments for both runs, e.g. "--no-cudnn-sdpa" or "--policies full
# streaming"), SITE (where the wheel goes: /tmp/site), OUT, PY (python3). A dry run on a CPU machine:
#   DEVICE=cpu SHAPE=tiny PY=.venv/bin/python SITE=/tmp/x-site OUT=/tmp/x T_BIG=40 T_SMALL=20 \
#     EXTRA="--no-compile --steps 4" bash benchmarks/gpu/device_bench.sh
# The wheel's requirements (huggingface-hub >= 1.31, tokenizers >= 0.23.1, safetensors >= 0.8, regex, typer) are met
# by the machine's own packages (huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0; checked below).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device_bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
PY=${PY:-python3}
SHAPE=${SHAPE:-llama-3.2-1b}
DEVICE=${DEVICE:-cuda}
SITE=${SITE:-/tmp/site}
T_BIG=${T_BIG:-250}
T_SMALL=${T_SMALL:-130}
EXTRA=${EXTRA:-}

main() {
  local t0=$SECONDS whl
  whl=$(ls wheels/transformers-5.24.0-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    echo "no wheels/transformers-5.24.0-*.whl: prepare it (see the header) and carry wheels"; return 1
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$whl" || return 1
  export PYTHONPATH=$SITE:$PWD
  $PY - <<'EOF' || return 1
import importlib.metadata as md
import torch, transformers
assert transformers.__version__ == "5.24.0", transformers.__version__
print("torch", torch.__version__, "| transformers", transformers.__version__, "|",
      ", ".join(f"{p} {md.version(p)}" for p in ("triton", "huggingface_hub", "tokenizers", "safetensors", "regex")))
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| free/total GiB",
          [round(x / 2**30, 1) for x in torch.cuda.mem_get_info()])
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --format=csv,noheader \
    --query-gpu=name,driver_version,memory.used,memory.total,temperature.gpu,clocks.sm,clocks.mem
  echo "== [$((SECONDS - t0))s] batch 16 x 16384"
  $PY -m kvkit.cli bench --shape "$SHAPE" --device "$DEVICE" --batch 16 --lengths 16384 --time-limit "$T_BIG" \
    --out "$OUT/b16-16384" $EXTRA
  echo "== [$((SECONDS - t0))s] batch 1 x 8192"
  $PY -m kvkit.cli bench --shape "$SHAPE" --device "$DEVICE" --batch 1 --lengths 8192 --time-limit "$T_SMALL" \
    --out "$OUT/b1-8192" $EXTRA
  echo "== [$((SECONDS - t0))s] done"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
  return 0
}

main 2>&1 | tee "$OUT/log.txt"
