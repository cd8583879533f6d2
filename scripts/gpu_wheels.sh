#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that scripts/gpu_check.sh needs on the GPU machine and its image
# lacks: pydantic and what it needs. The machine's Python is 3.12 on x86-64; run this where PyPI is reachable, then
# carry .whl/ with the repository (about 2 MB).
set -euo pipefail

PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}"
ls -la .whl
