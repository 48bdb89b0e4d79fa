#!/bin/bash
# The GPU decode benchmark (kvkit/evals/gpu_bench.py) on the lent GPU machine, everything in ONE call of the device
# tool: install the carried transformers 5.24.0 wheel (the machine has 5.17; kvkit needs >= 5.19), then
#   kvkit bench --shape llama-3.2-1b --device cuda --batch 16 --lengths 16384   (the issue's reference workload)
#   kvkit bench --shape llama-3.2-1b --device cuda --batch 1  --lengths 8192
# each with its own --time-limit, writing straight into $OUT (so a run cut short still brings back its rows):
#   $OUT/log.txt, $OUT/b16-16384/{config.json,rows.jsonl,summary.md}, $OUT/b1-8192/{...}   (7 files: limit is 8)
#
# What each run measures, in this order (the most wanted first: the time limit skips the last rows): kvkit full
# (eager; the reference), full static+compile, hf-dynamic, hf-static (StaticCache + torch.compile reduce-overhead),
# streaming, streaming static+compile, then snapkv, tidal, duo, cake (each eager, then static+compile) and chelsea,
# zipcache, shadowkv, kvzip (eager only: no static store; the summary's first line lists them with
# KVCache.compile_refusal's reason). A `<policy> static+compile` row: kvkit.patch(..., static=True,
# max_length=L+steps+margin), eager chunked prefill, then single-token steps through
# model.get_compiled_call(CompileConfig(fullgraph=True, mode="reduce-overhead")) (CUDA graphs; compression events
# eager between steps); its compile (first call + CUDA-graph warm-up and recording) is the "compile s" column, not
# in step ms, and counts against --time-limit.
#
# Time (estimates; compile ~60 s per compiled row on the H100, hf-static included; an eager row ~5-15 s at 16x16K):
# install + checks ~15 s; 16x16K run T_BIG=260 s (full, full s+c, hf-dynamic, hf-static, streaming, streaming s+c
# ~240 s, then whichever later rows still fit); 1x8K run T_SMALL=115 s (full, full s+c, hf-dynamic, and what fits
# of hf-static / streaming / streaming s+c). A row starts only if its estimate (compile included) fits the limit, so
# a run may overrun its limit by one misestimated row: ~390 s planned, timeout_s=440 leaves ~50 s of that, and with
# the machine's start (~1-1.5 min) the call stays within ~9 minutes of the 15-minute device budget.
#
# Prepare here (the machine has no network; wheels/ is git-ignored and travels as a carried path):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 transformers==5.24.0 -d wheels/
# Device tool call (one machine start + ~6.5 minutes):
#   run(command="KVKIT_GIT_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu/device_bench.sh",
#       carry=["wheels"], timeout_s=440)
# Knobs (environment): SHAPE (llama-3.2-1b), DEVICE (cuda), T_BIG / T_SMALL (each run's --time-limit, seconds:
# 260 / 115), EXTRA (more `kvkit bench` arguments for both runs, e.g. "--no-cudnn-sdpa", "--no-compiled" (no kvkit
# static+compile rows) or "--policies full streaming"), SITE (where the wheel goes: /tmp/site), OUT, PY (python3).
# A dry run on a CPU machine (tiny shape; aot_eager keeps the compiles to seconds; ~2-3 minutes on 2 busy cores):
#   DEVICE=cpu SHAPE=tiny PY=.venv/bin/python SITE=/tmp/x-site OUT=/tmp/x T_BIG=60 T_SMALL=30 \
#     EXTRA="--no-compile --compile-backend aot_eager --steps 4" bash benchmarks/gpu/device_bench.sh
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
T_BIG=${T_BIG:-260}
T_SMALL=${T_SMALL:-115}
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
