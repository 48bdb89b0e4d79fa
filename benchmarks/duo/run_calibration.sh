#!/bin/sh
# The run that produced kvkit/data/duo_smollm2-135m-instruct.json: a *quick CPU* calibration on the shared
# 2-core machine (load average ~6-13 from other jobs), niced. Settings scaled down from the paper
# (2000 steps, 1K-32K contexts, sink 128 / recent 256, 10 passkeys x 32 words) so it finishes in ~30 min (about 2 min per step at this load).
cd "$(dirname "$0")/../.."
exec nice -n 5 .venv/bin/kvkit calibrate duo --model default --out kvkit/data/duo_smollm2-135m-instruct.json \
  --steps 12 --length 640 --min-length 512 --passkeys 4 --passkey-words 8 --sink 32 --recent 128 --threads 2
