#!/usr/bin/env bash
# The first GPU run (scripts/gpu_check.py says what each stage checks and measures): one command, at most about five
# minutes on one NVIDIA GPU, writing OUT/gpu_check.json after every stage and a short table at the end.
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run    # tiny shapes on the CPU, seconds (tests/test_gpu_check.py runs it in CI)
#
# The GPU machine has PyTorch with CUDA, transformers, safetensors, typer, rich, prometheus-client and pyyaml, and no
# Ray, vLLM or pydantic, and nothing can be downloaded there. What it lacks travels as wheels in .whl/ (ignored by
# git): `bash scripts/gpu_wheels.sh` downloads them here; the script installs them and bubblespec itself (without
# dependencies) into a folder of its own. No model weights travel: the checkpoints are random, made there.
# The vLLM checks that need a GPU belong to scripts/bench_engine_gpu.sh, for a machine where vLLM is installed.
#
# Settings: OUT [gpu-check]  STAGES [all]  PYTHON [python3]
set -euo pipefail

OUT=${OUT:-gpu-check}
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

if ! "$PYTHON" -c "import bubblespec.backends.torch_engine" 2>/dev/null; then
    site=${GPU_CHECK_SITE:-/tmp/bubblespec-site}
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

stages=()
if [ -n "${STAGES:-}" ]; then stages=(--stages "$STAGES"); fi
exec "$PYTHON" scripts/gpu_check.py --out "$OUT" "${stages[@]}" "$@"
