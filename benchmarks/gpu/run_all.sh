#!/bin/bash
# GPU decode, everything in ONE call of the device tool, sized for 10 minutes on an H100 / H200:
#   1. ops:      operators per compiled decode step (benchmarks/gpu/ops_per_step.py: full, streaming, snapkv; the
#                graph captured on the device, Triton path)                                   -> $OUT/ops.md
#   2. grid-1b:  python -m kvkit.evals.gpu.production --shape llama-3.2-1b: batch x length cells (memory computed
#                first, cells that do not fit are skipped and say why), hf-static + the compiled rows of full,
#                streaming, snapkv; the largest batch per policy at 32K  -> $OUT/grid-1b.md, $OUT/grid-1b.json
#   3. grid-8b:  the same for --shape llama-3.1-8b                        -> $OUT/grid-8b.md, $OUT/grid-8b.json
#   4. spec:     benchmarks/gpu/speculative_gpu.py: the streaming self-draft over static caches, compiled, at
#                batch 16 / 64 x 16K (1B shape): draft and verify ms per round, acceptance, speed-up over the
#                compiled plain step                                       -> $OUT/speculative.json
#   5. profile:  benchmarks/gpu/profile_step.py --compiled: torch.profiler over compiled steps of full, streaming,
#                snapkv at 16 x 16K: kernels per step, gaps between kernels, CUDA-graph replays -> $OUT/profile.txt
# plus $OUT/log.txt: 8 files in all (the most the device tool brings back).
#
# Time (seconds; each stage has its own limit inside, and a hard `timeout` of limit + 20): install ~15, ops T_OPS=30,
# grid-1b T_1B=130, grid-8b T_8B=130, spec T_SPEC=90, profile T_PROFILE=80: ~475 planned, <= 575 at the hard
# limits. A compiled row compiles in ~25-30 s on an H100, so each grid covers its first cells (CELLS_1B, CELLS_8B:
# the most wanted first) and marks the rest as skipped (time limit); run again with other CELLS_* for the rest.
#
# Prepare here (the machine has no network; kvkit needs transformers >= 5.19, the machine has 5.17):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 transformers==5.24.0 -d wheels/
# Device tool call:
#   run(command="bash benchmarks/gpu/run_all.sh", carry=["wheels"], timeout_s=600)
# CPU dry run (tiny shape, aot_eager compiles, short everything; ~3-4 minutes on 2 busy cores):
#   DRY=1 PY=.venv/bin/python OUT=/tmp/run_all bash benchmarks/gpu/run_all.sh
# Knobs (environment): OUT, PY (python3), SITE (/tmp/site), DEVICE (cuda), T_OPS / T_1B / T_8B / T_SPEC / T_PROFILE
# (0 skips a stage), CELLS_1B, CELLS_8B (BATCHxLENGTH,...), POLICIES ("full streaming snapkv"), SPEC_BATCHES (16,64).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/run_all_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
DRY=${DRY:-0}
POLICIES=${POLICIES:-full streaming snapkv}
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  DEVICE=${DEVICE:-cpu}
  T_OPS=${T_OPS:-200}; T_1B=${T_1B:-200}; T_8B=${T_8B:-200}; T_SPEC=${T_SPEC:-200}; T_PROFILE=${T_PROFILE:-200}
  SHAPE_1B=tiny; SHAPE_8B=tiny
  CELLS_1B=${CELLS_1B:-2x32}; CELLS_8B=${CELLS_8B:-1x48}
  OPS_POLICIES=full
  GRID_EXTRA=(--steps 2 --warmup 1 --probe-length 48 --compile-backend aot_eager)
  SPEC_ARGS=(--dry --batches "${SPEC_BATCHES:-2}" --rounds 2 --plain-steps 4)
  PROFILE_ARGS=(--shape tiny --batch 1 --length 64 --steps 2 --compile-backend aot_eager)
else
  export TRITON_INTERPRET=0
  DEVICE=${DEVICE:-cuda}
  T_OPS=${T_OPS:-30}; T_1B=${T_1B:-130}; T_8B=${T_8B:-130}; T_SPEC=${T_SPEC:-90}; T_PROFILE=${T_PROFILE:-80}
  SHAPE_1B=llama-3.2-1b; SHAPE_8B=llama-3.1-8b
  CELLS_1B=${CELLS_1B:-8x32768,1x130816,32x32768,1x8192,8x8192,32x8192,1x32768}
  CELLS_8B=${CELLS_8B:-8x32768,1x130816,32x32768,1x8192,8x8192,32x8192,1x32768}
  OPS_POLICIES=full,streaming,snapkv
  GRID_EXTRA=(--steps 10 --warmup 2)
  SPEC_ARGS=(--shape llama-3.2-1b --batches "${SPEC_BATCHES:-16,64}" --length 16384)
  PROFILE_ARGS=(--shape llama-3.2-1b --batch 16 --length 16384 --steps 5)
fi

main() {
  local t0=$SECONDS whl
  if [ "$DRY" != 1 ]; then
    whl=$(ls wheels/transformers-5.24.0-*.whl 2>/dev/null | head -1)
    if [ -z "$whl" ]; then
      echo "no wheels/transformers-5.24.0-*.whl: prepare it (see the header) and carry wheels"; return 1
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$whl" || return 1
    export PYTHONPATH=$SITE:$PWD
    command -v nvidia-smi >/dev/null && nvidia-smi --format=csv,noheader \
      --query-gpu=name,driver_version,memory.used,memory.total,temperature.gpu,clocks.sm,clocks.mem
  else
    export PYTHONPATH=$PWD
  fi
  $PY -c "import torch, transformers, kvkit; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| kvkit', kvkit.__version__, '| cuda', torch.cuda.is_available())" || return 1
  git rev-parse HEAD 2>/dev/null || echo "commit: ${KVKIT_GIT_COMMIT:-unknown}"
  if [ "$T_OPS" != 0 ]; then
    echo "== [$((SECONDS - t0))s] ops per compiled step ($OPS_POLICIES)"
    timeout $((T_OPS + 20)) $PY benchmarks/gpu/ops_per_step.py --policies "$OPS_POLICIES" --device "$DEVICE" \
      --out "$OUT/ops.md"
  fi
  if [ "$T_1B" != 0 ]; then
    echo "== [$((SECONDS - t0))s] grid $SHAPE_1B ($CELLS_1B)"
    # shellcheck disable=SC2086
    timeout $((T_1B + 20)) $PY -m kvkit.evals.gpu.production --shape "$SHAPE_1B" --device "$DEVICE" \
      --cells "$CELLS_1B" --policies $POLICIES --time-limit "$T_1B" --out /tmp/grid-1b "${GRID_EXTRA[@]}"
    cp /tmp/grid-1b/grid.md "$OUT/grid-1b.md"; cp /tmp/grid-1b/grid.json "$OUT/grid-1b.json"
  fi
  if [ "$T_8B" != 0 ]; then
    echo "== [$((SECONDS - t0))s] grid $SHAPE_8B ($CELLS_8B)"
    # shellcheck disable=SC2086
    timeout $((T_8B + 20)) $PY -m kvkit.evals.gpu.production --shape "$SHAPE_8B" --device "$DEVICE" \
      --cells "$CELLS_8B" --policies $POLICIES --time-limit "$T_8B" --out /tmp/grid-8b "${GRID_EXTRA[@]}"
    cp /tmp/grid-8b/grid.md "$OUT/grid-8b.md"; cp /tmp/grid-8b/grid.json "$OUT/grid-8b.json"
  fi
  if [ "$T_SPEC" != 0 ]; then
    echo "== [$((SECONDS - t0))s] speculative decoding over static caches"
    timeout $((T_SPEC + 20)) $PY benchmarks/gpu/speculative_gpu.py --device "$DEVICE" "${SPEC_ARGS[@]}" \
      --time-limit "$T_SPEC" --out /tmp/spec
    cp /tmp/spec/speculative.json "$OUT/speculative.json"
  fi
  if [ "$T_PROFILE" != 0 ]; then
    echo "== [$((SECONDS - t0))s] profile of compiled steps ($POLICIES)"
    # shellcheck disable=SC2086
    timeout $((T_PROFILE + 20)) $PY benchmarks/gpu/profile_step.py --compiled --device "$DEVICE" "${PROFILE_ARGS[@]}" \
      --policies $POLICIES --time-limit "$T_PROFILE" --out "$OUT/profile.txt" 2>&1 | grep -v USDT
  fi
  echo "== [$((SECONDS - t0))s] done"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=temperature.gpu,clocks.sm,clocks.mem --format=csv,noheader
  return 0
}

main 2>&1 | tee "$OUT/log.txt"
