#!/bin/sh
# The calibrations that produced the shipped DuoAttention patterns, on the CPU (1 thread), in parts: each part stops
# at --time-limit seconds and --resume continues from <out>.ckpt.pt, so the parts together give the one-run result.
# They read only the essays from 66% of their characters on, text no evaluation reads.
#   sh benchmarks/duo/run_calibration.sh smollm2   # kvkit/data/duo_smollm2-135m-instruct.json (5,280 s in all)
#   sh benchmarks/duo/run_calibration.sh qwen05    # kvkit/data/duo_qwen2.5-coder-0.5b-instruct.json (5,735 s)
# Rerun until it reports the last step; results/calibration/README.md has what the patterns score.
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD"
case ${1:-smollm2} in
smollm2) exec nice -n 5 .venv/bin/python -m kvkit.cli calibrate duo --model default \
  --out kvkit/data/duo_smollm2-135m-instruct.json --steps 120 --length 4096 --min-length 1536 --passkeys 10 \
  --passkey-words 8 --resume --time-limit 3600 --threads 1 ;;
qwen05) exec nice -n 5 .venv/bin/python -m kvkit.cli calibrate duo --model qwen2.5-coder-0.5b \
  --out kvkit/data/duo_qwen2.5-coder-0.5b-instruct.json --steps 200 --length 1024 --min-length 768 --resume \
  --time-limit 5400 --threads 1 ;;
*) echo "usage: $0 {smollm2|qwen05}" >&2; exit 2 ;;
esac
