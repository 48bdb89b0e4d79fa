#!/bin/bash
# The GPU decode benchmark (kvkit/evals/gpu/) on the lent GPU machine, everything in ONE call of the device
# tool: install the carried transformers 5.24.0 wheel (the machine has 5.17; kvkit needs >= 5.19), then
#   1. the CUDA tests (DEVICE=cuda, KERNEL_TESTS=1; TRITON_INTERPRET=0): `-k cuda` of tests/kernels/test_kernels_{fused_decode,
#      quant,sparse,lowrank_scoring}.py (the compiled Triton kernels vs fp64 / torch references) and
#      tests/core/test_compiled_decode.py (a static cache's step under inductor + CUDA graphs = the eager tokens), cut at
#      T_TESTS seconds;
#   2. "compiled": the rows that can beat the full cache on a GPU (CUDA graphs take the host out of the step):
#        kvkit bench --shape llama-3.2-1b --device cuda --batch 16 --lengths 16384 \
#          --policies full hf-static streaming snapkv duo cake tidal kvzip chelsea zipcache shadowkv
#      = full, full static+compile, hf-static (StaticCache + torch.compile reduce-overhead), streaming, streaming
#      static+compile, snapkv, snapkv static+compile, ... as far as T_COMPILED allows (a compile: 7.5-19 s on an H100);
#      every policy has a static store (shadowkv's compiled row keeps its values on the device: offload=False);
#   3. (T_EAGER > 0) "eager": EAGER_ROWS eager only, at the same workload:
#        kvkit bench ... --no-compiled --policies $EAGER_ROWS
#   4. "profile" (T_PROFILE > 0): benchmarks/gpu/profile_step.py, every policy eager: wall vs device time per step,
#      kernels per step, the top device / host operators -> $OUT/profile.txt;
#   5. (T_SMALL > 0) batch 1 x 8192, default rows.
# Each run has its own --time-limit and writes straight into $OUT (a run cut short still brings back its rows):
#   $OUT/log.txt, $OUT/compiled/{config.json,rows.jsonl,summary.md}, $OUT/eager/{...}, $OUT/profile.txt   (8 files:
#   the limit; with T_SMALL > 0 set T_PROFILE=0: the small run's summary.md alone is kept, as $OUT/b1-8192.md)
# A `<policy> static+compile` row: kvkit.patch(..., static=True, max_length=L+steps+margin), eager chunked prefill,
# then single-token steps through model.get_compiled_call(CompileConfig(fullgraph=True, mode="reduce-overhead"))
# (CUDA graphs; compression events eager between steps; the attention read is torch.ops.kvkit.view_decode, the
# fused split-K kernel); its compile (first call + CUDA-graph warm-up and recording) is the "compile s" column, not
# in step ms, and counts against --time-limit.
#
# Time: install + checks ~15 s; CUDA tests <= T_TESTS=90 s; compiled run T_COMPILED=340 s (a compiled row ~25-30
# s, an eager row ~7-10 s at 16 x 16K); T_EAGER=0; T_PROFILE=0; T_SMALL=0. A row starts only if its
# estimate (compile included) fits the limit, so a run may overrun its limit by one misestimated row: ~445 s
# planned; timeout_s=540 leaves ~95 s of overrun, and with the machine's start (~1-1.5 min) the call takes ~10-11
# minutes of the 15-minute device budget.
# Runs: results/speed-gpu/ (H200 and H100, 16 x 16K).
#
# Prepare here (the machine has no network; wheels/ is git-ignored and travels as a carried path):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 transformers==5.24.0 -d wheels/
# Device tool call:
#   run(command="KVKIT_GIT_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu/device_bench.sh",
#       carry=["wheels"], timeout_s=540)
# Knobs (environment): SHAPE (llama-3.2-1b), DEVICE (cuda), BATCH (16), LENGTH (16384), T_TESTS / T_COMPILED /
# T_EAGER / T_PROFILE / T_SMALL (seconds: 90 / 340 / 0 / 0 / 0; 0 skips that step), KERNEL_TESTS (1),
# COMPILED_ROWS, EAGER_ROWS (the --policies lists above), EXTRA (more `kvkit bench` arguments for every run, e.g.
# "--no-cudnn-sdpa"), SITE (where the wheel goes: /tmp/site), OUT, PY (python3).
# A dry run on a CPU machine (tiny shape; aot_eager keeps the compiles to seconds; ~1 minute on 2 busy cores):
#   DEVICE=cpu SHAPE=tiny BATCH=1 LENGTH=2048 PY=.venv/bin/python SITE=/tmp/x-site OUT=/tmp/x T_EAGER=40 \
#     T_COMPILED=40 T_PROFILE=20 EXTRA="--no-compile --compile-backend aot_eager --steps 4" \
#     bash benchmarks/gpu/device_bench.sh
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
BATCH=${BATCH:-16}
LENGTH=${LENGTH:-16384}
T_TESTS=${T_TESTS:-90}
T_COMPILED=${T_COMPILED:-340}
T_EAGER=${T_EAGER:-0}
T_PROFILE=${T_PROFILE:-0}
T_SMALL=${T_SMALL:-0}
KERNEL_TESTS=${KERNEL_TESTS:-1}
COMPILED_ROWS=${COMPILED_ROWS:-full hf-static streaming snapkv duo cake tidal kvzip chelsea zipcache shadowkv}
EAGER_ROWS=${EAGER_ROWS:-full shadowkv:offload=False}
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
  if [ "$DEVICE" = cuda ] && [ "$KERNEL_TESTS" = 1 ] && [ "$T_TESTS" != 0 ]; then
    echo "== [$((SECONDS - t0))s] CUDA tests (TRITON_INTERPRET=0; at most ${T_TESTS}s)"
    timeout "$T_TESTS" $PY -m pytest -q -p no:cacheprovider -k cuda -rf tests/kernels/test_kernels_fused_decode.py \
      tests/kernels/test_kernels_quant.py tests/kernels/test_kernels_sparse.py tests/kernels/test_kernels_lowrank_scoring.py \
      tests/core/test_compiled_decode.py 2>&1 | grep -v "^SKIPPED" | tail -40
  fi
  if [ "$T_COMPILED" != 0 ]; then
    echo "== [$((SECONDS - t0))s] compiled: batch $BATCH x $LENGTH"
    # shellcheck disable=SC2086
    $PY -m kvkit.cli bench --shape "$SHAPE" --device "$DEVICE" --batch "$BATCH" --lengths "$LENGTH" \
      --policies $COMPILED_ROWS --time-limit "$T_COMPILED" --out "$OUT/compiled" $EXTRA
  fi
  if [ "$T_EAGER" != 0 ]; then
    echo "== [$((SECONDS - t0))s] eager: batch $BATCH x $LENGTH"
    # shellcheck disable=SC2086
    $PY -m kvkit.cli bench --shape "$SHAPE" --device "$DEVICE" --batch "$BATCH" --lengths "$LENGTH" --no-compiled \
      --policies $EAGER_ROWS --time-limit "$T_EAGER" --out "$OUT/eager" $EXTRA
  fi
  if [ "$T_PROFILE" != 0 ]; then
    echo "== [$((SECONDS - t0))s] profile: batch $BATCH x $LENGTH, one decode step per policy under torch.profiler"
    timeout $((T_PROFILE + 30)) $PY benchmarks/gpu/profile_step.py --shape "$SHAPE" --device "$DEVICE" \
      --batch "$BATCH" --length "$LENGTH" --time-limit "$T_PROFILE" --out "$OUT/profile.txt" 2>&1 | grep -v USDT
  fi
  if [ "$T_SMALL" != 0 ]; then
    echo "== [$((SECONDS - t0))s] batch 1 x 8192"
    # shellcheck disable=SC2086
    $PY -m kvkit.cli bench --shape "$SHAPE" --device "$DEVICE" --batch 1 --lengths 8192 --time-limit "$T_SMALL" \
      --out /tmp/b1-8192 $EXTRA && cp /tmp/b1-8192/summary.md "$OUT/b1-8192.md"
  fi
  echo "== [$((SECONDS - t0))s] done"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
  return 0
}

main 2>&1 | tee "$OUT/log.txt"
