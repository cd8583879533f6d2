#!/usr/bin/env bash
# Runs the SGLang backend's tests against a real SGLang 0.5.23 server, on a machine with a CUDA GPU.
#
#   bash scripts/sglang_real_test.sh [MODEL_PATH] [PORT]
#
# Installs bubblespec[sglang] (sglang==0.5.23) into the current Python environment, launches two servers on the tiny
# model that ships with bubblespec (or MODEL_PATH) with the flags the backend needs: one plain (PORT), one running
# bubblespec's speculative algorithm (PORT + 1: --speculative-algorithm BUBBLESPEC, registered by bubblespec's
# sglang.srt.plugins entry point, backends/sglang_server.py). It waits for /health_generate, exports
# BUBBLESPEC_SGLANG_URL and BUBBLESPEC_SGLANG_SPECULATIVE_URL and runs `pytest tests/test_sglang.py -k real`
# (test_real_sglang_server and the conformance suite on both routes). The servers are stopped on exit; their logs
# are sglang-server.log and sglang-server-speculative.log.
#
# Status: NOT RUN YET (it needs a CUDA GPU). The speculative server is the first run of the worker class that
# subclasses SGLang's NGRAMWorker; report what breaks.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -e '.[sglang,dev]'
MODEL_PATH="${1:-$(python -c 'from bubblespec.tasks.arithmetic import ArithmeticTask; print(ArithmeticTask.model_path())')}"
PORT="${2:-30000}"
URL="http://127.0.0.1:${PORT}"

launch() {  # launch PORT LOG EXTRA_FLAGS...: one server in the background; its pid in LAUNCHED
    local port=$1 log=$2
    shift 2
    python -m sglang.launch_server --model-path "$MODEL_PATH" --host 127.0.0.1 --port "$port" \
        --skip-tokenizer-init --enable-custom-logit-processor --disable-overlap-schedule --dtype float32 \
        --mem-fraction-static 0.3 "$@" >"$log" 2>&1 &
    LAUNCHED=$!
}
wait_healthy() {  # wait_healthy URL PID LOG
    for _ in $(seq 1 300); do
        if curl -sf "$1/health_generate" >/dev/null; then return 0; fi
        if ! kill -0 "$2" 2>/dev/null; then echo "the SGLang server exited:"; tail -50 "$3"; exit 1; fi
        sleep 2
    done
    echo "the SGLang server at $1 did not become healthy"; tail -50 "$3"; exit 1
}

launch "$PORT" sglang-server.log
SERVER_PID=$LAUNCHED
SPECULATIVE_PORT=$((PORT + 1))
launch "$SPECULATIVE_PORT" sglang-server-speculative.log --speculative-algorithm BUBBLESPEC --speculative-num-draft-tokens 9
SPECULATIVE_PID=$LAUNCHED
trap 'kill "$SERVER_PID" "$SPECULATIVE_PID" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
wait_healthy "$URL" "$SERVER_PID" sglang-server.log
SPECULATIVE_URL="http://127.0.0.1:${SPECULATIVE_PORT}"
wait_healthy "$SPECULATIVE_URL" "$SPECULATIVE_PID" sglang-server-speculative.log

export BUBBLESPEC_SGLANG_URL="$URL" BUBBLESPEC_SGLANG_SPECULATIVE_URL="$SPECULATIVE_URL"
python -m pytest tests/test_sglang.py -k real -v -rs
