#!/usr/bin/env bash
# Runs the SGLang backend's tests against a real SGLang 0.5.23 server, on a machine with a CUDA GPU.
#
#   bash scripts/sglang_real_test.sh [MODEL_PATH] [PORT]
#
# Installs bubblespec[sglang] (sglang==0.5.23) into the current Python environment, launches a server on the tiny
# model that ships with bubblespec (or MODEL_PATH) with the flags the backend needs, waits for /health_generate,
# exports BUBBLESPEC_SGLANG_URL and runs `pytest tests/test_sglang.py -k real` (test_real_sglang_server and the
# conformance suite in TestSGLangEngineOnARealServer). The server is stopped on exit; its log is sglang-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -e '.[sglang,dev]'
MODEL_PATH="${1:-$(python -c 'from bubblespec.tasks.arithmetic import ArithmeticTask; print(ArithmeticTask.model_path())')}"
PORT="${2:-30000}"
URL="http://127.0.0.1:${PORT}"

python -m sglang.launch_server --model-path "$MODEL_PATH" --host 127.0.0.1 --port "$PORT" \
    --skip-tokenizer-init --enable-custom-logit-processor --disable-overlap-schedule --dtype float32 \
    --mem-fraction-static 0.3 >sglang-server.log 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT

for _ in $(seq 1 300); do
    if curl -sf "$URL/health_generate" >/dev/null; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "the SGLang server exited:"; tail -50 sglang-server.log; exit 1; fi
    sleep 2
done
curl -sf "$URL/health_generate" >/dev/null || { echo "the SGLang server did not become healthy"; tail -50 sglang-server.log; exit 1; }

export BUBBLESPEC_SGLANG_URL="$URL"
python -m pytest tests/test_sglang.py -k real -v -rs
