#!/usr/bin/env bash
# Fetch, on the development machine, the Python wheels that scripts/gpu_check.sh needs on the lent
# H200 machine (Python 3.12, no network there): DeepSpeed and the few of its dependencies that
# image lacks. They land in .whl/ (ignored by git; carry it with the device run).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic pydantic-core annotated-types typing-inspection hjson
ls -la .whl
