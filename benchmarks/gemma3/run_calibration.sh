#!/bin/sh
# The run that produced kvkit/data/duo_gemma-3-270m.json: a quick CPU calibration of Gemma-3-270m (base) on the
# shared 2-core machine, niced. Only the 3 global (full-attention) layers are gated; the 15 sliding-window
# layers run with the model's own 512-token window in both passes (kvkit leaves them to it). Samples are
# longer than that window so the global layers carry the passkeys. Settings scaled down from the paper
# (2000 steps, 1K-32K contexts, sink 128 / recent 256, 10 passkeys x 32 words) to finish in ~15-20 min.
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD"
exec nice -n 10 .venv/bin/python -m kvkit.cli calibrate duo --model gemma-3-270m --out kvkit/data/duo_gemma-3-270m.json \
  --steps 16 --length 768 --min-length 640 --passkeys 4 --passkey-words 8 --sink 32 --recent 128 --threads 2 \
  --time-limit 1080
