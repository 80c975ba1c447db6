#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): trajflow's operators in one process on a lent GPU,
# one table, under 10 minutes. Without CUDA it says what it would run and exits 0 (CI: a dry run).
#
#   bash scripts/gpu_check.sh --fetch-wheels     here, with the package registry: the wheels of
#                                                what the lent machine lacks, into .gpu_check/wheels
#   bash scripts/gpu_check.sh [--out FILE]       on the lent machine (carry .gpu_check with the tree)
#
# The lent machine (benchmarks/results/gpu.md) has python3 with PyTorch (CUDA), transformers,
# PEFT, pyarrow, safetensors, numpy, pandas, PyYAML, TensorBoard and psutil, and no network.
# It installs nothing: trajflow is imported from this tree, and pydantic (the config's; its core
# is compiled, so one wheel per CPU architecture) is unpacked from the carried wheels into a
# temporary directory on PYTHONPATH when the machine's Python lacks it. Ray, vLLM and polars are
# not needed: the check runs the in-process loop (pipelines/local.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.gpu_check/wheels

if [ "${1:-}" = "--fetch-wheels" ]; then
    # the versions this tree is tested with, for CPython 3.12 on x86_64 and aarch64 Linux
    versions=$("$PY" -c "import pydantic, pydantic_core; print(pydantic.VERSION, pydantic_core.__version__)")
    read -r pydantic core <<< "$versions"
    mkdir -p "$WHEELS"
    for platform in manylinux_2_17_x86_64 manylinux_2_17_aarch64; do
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform "$platform" -d "$WHEELS" "pydantic-core==$core"
    done
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" "pydantic==$pydantic" \
        annotated-types typing-inspection typing-extensions  # (torch brings the last; carried in case)
    du -sh "$WHEELS"
    exit 0
fi

if ! "$PY" -c "import pydantic" 2>/dev/null && [ -d "$WHEELS" ]; then
    unpacked=$(mktemp -d -t trajflow-gpu-check-XXXXXX)
    trap 'rm -rf "$unpacked"' EXIT
    arch=$(uname -m)
    for wheel in "$WHEELS"/*.whl; do
        case "$wheel" in
            *-none-any.whl|*"$arch"*.whl) "$PY" -m zipfile -e "$wheel" "$unpacked" ;;
        esac
    done
    export PYTHONPATH="$unpacked${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m benchmarks.gpu_check "$@"
